"""The engine's view of one job: identity, ordering keys, progress and the runner's state."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class JobCancelled(Exception):
    """The job was cancelled (or expired) while in the engine; it left the batch."""


class JobExpired(JobCancelled):
    """The job could no longer meet its deadline; the message says why (SLO admission)."""


@dataclass(eq=False)
class EngineJob:
    job_id: str
    total_steps: int
    priority: int = 0
    deadline: float | None = None  # absolute epoch seconds
    arrival: float = field(default_factory=time.monotonic)
    steps_done: int = 0
    state: Any = None  # owned by the runner
    future: Future = field(default_factory=Future)
    # Cost-model inputs (mask-aware routing, SLO admission, planning).
    mask_ratio: float = 1.0
    masked_tokens: tuple[int, ...] | None = None  # per UNet level, when the runner built token masks
    cached: bool = False  # computes masked tokens only (its template cache is in use)
    template_id: str = ""
    expired_reason: str | None = None
    # Size and rows (the resolution-aware step-time predictor, bucketed batching): set by the engine
    # from the runner's state (latent grid; 2 rows with classifier-free guidance).
    latent_hw: tuple[int, int] | None = None
    rows: int = 2
    # A user's deadline is hard (a job that cannot meet it expires); a default one from the service's
    # SLO factor is soft: it orders SLO-aware admission, a job late for it still runs (last).
    hard_deadline: bool = True
    # SLO-aware admission's verdict at its last look: a waiting job whose soft deadline is out of reach
    # runs behind every job that can still make its own. The engine publishes it: routers do not count
    # such a job ahead of a new one.
    late: bool = False

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.total_steps

    @property
    def remaining(self) -> int:
        return max(0, self.total_steps - self.steps_done)

    @property
    def user_deadline(self) -> bool:
        """A deadline the user set (hard), which plain batching orders by; a default one does not."""
        return self.deadline is not None and self.hard_deadline

    def sort_key(self) -> tuple[float, float, float]:
        """Admission order: higher priority, then earlier (user) deadline, then earlier arrival.
        Default (soft) deadlines do not reorder plain FCFS batching: only SLO-aware admission uses them."""
        deadline = self.deadline if self.user_deadline else float("inf")
        return (-self.priority, deadline, self.arrival)

    def slack(self, now: float, seconds_needed: float) -> float:
        """Seconds to spare if the job needed ``seconds_needed`` from ``now`` (inf: no deadline)."""
        if self.deadline is None:
            return float("inf")
        return self.deadline - now - seconds_needed
