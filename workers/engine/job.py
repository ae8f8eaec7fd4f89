"""The engine's view of one job: identity, ordering keys, progress and the runner's state."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class JobCancelled(Exception):
    """The job was cancelled (or expired) while in the engine; it left the batch."""


@dataclass(eq=False)
class EngineJob:
    job_id: str
    total_steps: int
    priority: int = 0
    deadline: float | None = None
    arrival: float = field(default_factory=time.monotonic)
    steps_done: int = 0
    state: Any = None  # owned by the runner
    future: Future = field(default_factory=Future)
    # Cost-model inputs (mask-aware routing and planning).
    mask_ratio: float = 1.0

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.total_steps

    def sort_key(self) -> tuple[float, float, float]:
        """Admission order: higher priority, then earlier deadline, then earlier arrival."""
        deadline = self.deadline if self.deadline is not None else float("inf")
        return (-self.priority, deadline, self.arrival)
