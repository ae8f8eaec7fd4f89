"""The engine: one long-lived thread that owns the device and runs step-level batches.

Every iteration: take new jobs from the inbox, drop cancelled ones, let the scheduler admit
waiting jobs, run ONE denoising step for the whole batch, retire finished jobs (resolving their
futures) and report progress. Callers (Celery ``denoise`` tasks on other threads) only ever touch
the thread-safe inbox and their job's future; all model state stays on the engine thread.

A runner with ``settle`` may launch a step without reading its results (on a GPU,
``workers/engine/settle.py``): its jobs that turn out non-finite are failed when the runner reads
them, one step later, and a job's result is handed over once its last step was read (at the next
step, or as soon as the engine idles).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from workers.engine.job import EngineJob, JobCancelled
from workers.engine.scheduler import BatchScheduler

log = logging.getLogger(__name__)


class Runner(Protocol):
    def init_state(self, tensors: dict[str, Any], meta: dict[str, Any]) -> Any: ...
    def step(self, batch: list[EngineJob]) -> None: ...
    def result(self, job: EngineJob) -> Any: ...


@runtime_checkable
class DeferredRunner(Runner, Protocol):
    """A runner whose steps are read one step late (``workers/engine/settle.py``)."""

    def settle(self) -> None:
        """Read the last launched step now."""

    def failures(self) -> list[tuple[EngineJob, Exception]]:
        """Jobs that reads since the last call found failed, with why."""

    def read_steps(self) -> list[tuple[list[EngineJob], float]]:
        """Steps read since the last call, with the seconds each took (start to read)."""

    def unread(self, job: EngineJob) -> bool:
        """Whether a step of the job was launched and not read yet."""


class EngineHooks:
    """Side effects of the loop (Redis in production, nothing in unit tests)."""

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Which of these jobs must leave the engine (cancelled/expired/failed elsewhere)."""
        return set()

    def on_admit(self, jobs: list[EngineJob]) -> None: ...

    def on_step(self, batch: list[EngineJob], step_seconds: float, waiting: list[EngineJob]) -> None: ...

    def on_idle(self, waiting: list[EngineJob]) -> None: ...


@dataclass
class StepRecord:
    """One executed step, for tests and metrics: which jobs shared it."""

    index: int
    job_ids: tuple[str, ...]
    seconds: float


@dataclass
class EngineStats:
    steps: int = 0
    busy_seconds: float = 0.0
    history: list[StepRecord] = field(default_factory=list)
    history_limit: int = 10_000

    def record(self, rec: StepRecord) -> None:
        self.steps += 1
        self.busy_seconds += rec.seconds
        self.history.append(rec)
        if len(self.history) > self.history_limit:
            del self.history[: len(self.history) - self.history_limit]


def job_geometry(runner: Any, state: Any, meta: dict[str, Any]) -> tuple[tuple[int, int] | None, int]:
    """(latent grid, batch rows) of a job: the runner's answer if it has one, else the state's 4-D
    latents (SD), else the prepared pixel size over the VAE factor; rows 2 with CFG."""
    rows = int(getattr(state, "rows", 2 if meta.get("do_cfg", True) else 1))
    if hasattr(runner, "latent_hw"):
        return runner.latent_hw(state), rows
    latents = getattr(state, "latents", None)
    if latents is not None and getattr(latents, "dim", lambda: 0)() == 4:
        return (int(latents.shape[-2]), int(latents.shape[-1])), rows
    if meta.get("height") and meta.get("width"):
        factor = int(getattr(runner, "vae_scale_factor", 8))
        return (int(meta["height"]) // factor, int(meta["width"]) // factor), rows
    return None, rows


class Engine:
    def __init__(self, runner: Runner, scheduler: BatchScheduler, hooks: EngineHooks | None = None,
                 *, idle_wait: float = 0.05, clock: Callable[[], float] = time.perf_counter) -> None:
        self.runner = runner
        self.scheduler = scheduler
        for name in ("ready", "runnable"):  # the runner decides what may run (e.g. adapters loaded)
            if getattr(scheduler, name, None) is None and hasattr(runner, name):
                setattr(scheduler, name, getattr(runner, name))
        self.hooks = hooks or EngineHooks()
        self.idle_wait = idle_wait
        self.clock = clock
        self.stats = EngineStats()
        self._inbox: queue.Queue[EngineJob] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deferred = isinstance(runner, DeferredRunner)
        if self._deferred:
            runner.read_steps()  # type: ignore[attr-defined]  # steps read before this engine are not its own
        self._held: list[EngineJob] = []  # finished jobs whose last step the runner has not read yet

    # -- called from other threads -------------------------------------------------------
    def submit(self, job_id: str, tensors: dict[str, Any], meta: dict[str, Any], *,
               total_steps: int, priority: int = 0, deadline: float | None = None,
               mask_ratio: float = 1.0, template_id: str = "", hard_deadline: bool = True) -> EngineJob:
        """Queue a job; its ``future`` resolves to the runner's result or raises. ``hard_deadline``
        False: ``deadline`` is the service's default SLO deadline (soft, see ``EngineJob``)."""
        job = EngineJob(job_id=job_id, total_steps=total_steps, priority=priority, deadline=deadline,
                        mask_ratio=mask_ratio, template_id=template_id, hard_deadline=hard_deadline)
        job.state = (tensors, meta)  # turned into runner state on the engine thread
        self._inbox.put(job)
        return job

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="stencil-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for job in self.scheduler.jobs() + self._held:
            if not job.future.done():
                job.future.set_exception(JobCancelled("engine stopped"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- engine thread ------------------------------------------------------------------
    def _drain_inbox(self, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._accept(job)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, job: EngineJob) -> None:
        tensors, meta = job.state
        try:
            job.state = self.runner.init_state(tensors, meta)
            if hasattr(self.runner, "masked_tokens"):
                job.masked_tokens = self.runner.masked_tokens(job.state)
            job.cached = getattr(job.state, "mode", "full") == "masked"
            job.latent_hw, job.rows = job_geometry(self.runner, job.state, meta)
        except Exception as exc:  # bad tensors fail this job only
            log.warning("job %s rejected by the runner: %s", job.job_id, exc)
            job.future.set_exception(exc)
            return
        self.scheduler.add(job)

    def _drop_cancelled(self) -> None:
        jobs = self.scheduler.jobs()
        if not jobs:
            return
        try:
            gone = self.hooks.cancelled([j.job_id for j in jobs])
        except Exception:
            log.exception("cancellation check failed; continuing")
            return
        for job_id in gone:
            job = self.scheduler.remove(job_id)
            if job is not None and not job.future.done():
                log.info("job %s left the engine (cancelled) after %d steps", job_id, job.steps_done)
                job.future.set_exception(JobCancelled(job_id))

    def _run_step(self, batch: list[EngineJob]) -> list[EngineJob]:
        """Run one step; on error, isolate the failing job(s) so the others go on."""
        try:
            self.runner.step(batch)
            return batch
        except Exception as exc:
            if len(batch) == 1:
                job = batch[0]
                log.warning("job %s failed in the engine: %s", job.job_id, exc)
                self.scheduler.remove(job.job_id)
                job.future.set_exception(exc)
                return []
            log.warning("batched step failed (%s); retrying job by job", exc)
        survivors = []
        for job in batch:
            survivors += self._run_step([job])
        return survivors

    def step_once(self) -> bool:
        """One loop iteration; returns False when there was nothing to run."""
        self._drop_cancelled()
        batch, admitted = self.scheduler.schedule()
        if admitted:
            self.hooks.on_admit(admitted)
        if not batch:
            self.settle()
            return False
        start = self.clock()
        ran = self._run_step(batch)
        seconds = self.clock() - start
        self.stats.record(StepRecord(self.stats.steps, tuple(j.job_id for j in ran), seconds))
        if not self._deferred:
            self.scheduler.observe_step(ran, seconds)
        finished = self.scheduler.complete_step(ran)
        self._fail_read()
        try:
            self.hooks.on_step(ran, seconds, list(self.scheduler.waiting))
        except Exception:
            log.exception("on_step hook failed; continuing")
        if self._deferred:  # hand over the finished jobs whose last step was read (by this one, or at once)
            held = self._held + finished
            self._held = [job for job in held if not job.future.done() and self.runner.unread(job)]  # type: ignore[attr-defined]
            self._hand_over([job for job in held if not any(job is h for h in self._held)])
        else:
            self._hand_over(finished)
        return True

    def settle(self) -> None:
        """Read every launched step and hand over the finished jobs (the engine is idle or stopping)."""
        if self._deferred:
            try:
                self.runner.settle()  # type: ignore[attr-defined]
            except Exception as exc:  # a failed read fails the jobs it would have handed over
                log.warning("reading the last step failed: %s", exc)
                for job in self._held:
                    if not job.future.done():
                        job.future.set_exception(exc)
            self._fail_read()
        held, self._held = self._held, []
        self._hand_over(held)

    def _fail_read(self) -> None:
        """Fail the jobs the runner's reads found failed (non-finite latents, one step late), and
        let the step-time predictor learn each read step's measured time (a step's launch alone
        says nothing of its time)."""
        if not self._deferred:
            return
        for jobs, seconds in self.runner.read_steps():  # type: ignore[attr-defined]
            self.scheduler.observe_step(jobs, seconds)
        for job, exc in self.runner.failures():  # type: ignore[attr-defined]
            self.scheduler.remove(job.job_id)
            if not job.future.done():
                log.warning("job %s failed in the engine: %s", job.job_id, exc)
                job.future.set_exception(exc)

    def _hand_over(self, finished: list[EngineJob]) -> None:
        for job in finished:
            if job.future.done():  # failed or cancelled meanwhile
                continue
            try:
                job.future.set_result(self.runner.result(job))
            except Exception as exc:
                log.warning("job %s failed in the engine: %s", job.job_id, exc)
                job.future.set_exception(exc)

    def _loop(self) -> None:
        log.info("engine started: max_batch=%d mode=%s", self.scheduler.max_batch, self.scheduler.mode)
        while not self._stop.is_set():
            self._drain_inbox(block=not self.scheduler.jobs())
            try:
                if not self.step_once():
                    self.hooks.on_idle(list(self.scheduler.waiting))
                    if self.scheduler.jobs():  # jobs wait for something (e.g. adapters): don't spin
                        time.sleep(self.idle_wait)
            except Exception:  # the loop must survive anything a job does
                log.exception("engine iteration failed")
                time.sleep(self.idle_wait)
        self.settle()
        log.info("engine stopped")
