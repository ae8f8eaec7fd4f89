"""Batch scheduler: decides which jobs run in the next denoising step. Pure bookkeeping.

This is the "scheduler" half of the engine (the runner executes). Continuous batching admits
waiting jobs into free slots at every step, so jobs join and leave the running batch step by
step; static batching (the baseline) admits only when the running batch has drained.
"""

from __future__ import annotations

from workers.engine.job import EngineJob

MODES = ("continuous", "static")


class BatchScheduler:
    def __init__(self, max_batch: int, mode: str = "continuous") -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if mode not in MODES:
            raise ValueError(f"batching mode must be one of {MODES}, got {mode!r}")
        self.max_batch = max_batch
        self.mode = mode
        self.waiting: list[EngineJob] = []
        self.running: list[EngineJob] = []

    def add(self, job: EngineJob) -> None:
        self.waiting.append(job)

    def remove(self, job_id: str) -> EngineJob | None:
        """Take a job out wherever it is (cancellation); returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for job in queue:
                if job.job_id == job_id:
                    queue.remove(job)
                    return job
        return None

    def jobs(self) -> list[EngineJob]:
        return self.running + self.waiting

    def schedule(self) -> tuple[list[EngineJob], list[EngineJob]]:
        """Admit waiting jobs per the batching mode; returns (batch for this step, newly admitted)."""
        admitted: list[EngineJob] = []
        if self.mode == "continuous" or not self.running:
            self.waiting.sort(key=EngineJob.sort_key)
            while self.waiting and len(self.running) < self.max_batch:
                job = self.waiting.pop(0)
                self.running.append(job)
                admitted.append(job)
        return list(self.running), admitted

    def complete_step(self, batch: list[EngineJob]) -> list[EngineJob]:
        """Count one step for each job of the batch; retire and return the finished ones."""
        finished = []
        for job in batch:
            job.steps_done += 1
            if job.finished:
                finished.append(job)
        for job in finished:
            if job in self.running:
                self.running.remove(job)
        return finished
