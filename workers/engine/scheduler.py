"""Batch scheduler: decides which jobs run in the next denoising step. Pure bookkeeping.

This is the "scheduler" half of the engine (the runner executes). Continuous batching admits
waiting jobs into free slots at every step, so jobs join and leave the running batch step by
step, whatever their image sizes (the runners batch mixed sizes exactly); static batching (a
baseline) admits only when the running batch has drained; bucketed batching (a baseline) keeps
one image size per batch: when the batch drains, the next bucket is the size of the first
waiting job in admission order, and every waiting job of that size may join; while it runs,
jobs of its size join free slots only while no job of another size is ahead of them.

SLO-aware admission (PatchedServe-style), active only when a step-time predictor is injected
(``step_time(jobs) -> seconds`` of one step of that batch; ``None`` keeps the plain behaviour):
- a waiting job that cannot meet its deadline even if it ran alone from now is expired: it leaves
  the queue, its future fails with ``JobExpired(reason)`` and ``on_expire(job, reason)`` tells the
  engine's host (which marks the record ``expired``). Running jobs are never expired here: their
  work is half done and the runner may still beat the prediction. That holds for hard (user)
  deadlines; a job whose soft deadline (the service's default, ``STENCIL_SLO_FACTOR``) is out of
  reach is not expired but goes behind every job that can still make its own: it runs late
  rather than making others late too. A running job in that state gives its slot back (keeping
  its progress) while an on-time job waits, and rejoins when there is room; with
  ``slo_yield="batch"`` so does one whose deadline the running batch's predicted finish misses.
  Predicted finish times are stretched by ``slo_margin`` (a share) before any comparison.
- waiting jobs are ordered by priority, then (``slo_order="slack"``) slack (deadline - now -
  predicted time alone), then arrival: the most urgent job gets the next free slot. With size
  affinity on and more jobs waiting than slots free, jobs with room to wait go behind jobs of the
  sizes already in the batch. ``slo_order="arrival"`` keeps plain admission's order instead (user
  deadlines, then arrival; under a queue, size affinity's ranks): the checks below still decide who
  may take a slot; ``slo_order="deadline"`` is the same with earliest deadline first in place of
  arrival. Under overload least-slack-first serves the jobs nearest to missing, and in a full GPU
  batch (a step 3.7x a job's step alone) a job's slack against its time alone overstates its room;
  there arrival order kept more deadlines, and deadline order more still (GPU-shaped simulator,
  ops/bench/mixed_sizes).
- each waiting job's verdict is left on it (``job.late``: its soft deadline is out of reach, so it runs
  behind every on-time job); the engine publishes it and routers do not count it ahead of a new job.
- a job predicted to miss its own deadline in the current batch goes after jobs predicted to make
  theirs (it still takes a slot nobody else can use); a late job takes no slot in a step where an
  on-time job was refused (the capacity is kept for on-time jobs: measured, ops/bench/mixed_sizes).
- a waiting job is admitted only if no running (or just admitted) job that would meet its
  deadline without it misses it with it; finish times integrate the predicted step time over the
  batch's remaining steps (jobs leave as they finish). A refused job stays waiting; smaller jobs
  behind it may still fit. One exception (``_misses_allowed``): one such deadline for a newcomer
  that makes its own, where filling the slot is nearly free (sublinear batch cost).

Size affinity (continuous mode, plain admission): when more jobs wait than slots are free, a free
slot goes to the earliest waiting job of the size most represented in the batch, before older
jobs of other sizes (minority sizes drain out: the batch converges to one size under load).
Every size in a step costs one denoiser call of its own (a fixed cost per call), so under
overload FCFS mixing of sizes buys nothing and costs calls; with spare slots everybody is admitted
anyway. A job passed over for ``size_affinity_steps`` steps goes first regardless (no starvation),
and its size becomes the batch's target: later free slots go to that size first while jobs of it
wait, so the batch switches size as a group (as a bucket would) instead of carrying the passed-over
job alone beside the others: its size's call is one more call every step for one job (on a GPU
a call at the small-batch floor; on this CPU 0-7 ms per step, ``ops/bench/mixing_cost.py``).
0 = strict FCFS.

How the batch changes size under a queue (``size_switch``): ``mix`` admits the new size's jobs into
free slots beside the old size's (two calls a step until the old jobs finish: the right trade where
an empty slot costs throughput, a GPU's sublinear batch); ``drain`` stops topping the batch up and
opens the new size once the batch's jobs have finished, as a bucket does (one call a step
throughout: the right trade where a batch costs the sum of its jobs, this CPU, where an empty slot
costs nothing and a second call costs its fixed share; ops/bench/mixed_sizes). The batch changes size
when a passed-over job's bound is up or no job of its sizes waits; jobs with a user deadline still
go first, mixing. Without a queue both admit everybody.

Readiness (the runner's, injected): a waiting job is admitted only when ``ready(job)`` (e.g. its
LoRA adapters are resident: loading never stalls a step; jobs behind it may go first), and a
running job takes a step only when ``runnable(job)``. A ``ready`` that raises fails that job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from app.costmodel import finish_times
from workers.engine.job import EngineJob, JobExpired

log = logging.getLogger(__name__)

MODES = ("continuous", "static", "bucketed")
# The engine's choices below are not settings: the service takes each device kind's ``auto``
# (``device_defaults``; docs/configuration.md tabulates them), and the mixed-sizes benchmark, which
# measured them, takes every value as an option (ops/bench/mixed_sizes.py).
# How a batch changes image size under a queue: mix (the new size joins free slots beside the old:
# two denoiser calls a step until the old jobs finish) | drain (no newcomers until the batch drained).
SIZE_SWITCHES = ("auto", "mix", "drain")
# The order SLO-aware admission offers a crowded queue's free slots in, among jobs that can still make
# their deadline: slack (least first) | arrival (size affinity, then FCFS) | deadline (size affinity,
# then earliest deadline first).
SLO_ORDERS = ("auto", "slack", "arrival", "deadline")
# When a running soft-deadline job gives its slot back to a waiting on-time job: alone (once its
# deadline is out of reach even alone) | batch (once the running batch's predicted finish misses it).
SLO_YIELDS = ("auto", "alone", "batch")
# Under a queue, a free slot goes first to the earliest waiting job of a size already in the batch; a
# job passed over this many steps goes first regardless (0 = strict FCFS; BENCHMARKS.md, mixed sizes).
SIZE_AFFINITY_STEPS = 50


def parse_slo_margin(value: object) -> float | None:
    """An SLO margin option: None for auto (``slo_margin_for``), else the share (>= 0)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        margin = float(text)
    except ValueError:
        margin = -1.0
    if not margin >= 0.0:  # also rejects nan
        raise ValueError(f"SLO margin must be auto or a number >= 0, got {value!r}")
    return margin


def _deadline_or_inf(job: EngineJob) -> float:
    return job.deadline if job.deadline is not None else float("inf")


def _is_cuda(device: str) -> bool:
    return str(device).split(":")[0] == "cuda"


def _resolve_for_device(mode: str, device: str, known: Sequence[str], on_cuda: str, elsewhere: str,
                        what: str) -> str:
    """A setting whose ``auto`` depends on the device kind: ``on_cuda`` there, ``elsewhere`` otherwise."""
    if mode == "auto":
        return on_cuda if _is_cuda(device) else elsewhere
    if mode not in known:
        raise ValueError(f"{what} must be one of {tuple(known)}, got {mode!r}")
    return mode


def size_switch_for(mode: str, device: str) -> str:
    """The size switch: ``auto`` drains on devices where a batch costs the sum of its jobs
    (CPU: a second call a step is dearer than an empty slot) and mixes on CUDA (sublinear batches: an
    empty slot is the dearer)."""
    return _resolve_for_device(mode, device, SIZE_SWITCHES, "mix", "drain", "size switch")


def slo_order_for(mode: str, device: str) -> str:
    """The SLO order: ``auto`` orders SLO admission by deadline on CUDA (sublinear batches: a
    full batch's step is several times a job's alone, so slack against the time alone misleads; in
    the GPU-shaped simulator deadline order kept more deadlines than arrival order, and both more
    than slack) and by slack elsewhere (in the CPU-fitted simulator slack kept 0.5-1.2 points more
    than arrival; BENCHMARKS.md)."""
    return _resolve_for_device(mode, device, SLO_ORDERS, "deadline", "slack", "SLO order")


def slo_yield_for(mode: str, device: str) -> str:
    """The SLO yield: ``auto`` gives a soft-deadline job's slot back once the running batch's
    prediction misses its deadline on CUDA (under overload a slot then serves a job that can still
    make it: GPU-shaped simulator, 10 seeds at 1.3x capacity, 92.2% -> 93.1% of deadlines kept), and
    only once it cannot make it even alone elsewhere."""
    return _resolve_for_device(mode, device, SLO_YIELDS, "batch", "alone", "SLO yield")


# SLO margin ``auto``: predicted finish times stretched by 1% on CUDA (GPU-shaped simulator,
# 10 seeds at 1.3x capacity: 0 / 0.01 / 0.02 / 0.03 kept 91.6 / 92.2 / 92.0 / 91.6% of deadlines).
SLO_MARGIN_CUDA = 0.01


def slo_margin_for(value: str, device: str) -> float:
    """The SLO margin: a number >= 0, or ``auto`` (``SLO_MARGIN_CUDA`` on CUDA, 0 elsewhere:
    on the real CPU run a 1% margin's effect was within the run's noise; BENCHMARKS.md)."""
    margin = parse_slo_margin(value)
    if margin is None:
        return SLO_MARGIN_CUDA if _is_cuda(device) else 0.0
    return margin


def device_defaults(device: str) -> dict[str, Any]:
    """``BatchScheduler``'s size switch, SLO order, yield and margin as ``auto`` resolves them on ``device``."""
    return {"size_switch": size_switch_for("auto", device), "slo_order": slo_order_for("auto", device),
            "slo_yield": slo_yield_for("auto", device), "slo_margin": slo_margin_for("auto", device)}


StepTimePredictor = Callable[[Sequence[EngineJob]], float]
# SLO admission's two tuning constants, chosen in the cluster simulator (ops/bench/mixed_sizes, BENCHMARKS.md):
# a waiting job with slack of at least this many times its standalone time may wait behind jobs of
# the sizes already in the batch (size affinity; 0.25 / 0.5 / 1 / 2 tried) ...
SLO_AFFINITY_SLACK = 0.25
# ... and an admission may cost one running job's deadline only if the step grows by less than this
# share of the newcomer's own step alone (0.3 / 0.5 / always / never tried).
SLO_TRADE_MARGINAL = 0.3
ExpireCallback = Callable[[EngineJob, str], None]
JobPredicate = Callable[[EngineJob], bool]


class BatchScheduler:
    def __init__(self, max_batch: int, mode: str = "continuous", *, step_time: StepTimePredictor | None = None,
                 on_expire: ExpireCallback | None = None, clock: Callable[[], float] = time.time,
                 ready: JobPredicate | None = None, runnable: JobPredicate | None = None,
                 size_affinity_steps: int = 0, size_switch: str = "mix", slo_order: str = "slack",
                 slo_yield: str = "alone", slo_margin: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if mode not in MODES:
            raise ValueError(f"batching mode must be one of {MODES}, got {mode!r}")
        self.max_batch = max_batch
        self.mode = mode
        self.step_time = step_time
        self.on_expire = on_expire
        self.clock = clock  # wall clock: deadlines are absolute epoch seconds
        self.ready = ready
        self.runnable = runnable
        if size_affinity_steps < 0:
            raise ValueError("size_affinity_steps must be >= 0")
        self.size_affinity_steps = size_affinity_steps
        if size_switch not in SIZE_SWITCHES or size_switch == "auto":  # resolved by ``size_switch_for``
            raise ValueError(f"size switch must be mix or drain, got {size_switch!r}")
        self.size_switch = size_switch
        if slo_order not in SLO_ORDERS or slo_order == "auto":  # resolved by ``slo_order_for``
            raise ValueError(f"SLO order must be slack, arrival or deadline, got {slo_order!r}")
        self.slo_order = slo_order
        if slo_yield not in SLO_YIELDS or slo_yield == "auto":  # resolved by ``slo_yield_for``
            raise ValueError(f"SLO yield must be alone or batch, got {slo_yield!r}")
        self.slo_yield = slo_yield
        if not slo_margin >= 0.0:
            raise ValueError(f"SLO margin must be >= 0, got {slo_margin!r}")
        self.slo_margin = slo_margin  # predicted finish times are stretched by this share
        # SLO admission: candidates per predictor call (``AdmissionTrials``); None = twice the batch, at
        # least 8 (ops/bench/scheduler_cost.py sets the queue's length to compare with trying all at once)
        self.admission_chunk: int | None = None
        self._passed_over: dict[str, int] = {}  # job id -> steps a later job of another size went first
        self._target_hw: tuple[int, int] | None = None  # size affinity: the size a passed-over job opened
        self.waiting: list[EngineJob] = []
        self.running: list[EngineJob] = []
        self.expired: list[EngineJob] = []  # since the last ``pop_expired`` (last 1000 at most)
        self.refused = 0  # admissions refused to protect running jobs' deadlines
        self.yielded = 0  # late (soft-deadline) running jobs that gave their slot to on-time ones

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

    def pop_expired(self) -> list[EngineJob]:
        out, self.expired = self.expired, []
        return out

    def _is_ready(self, job: EngineJob) -> bool:
        if self.ready is None:
            return True
        try:
            return self.ready(job)
        except Exception as exc:  # this job can never run: fail it, keep the others
            log.warning("job %s cannot be admitted: %s", job.job_id, exc)
            self.waiting.remove(job)
            if not job.future.done():
                job.future.set_exception(exc)
            return False

    def _batch(self) -> list[EngineJob]:
        if self.runnable is None:
            return list(self.running)
        return [j for j in self.running if self.runnable(j)]

    def schedule(self) -> tuple[list[EngineJob], list[EngineJob]]:
        """Admit waiting jobs per the batching mode; returns (batch for this step, newly admitted)."""
        if self.step_time is not None:
            return self._schedule_slo(self.step_time)
        admitted: list[EngineJob] = []
        if self.mode == "continuous" and self.size_affinity_steps > 0:
            self.waiting.sort(key=EngineJob.sort_key)
            admitted = self._admit_by_size()
        elif self.mode != "static" or not self.running:
            self.waiting.sort(key=EngineJob.sort_key)
            bucket = self.running[0].latent_hw if self.running else None
            opening = not self.running  # a bucket being chosen takes every waiting job of its size
            for job in list(self.waiting):
                if len(self.running) >= self.max_batch:
                    break
                if self.mode == "bucketed" and bucket is not None and job.latent_hw != bucket:
                    if opening:
                        continue
                    break  # an older job of another size waits: this bucket takes no newcomers
                if not self._is_ready(job):
                    continue
                self.waiting.remove(job)
                self.running.append(job)
                admitted.append(job)
                bucket = job.latent_hw
        return self._batch(), admitted

    def _starved(self, job: EngineJob) -> bool:
        """Passed over ``size_affinity_steps`` times: size affinity may not pass it over again."""
        return self._passed_over.get(job.job_id, 0) >= self.size_affinity_steps

    def _affinity_rank(self, job: EngineJob, counts: dict) -> tuple[int, int]:
        """Admission rank under size affinity (lower first, FCFS within a rank): jobs passed over
        long enough and jobs with a user deadline (which plain admission orders by) keep their
        place; then jobs of the target size (the size a passed-over job opened); then jobs of the
        size most represented in the batch (minority sizes drain out, so the batch converges to
        fewer denoiser calls); then the rest."""
        if self._starved(job) or job.user_deadline:
            return (0, 0)
        if job.latent_hw == self._target_hw:
            return (1, -self.max_batch - 1)
        if job.latent_hw in counts:
            return (1, -counts[job.latent_hw])
        return (2, 0)

    def _admit_by_size(self) -> list[EngineJob]:
        """Continuous admission with size affinity (module docstring); ``waiting`` is in FCFS order."""
        order = {id(j): k for k, j in enumerate(self.waiting)}
        counts: dict = {}
        for job in self.running:
            counts[job.latent_hw] = counts.get(job.latent_hw, 0) + 1
        if not any(j.latent_hw == self._target_hw for j in self.waiting):
            self._target_hw = None  # the target size's queue drained: back to the batch's majority
        admitted: list[EngineJob] = []
        while len(self.running) < self.max_batch and self.waiting:
            prefs = list(self.waiting)
            crowded = len(prefs) > self.max_batch - len(self.running)
            drain = crowded and self.size_switch == "drain"
            if drain:
                self._drain_target(counts)
            if crowded and (counts or (drain and self._target_hw is not None)):  # sizes in the batch first
                prefs.sort(key=lambda j: (-j.priority, self._affinity_rank(j, counts)))
            if drain and counts:  # the batch's own sizes top it up, none while it drains for the target
                prefs = [j for j in prefs if (self._target_hw is None and j.latent_hw in counts)
                         or j.user_deadline]
            pick = next((j for j in prefs if self._is_ready(j)), None)
            if pick is None:
                break
            if counts and self._starved(pick) and pick.latent_hw != max(counts, key=counts.__getitem__):
                self._target_hw = pick.latent_hw  # its size-mates follow it: the batch switches as a group
            self.waiting.remove(pick)
            self.running.append(pick)
            admitted.append(pick)
            counts[pick.latent_hw] = counts.get(pick.latent_hw, 0) + 1
        if admitted:
            last = max(order[id(j)] for j in admitted)
            for job in self.waiting:
                if order.get(id(job), last) < last:
                    self._passed_over[job.job_id] = self._passed_over.get(job.job_id, 0) + 1
        waiting = {j.job_id for j in self.waiting}
        self._passed_over = {k: v for k, v in self._passed_over.items() if k in waiting}
        return admitted

    def _drain_target(self, counts: dict) -> None:
        """``size_switch="drain"`` under a queue: the size the batch changes to once its jobs have
        finished (nobody joins meanwhile, except jobs with a user deadline), set when a passed-over
        job's bound is up or none of the batch's sizes waits; cleared once the batch runs it. An
        empty batch opens with the target's jobs first, else the first ready job in order."""
        if counts and set(counts) == {self._target_hw}:
            self._target_hw = None  # the switch is done: the target is the batch's size now
        if self._target_hw is None:
            starved = next((j for j in self.waiting if self._starved(j) and j.latent_hw not in counts), None)
            if starved is not None:
                self._target_hw = starved.latent_hw
            elif counts and not any(j.latent_hw in counts for j in self.waiting):
                self._target_hw = self.waiting[0].latent_hw  # the oldest waiting job's size, as a bucket

    # -- SLO-aware admission ---------------------------------------------------------------------
    def alone_seconds(self, job: EngineJob) -> float:
        assert self.step_time is not None
        return job.remaining * self.step_time([job])

    def _expire(self, job: EngineJob, reason: str) -> None:
        job.expired_reason = reason
        self.expired.append(job)
        if len(self.expired) > 1000:  # an engine that never pops must not grow without bound
            del self.expired[:-1000]
        if not job.future.done():
            job.future.set_exception(JobExpired(reason))
        if self.on_expire is not None:
            self.on_expire(job, reason)

    def _misses(self, batch: Sequence[EngineJob], now: float, predict: StepTimePredictor) -> set[int]:
        """Indices of ``batch`` jobs with a deadline that the predicted finish would miss."""
        return self._misses_many(list(batch), [[]], now, predict)[0]

    def _misses_many(self, running: list[EngineJob], extras: list[list[EngineJob]], now: float,
                     predict: StepTimePredictor) -> list[set[int]]:
        """``_misses(running + extra)`` for each extra; one vectorized call when the predictor can
        predict many batches at once (``predict.predict_sets``), the general walk otherwise."""
        many = getattr(predict, "predict_sets", None)
        stretch = 1.0 + self.slo_margin
        if many is None:
            out = []
            for extra in extras:
                batch = running + extra
                ft = finish_times([j.remaining for j in batch], lambda idx, b=batch: predict([b[i] for i in idx]))
                out.append({i for i, j in enumerate(batch)
                            if j.deadline is not None and now + ft[i] * stretch > j.deadline})
            return out
        pool = running + [j for extra in extras for j in extra]
        n_run = len(running)
        rows: list[np.ndarray] = []
        walks = []
        offset = n_run
        for extra in extras:
            members = list(range(n_run)) + list(range(offset, offset + len(extra)))
            offset += len(extra)
            remaining = [pool[i].remaining for i in members]
            order = sorted(range(len(members)), key=lambda k: remaining[k])
            segments = []  # (row of the active set, steps it runs, members finishing after it)
            done, pos = 0, 0
            active = list(order)
            while pos < len(order):
                k = remaining[order[pos]] - done
                finishing = []
                while pos < len(order) and remaining[order[pos]] <= done + max(k, 0):
                    finishing.append(order[pos])
                    pos += 1
                if k > 0:
                    row = np.zeros(len(pool), dtype=bool)
                    row[[members[a] for a in active]] = True
                    rows.append(row)
                    segments.append((len(rows) - 1, k, finishing))
                    done += k
                else:
                    segments.append((-1, 0, finishing))
                active = [a for a in active if a not in finishing]
            walks.append((members, segments))
        seconds = many(pool, np.stack(rows)) if rows else np.zeros(0)
        out = []
        for members, segments in walks:
            t, missed = 0.0, set()
            for row, k, finishing in segments:
                if row >= 0:
                    t += k * float(seconds[row])
                for a in finishing:
                    job = pool[members[a]]
                    if job.deadline is not None and now + t * stretch > job.deadline:
                        missed.add(a)
            out.append(missed)
        return out

    def _yield_late(self, now: float, alone: dict[int, float], late: set[int]) -> None:
        """Running jobs whose soft deadline is out of reach even alone give their slot back while a
        job that can still make its own waits: they keep their progress, wait behind the on-time
        jobs and rejoin when there is room (a job's state is its own, so it may skip steps)."""
        for job in list(self.running):
            if job.hard_deadline or job.deadline is None or job.remaining == 0:
                continue
            need = self.alone_seconds(job)
            if now + need > job.deadline:
                self._give_back(job, need, alone, late)

    def _give_back(self, job: EngineJob, need: float, alone: dict[int, float], late: set[int]) -> None:
        """A running job returns to the queue as a late one, keeping its progress."""
        self.running.remove(job)
        self.waiting.append(job)
        alone[id(job)] = need
        late.add(id(job))
        self.yielded += 1

    def _yield_missing(self, now: float, alone: dict[int, float], late: set[int],
                       predict: StepTimePredictor) -> set[int] | None:
        """``slo_yield="batch"``: running jobs whose soft deadline the running batch's predicted finish
        misses give their slot back too, as late jobs. Under overload such a job (most often the one an
        admission's trade cost its deadline) would hold a slot to the end and miss anyway; the slot
        serves a job that can still make it. Returns the running batch's misses when nobody left (the
        admission below reuses them), None otherwise."""
        missing = self._misses(self.running, now, predict)
        leaving = [j for i, j in enumerate(self.running)
                   if i in missing and not j.hard_deadline and j.deadline is not None and j.remaining > 0]
        for job in leaving:
            self._give_back(job, self.alone_seconds(job), alone, late)
        return None if leaving else missing

    def _slo_affinity_order(self, candidates: list[EngineJob], now: float, alone: dict[int, float],
                            late: set[int]) -> list[EngineJob]:
        """Size affinity inside SLO admission, when more jobs wait than slots are free. Slack order:
        jobs that can afford to wait (slack of at least ``SLO_AFFINITY_SLACK`` x their time alone) go
        behind those of the sizes already in the batch, so a crowded batch converges to fewer denoiser
        calls and its steps get cheaper for everyone; urgent jobs, jobs passed over
        ``size_affinity_steps`` times and late jobs keep their slack order (a stable sort keeps it
        within each rank). Arrival or deadline order: plain admission's ranks (``_affinity_rank``), late jobs last."""
        counts: dict = {}  # size -> running jobs of it
        for running in self.running:
            counts[running.latent_hw] = counts.get(running.latent_hw, 0) + 1

        def rank(job: EngineJob) -> tuple[int, int]:
            if id(job) in late:
                return (3, 0)
            if self.slo_order != "slack":  # arrival or deadline: plain admission's ranks
                return self._affinity_rank(job, counts)
            relaxed = job.slack(now, alone[id(job)]) >= SLO_AFFINITY_SLACK * alone[id(job)]
            if (not relaxed or job.latent_hw in counts
                    or self._passed_over.get(job.job_id, 0) >= self.size_affinity_steps):
                return (0, 0)
            return (1, 0)

        ordered = sorted(candidates, key=lambda j: (-j.priority, rank(j)))
        order = {id(j): k for k, j in enumerate(candidates)}
        free = self.max_batch - len(self.running)
        for job in ordered[free:]:  # passed over: the base order would have given it a slot
            if order[id(job)] < free:
                self._passed_over[job.job_id] = self._passed_over.get(job.job_id, 0) + 1
        waiting = {j.job_id for j in self.waiting}
        self._passed_over = {k: v for k, v in self._passed_over.items() if k in waiting}
        return ordered

    def _misses_allowed(self, job: EngineJob, meets: bool, newly_missed: int, predict: StepTimePredictor,
                        running_step: float, alone_step: float) -> int:
        """How many running jobs' deadlines admitting ``job`` may cost: none, except one for a job that
        makes its own where filling the slot is nearly free (the step grows by less than
        ``SLO_TRADE_MARGINAL`` of the job's own step alone, ``alone_step``: sublinear GPU batches).
        There a slot left empty to save one deadline costs more throughput, hence deadlines, than the
        trade; on a device where a batch costs the sum of its jobs it never is (measured:
        ops/bench/mixed_sizes). ``running_step``: the predicted step of the running batch."""
        if not meets or newly_missed != 1 or not self.running:
            return 0
        marginal = predict(self.running + [job]) - running_step
        return 1 if marginal < SLO_TRADE_MARGINAL * alone_step else 0

    def _schedule_slo(self, predict: StepTimePredictor) -> tuple[list[EngineJob], list[EngineJob]]:
        now = self.clock()
        alone = {id(j): self.alone_seconds(j) for j in self.waiting}
        late: set[int] = set()  # soft deadlines out of reach: they go last, they are not expired
        for job in [j for j in self.waiting if j.deadline is not None and now + alone[id(j)] > j.deadline]:
            if not job.hard_deadline:
                late.add(id(job))
                continue
            self.waiting.remove(job)
            self._expire(job, f"deadline unreachable: needs {alone[id(job)]:.3f} s alone for "
                              f"{job.remaining} steps, {job.deadline - now:.3f} s left")  # type: ignore[operator]
        running_misses: set[int] | None = None  # the running batch's, once predicted
        if self.mode == "continuous" and any(id(j) not in late for j in self.waiting):
            self._yield_late(now, alone, late)
            if self.slo_yield == "batch" and self.running:
                running_misses = self._yield_missing(now, alone, late, predict)
        admitted: list[EngineJob] = []
        if self.waiting and len(self.running) < self.max_batch and (self.mode != "static" or not self.running):
            if self.slo_order == "arrival":
                self.waiting.sort(key=lambda j: (-j.priority, id(j) in late, *j.sort_key()[1:]))
            elif self.slo_order == "deadline":
                self.waiting.sort(key=lambda j: (-j.priority, id(j) in late, _deadline_or_inf(j), j.arrival))
            else:
                self.waiting.sort(key=lambda j: (-j.priority, id(j) in late,
                                                 0.0 if id(j) in late else j.slack(now, alone[id(j)]), j.arrival))
            bucket = self.running[0].latent_hw if self.mode == "bucketed" and self.running else None
            candidates = [j for j in self.waiting if bucket is None or j.latent_hw == bucket]
            if (self.mode == "continuous" and self.size_affinity_steps > 0 and self.running
                    and len(candidates) > self.max_batch - len(self.running)):
                candidates = self._slo_affinity_order(candidates, now, alone, late)
            if running_misses is None:
                running_misses = self._misses(self.running, now, predict) if self.running else set()
            misses = running_misses
            while candidates and len(self.running) < self.max_batch:
                trials = AdmissionTrials(self, candidates, now, predict)
                n_run = len(self.running)
                running_step = predict(self.running) if self.running else 0.0
                refusals: dict[int, bool] = {}  # candidate index -> refused to protect running deadlines
                chosen = None
                on_time_refused = False  # then late jobs take no slot this step: it is kept for on-time ones
                for on_time_only in (True, False):  # first pass: jobs predicted to make their own deadline
                    for k, job in enumerate(candidates):
                        if not self._is_ready(job) or (on_time_refused and id(job) in late):
                            continue
                        after = trials[k]
                        meets = n_run not in after
                        if k not in refusals:
                            newly_missed = len({i for i in after if i < n_run} - misses)
                            refusals[k] = newly_missed > self._misses_allowed(
                                job, meets, newly_missed, predict, running_step,
                                alone[id(job)] / max(job.remaining, 1))
                        if refusals[k]:
                            if on_time_only:
                                self.refused += 1
                            on_time_refused = on_time_refused or id(job) not in late
                            continue
                        if on_time_only and not meets and id(job) not in late:
                            continue
                        chosen = k
                        break
                    if chosen is not None:
                        break
                if chosen is None:
                    break
                job = candidates[chosen]
                self.waiting.remove(job)
                self.running.append(job)
                admitted.append(job)
                misses = {i if i < n_run else len(self.running) - 1 for i in trials[chosen]}
                candidates = [j for j in candidates[chosen + 1:] if j in self.waiting and
                              (self.mode != "bucketed" or j.latent_hw == job.latent_hw)]
        for job in self.waiting:
            job.late = id(job) in late
        for job in admitted:
            job.late = False
        return self._batch(), admitted

    def observe_step(self, batch: list[EngineJob], seconds: float) -> None:
        """A measured step of ``batch``: feeds SLO admission's predictor when it learns online
        (``app/calibration.py``); nothing otherwise."""
        observe = getattr(self.step_time, "observe", None)
        if observe is not None and batch:
            observe(batch, seconds)

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


class AdmissionTrials:
    """``_misses_many(running, [[c] for c in candidates])``, computed a chunk of candidates at a time
    as admission walks them (in its order). Admission stops at the first candidate it can take, and
    skips late jobs once an on-time one was refused, so under a long queue most candidates are never
    tried (measured: ``ops/bench/scheduler_cost.py``). Chunk: ``sched.admission_chunk``."""

    def __init__(self, sched: BatchScheduler, candidates: list[EngineJob], now: float,
                 predict: StepTimePredictor) -> None:
        self.sched, self.candidates, self.now, self.predict = sched, candidates, now, predict
        self.chunk = sched.admission_chunk or max(8, 2 * sched.max_batch)
        self.done: list[set[int]] = []

    def __getitem__(self, k: int) -> set[int]:
        while len(self.done) <= k:
            start = len(self.done)
            extras = [[j] for j in self.candidates[start:start + self.chunk]]
            self.done.extend(self.sched._misses_many(self.sched.running, extras, self.now, self.predict))
        return self.done[k]
