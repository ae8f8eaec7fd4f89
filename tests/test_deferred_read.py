"""An engine step's one read is of the step before it (``workers/engine/settle.py``): the device runs
a step while the host builds the next. With the tiny SD model: each step reads the previous step's
flags, never its own; a job whose latents turn non-finite fails named with that step, one step later,
and leaves the other jobs' latents bit-equal; a warm-up whose last step is not finite commits no
cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_plan_engine import _job, _job_inputs, _runner_setup, _warm
from workers.maskaware import TemplateCacheKey

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 4


class ReadsOf(TorchDispatchMode):
    """The tensors whose ``all`` the host reads back (the finiteness read's reduction)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.all.default:
            self.read.append(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


def _key(ctrl) -> TemplateCacheKey:  # type: ignore[no-untyped-def]
    return TemplateCacheKey("t", "tpl", 128, 128, "ddim", STEPS, 1.0, "cfg2", ctrl.cache_layout)


def _late_setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The tiny SD runner reading as on a GPU (on the CPU it reads each step at once)."""
    setup = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    assert not setup[2].read_late
    setup[2].read_late = True
    return setup


def test_each_step_reads_the_flags_of_the_step_before(tmp_path: Path) -> None:
    unet, ctrl, runner, caches, store, cfg = _late_setup(tmp_path)
    try:
        key = _key(ctrl)
        _warm(runner, caches, key, STEPS)
        batch = [_job(runner, "masked", key, STEPS, seed=50 + i) for i in range(3)]
        launched = []
        for _ in range(STEPS):
            reads = ReadsOf()
            with reads:
                runner.step(batch)
            assert len(runner._launched) == 1
            launched.append((reads.read, runner._launched[0].flags.data_ptr()))
            for job in batch:
                job.steps_done += 1
        assert launched[0][0] == []  # the warm-up before it was read by its result
        for (read, _), (_, before) in zip(launched[1:], launched):
            assert read == [before]
        assert [runner.result(job)["masked_steps"] for job in batch] == [STEPS] * 3
        assert runner._launched == []  # a result reads the step it ended with
    finally:
        caches.close(wait=True)


def _run_masked(runner, key: TemplateCacheKey, poison: bool) -> tuple[list, list]:  # type: ignore[no-untyped-def]
    """Three masked jobs; the second leaves after step 2 (found non-finite then if ``poison``:
    its latents are NaN from step 1). Returns the jobs and the failures each step's read found."""
    batch = [_job(runner, "masked", key, STEPS, seed=60 + i) for i in range(3)]
    jobs, found = list(batch), []
    for step in range(STEPS):
        if poison and step == 1:
            batch[1].state.latents = torch.full_like(batch[1].state.latents, float("nan"))
        runner.step(batch)
        for job in batch:
            job.steps_done += 1
        found.append([(job.job_id, str(exc)) for job, exc in runner.failures()])
        if step == 2:
            batch = [batch[0], batch[2]]
    return jobs, found


def test_a_non_finite_job_fails_a_step_late_and_the_others_are_bit_equal(tmp_path: Path) -> None:
    unet, ctrl, runner, caches, store, cfg = _late_setup(tmp_path)
    try:
        key = _key(ctrl)
        _warm(runner, caches, key, STEPS)
        clean, none_found = _run_masked(runner, key, poison=False)
        poisoned, found = _run_masked(runner, key, poison=True)
        runner.settle()
        assert none_found == [[]] * STEPS and runner.failures() == []
        bad = poisoned[1].job_id
        assert found == [[], [], [(bad, f"job {bad}: non-finite latents at step 1")], []]
        with pytest.raises(FloatingPointError, match="at step 1"):
            runner.result(poisoned[1])
        for i in (0, 2):
            assert torch.equal(runner.result(poisoned[i])["latents"], runner.result(clean[i])["latents"])
    finally:
        caches.close(wait=True)


def test_a_warm_up_whose_last_step_is_not_finite_commits_no_cache(tmp_path: Path) -> None:
    unet, ctrl, runner, caches, store, cfg = _late_setup(tmp_path)
    try:
        rec = _job(runner, "record", _key(ctrl), STEPS)
        while not rec.finished:
            if rec.steps_done == STEPS - 1:
                rec.state.latents = torch.full_like(rec.state.latents, float("inf"))
            runner.step([rec])
            rec.steps_done += 1
        with pytest.raises(FloatingPointError, match=f"non-finite latents at step {STEPS - 1}"):
            runner.result(rec)
        assert rec.state.commit is None
        assert [job.job_id for job, _ in runner.failures()] == [rec.job_id]
    finally:
        caches.close(wait=True)


class ObservedStepTime:
    """A step-time predictor that records what the engine teaches it."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, ...], float]] = []

    def __call__(self, batch) -> float:  # type: ignore[no-untyped-def]
        return 0.01

    def observe(self, batch, seconds: float) -> None:  # type: ignore[no-untyped-def]
        self.seen.append((tuple(job.job_id for job in batch), seconds))


def test_the_engine_fails_a_job_read_non_finite_and_times_each_read_step(tmp_path: Path) -> None:
    """Through the engine: the job whose latents turn non-finite fails with that step named, the
    others finish equal to a run without it, and the step-time predictor learns every step once,
    with the jobs that ran it (the time of a step is known only at its read)."""
    from workers.engine.engine import Engine
    from workers.engine.scheduler import BatchScheduler

    unet, ctrl, runner, caches, store, cfg = _late_setup(tmp_path)
    try:
        key = _key(ctrl)
        _warm(runner, caches, key, STEPS)
        outcomes = []
        for poison in (False, True):
            step_time = ObservedStepTime()
            engine = Engine(runner, BatchScheduler(max_batch=4, step_time=step_time))
            jobs = [_job(runner, "masked", key, STEPS, seed=70 + i) for i in range(3)]
            if poison:
                jobs[1].state.latents = torch.full_like(jobs[1].state.latents, float("nan"))
            else:  # leaves the batch when the poisoned one does (found at step 1's read): the same
                jobs[1].total_steps = 2  # batches in both runs, so the same GEMM shapes and bits
            for job in jobs:
                engine.scheduler.add(job)
            while engine.step_once():
                pass
            outcomes.append(jobs)
            history = [sorted(rec.job_ids) for rec in engine.stats.history]
            assert [sorted(ids) for ids, _ in step_time.seen] == history
            assert all(seconds > 0 for _, seconds in step_time.seen)
        clean, poisoned = outcomes
        with pytest.raises(FloatingPointError, match=f"job {poisoned[1].job_id}: non-finite latents at step 0"):
            poisoned[1].future.result(timeout=0)
        for i in (0, 2):
            got, want = poisoned[i].future.result(timeout=0), clean[i].future.result(timeout=0)
            assert torch.equal(got["latents"], want["latents"])
    finally:
        caches.close(wait=True)


def test_a_step_that_must_read_at_once_reads_the_step_before_with_it(tmp_path: Path) -> None:
    """Temporal reuse picks a step's patches from the last step's errors, so its steps are read at
    once; a step before it not read yet is read in the same read (never two per step)."""
    from ops.bench.harness.dispatch import DispatchCounter
    from workers.maskaware.reuse import TemporalReuse
    from workers.maskaware.reuse_rule import ThresholdRule

    unet, ctrl, runner, caches, store, cfg = _late_setup(tmp_path)
    try:
        key = _key(ctrl)
        _warm(runner, caches, key, STEPS)
        plain = _job(runner, "masked", key, STEPS, seed=80)
        runner.step([plain])
        assert runner.unread(plain)
        runner.read_steps()
        runner.reuse_rule = ThresholdRule(10.0)
        turbo = [_job(runner, "masked", key, STEPS, seed=81 + i) for i in range(2)]
        for job in turbo:
            job.state.reuse = TemporalReuse(runner.reuse_rule, STEPS, frozenset(), 5.0, list(ctrl.units),
                                            max_tokens=runner._full_tokens(job.state))
        counter = DispatchCounter()
        with counter:
            runner.step(turbo)
        assert counter.syncs == {"aten._local_scalar_dense.default": 1}, counter.syncs
        assert not runner.unread(plain) and not any(runner.unread(job) for job in turbo)
        assert [sorted(job.job_id for job in jobs) for jobs, _ in runner.read_steps()] == \
            [[plain.job_id], sorted(job.job_id for job in turbo)]
    finally:
        runner.reuse_rule = None
        caches.close(wait=True)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_engine_thread_serves_jobs_read_late_as_it_does_read_at_once(tmp_path: Path, graphs: bool) -> None:
    """The engine's own thread, five masked jobs in batches of two (continuous batching), eager or
    with step graphs (the CPU's stand-in, whose outputs are reused by the next replay as a graph's):
    reading each step late hands over every job, with the same latents as reading each step at once."""
    from workers.engine.engine import Engine
    from workers.engine.scheduler import BatchScheduler
    from workers.engine.sd_runner import SDRunner

    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = _key(ctrl)
        _warm(runner, caches, key, STEPS)
        if graphs:
            runner = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, recorder=runner.recorder, prefetch_steps=0,
                              cache_plan="plan", graphs=True)
        latents = {}
        for late in (False, True):
            runner.read_late = late
            engine = Engine(runner, BatchScheduler(max_batch=2), idle_wait=0.01)
            handles = [engine.submit(f"j{i}", *_job_inputs("masked", key, STEPS, seed=90 + i), total_steps=STEPS)
                       for i in range(5)]
            engine.start()  # every job is in its inbox: the same batches both times
            try:
                latents[late] = [h.future.result(timeout=120)["latents"] for h in handles]
            finally:
                engine.stop()
            assert not runner._launched
        assert all(torch.equal(a, b) for a, b in zip(latents[False], latents[True]))
        if graphs:
            assert runner.graphs is not None and runner.graphs.replays > 0
    finally:
        caches.close(wait=True)
