"""Re-drives jobs whose work vanished, so no job stays non-terminal after a process dies.

Why: Celery's Redis transport pops a message before it records it as unacknowledged (a worker
killed in between loses it for good), and unacknowledged messages of a dead worker come back
only after the broker's visibility timeout (an hour by default). Every task is idempotent against
the job record, so re-sending a job's chain is always safe; this decides when it is needed.

A live job (``stencil:jobs:live``) has *stalled* when nothing has touched its record for
``STENCIL_STALL_TIMEOUT_S`` (status timestamps, engine progress, an earlier re-drive) and no
engine holds its denoising lease (engines renew it every step, for running and waiting jobs).
Then, by status:
- ``queued``: left to the intake stream (at-least-once: an unacknowledged entry is reclaimed);
- a message naming it still in its worker's stage or GPU queue (``routed``, ``waiting``, or any
  status after a re-drive): a backlog, not a loss (unless that GPU worker is dead and another is
  alive: then it moves there);
- otherwise (a prepare/finalize whose CPU worker died, a denoise whose message or engine
  vanished): the chain is sent again, to the job's worker if it is alive, else to a live one.
After ``max_redrives`` re-drives (the dispatcher's ``MAX_REDRIVES``) the job fails with the reason. One dispatcher sweeps at
a time (a Redis lock); each pass reads a bounded number of the oldest live jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from app.celery_app import CPU_QUEUE, gpu_queue, stage_queue
from app.jobs import LIVE_KEY, JobStatus, JobStore
from app.keys import LEASE_PREFIX

log = logging.getLogger(__name__)

LOCK_KEY = "stencil:sweeper:lock"
WORKER_STATE_PREFIX = "stencil:worker:"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Sweeper:
    """One pass = ``sweep()``; ``send_chain(job_id, worker_id)`` re-sends a job's chain."""

    def __init__(self, client: redis.Redis, jobs: JobStore, send_chain: Callable[[str, str], None], *,
                 worker_ids: list[str], stall_timeout_s: float, max_redrives: int, worker_stale_s: float,
                 batch: int = 500, clock: Callable[[], float] = time.time, stage_placement: str = "cpu") -> None:
        self.r = client
        self.stage_placement = stage_placement
        self.jobs = jobs
        self.send_chain = send_chain
        self.worker_ids = worker_ids
        self.stall_timeout_s = stall_timeout_s
        self.max_redrives = max_redrives
        self.worker_stale_s = worker_stale_s
        self.batch = batch
        self.clock = clock

    def sweep(self, holder: str) -> dict[str, int]:
        """One pass under the lock; returns counts (redriven, failed, checked)."""
        counts = {"checked": 0, "redriven": 0, "failed": 0}
        if not self.r.set(LOCK_KEY, holder, nx=True, ex=max(5, int(self.stall_timeout_s))):
            if _s(self.r.get(LOCK_KEY) or b"") != holder:
                return counts
        now = self.clock()
        # Only jobs older than the timeout can have stalled: the set is scored by submission time.
        ids = [_s(i) for i in self.r.zrangebyscore(LIVE_KEY, "-inf", now - self.stall_timeout_s, start=0,
                                                   num=self.batch)]
        for job_id in ids:
            counts["checked"] += 1
            outcome = self._check(job_id, now)
            if outcome in counts:
                counts[outcome] += 1
        return counts

    def _check(self, job_id: str, now: float) -> str:
        fields = {_s(k): _s(v) for k, v in self.r.hgetall(self.jobs.key(job_id)).items()}
        status = fields.get("status")
        if not status:  # expired record: nothing to do but forget it
            self.r.zrem(LIVE_KEY, job_id)
            return "gone"
        if JobStatus(status).terminal:
            self.r.zrem(LIVE_KEY, job_id)
            return "terminal"
        if status == JobStatus.QUEUED.value:
            return "intake"  # the stream's pending-entry reclaim owns it
        last = max((float(v) for k, v in fields.items() if k.startswith("ts_") and _is_float(v)), default=0.0)
        if now - last < self.stall_timeout_s or self.r.exists(LEASE_PREFIX + job_id):
            return "moving"
        worker = fields.get("worker", "").removeprefix("gpu.")
        if self._backlog(job_id, worker):
            return "backlog"  # waits for a live consumer (or for any GPU worker to come back)
        redrives = int(fields.get("redrives") or 0)
        if redrives >= self.max_redrives:
            self.jobs.fail(job_id, f"stalled in {status}: no progress for {self.stall_timeout_s:.0f} s after "
                                   f"{redrives} re-drives")
            return "failed"
        target = worker if self._alive(worker) else next((w for w in self.worker_ids if self._alive(w)), worker)
        self.jobs.update(job_id, redrives=redrives + 1, ts_redriven=repr(now), worker=f"gpu.{target}")
        self.send_chain(job_id, target)
        log.warning("job %s stalled in %s for %.0f s: chain re-sent to gpu.%s (re-drive %d)", job_id, status,
                    now - last, target, redrives + 1)
        return "redriven"

    def _backlog(self, job_id: str, worker: str) -> bool:
        """A message naming the job waits in its worker's stage or GPU queue, whose consumer is alive
        (or no GPU worker is). Either queue, whatever the status: a re-driven job keeps the status it
        stalled in (``denoising``) while its new chain waits behind the surviving worker's backlog."""
        stages = stage_queue(worker, self.stage_placement)
        for queue in (gpu_queue(worker), stages):
            if self._queued(queue, job_id):
                return queue == CPU_QUEUE or self._alive(worker) or not any(map(self._alive, self.worker_ids))
        return False

    def _queued(self, queue: str, job_id: str) -> bool:
        """Whether a message naming the job waits in a Celery queue (a Redis list of JSON)."""
        needle = job_id.encode()
        return any(needle in raw for raw in self.r.lrange(queue, 0, -1))

    def _alive(self, worker: str) -> bool:
        updated = self.r.hget(WORKER_STATE_PREFIX + worker, "updated")
        return updated is not None and self.clock() - float(_s(updated)) < self.worker_stale_s


def _is_float(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False
