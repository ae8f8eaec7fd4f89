"""Engine scheduler and loop, with a fake runner (unit tests: no model, no Redis)."""

from __future__ import annotations

import pytest

from workers.engine.engine import Engine, EngineHooks
from workers.engine.job import EngineJob, JobCancelled
from workers.engine.scheduler import BatchScheduler


class CountingRunner:
    """State = a number; each step adds 1. Fails for job ids listed in ``poison``."""

    def __init__(self, poison: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.poison = set(poison)
        self.batches: list[list[str]] = []

    def init_state(self, tensors, meta):  # type: ignore[no-untyped-def]
        if meta.get("reject"):
            raise ValueError("bad tensors")
        return {"value": 0}

    def step(self, batch: list[EngineJob]) -> None:
        self.batches.append([j.job_id for j in batch])
        if any(j.job_id in self.poison for j in batch):
            raise RuntimeError("poisoned")
        for job in batch:
            job.state["value"] += 1

    def result(self, job: EngineJob) -> int:
        return job.state["value"]


class CancelHooks(EngineHooks):
    def __init__(self) -> None:
        self.cancel: set[str] = set()
        self.admitted: list[str] = []

    def cancelled(self, job_ids: list[str]) -> set[str]:
        return self.cancel & set(job_ids)

    def on_admit(self, jobs: list[EngineJob]) -> None:
        self.admitted += [j.job_id for j in jobs]


def run_until_idle(engine: Engine, limit: int = 1000) -> None:
    engine._drain_inbox(block=False)
    for _ in range(limit):
        engine._drain_inbox(block=False)
        if not engine.step_once():
            return
    raise AssertionError("engine did not become idle")


def test_continuous_batching_admits_jobs_at_every_step() -> None:
    runner = CountingRunner()
    engine = Engine(runner, BatchScheduler(max_batch=3, mode="continuous"))
    a = engine.submit("a", {}, {}, total_steps=4)
    engine._drain_inbox(block=False)
    engine.step_once()
    engine.step_once()
    b = engine.submit("b", {}, {}, total_steps=2)
    run_until_idle(engine)
    assert runner.batches[:4] == [["a"], ["a"], ["a", "b"], ["a", "b"]]
    assert a.future.result() == 4 and b.future.result() == 2


def test_static_batching_waits_for_the_batch_to_drain() -> None:
    runner = CountingRunner()
    engine = Engine(runner, BatchScheduler(max_batch=3, mode="static"))
    engine.submit("a", {}, {}, total_steps=3)
    engine._drain_inbox(block=False)
    engine.step_once()
    engine.submit("b", {}, {}, total_steps=1)
    run_until_idle(engine)
    assert runner.batches == [["a"], ["a"], ["a"], ["b"]]


def test_max_batch_and_priority_order() -> None:
    runner = CountingRunner()
    engine = Engine(runner, BatchScheduler(max_batch=2))
    engine.submit("low", {}, {}, total_steps=1, priority=0)
    engine.submit("high", {}, {}, total_steps=1, priority=5)
    engine.submit("urgent", {}, {}, total_steps=1, priority=0, deadline=1.0)
    run_until_idle(engine)
    assert runner.batches[0] == ["high", "urgent"]
    assert runner.batches[1] == ["low"]


def test_failing_job_is_isolated_and_others_continue() -> None:
    runner = CountingRunner(poison={"bad"})
    engine = Engine(runner, BatchScheduler(max_batch=4))
    good = engine.submit("good", {}, {}, total_steps=3)
    bad = engine.submit("bad", {}, {}, total_steps=3)
    rejected = engine.submit("rejected", {}, {"reject": True}, total_steps=3)
    run_until_idle(engine)
    assert good.future.result() == 3
    with pytest.raises(RuntimeError):
        bad.future.result()
    with pytest.raises(ValueError):
        rejected.future.result()


def test_cancelled_job_leaves_at_next_step() -> None:
    runner = CountingRunner()
    hooks = CancelHooks()
    engine = Engine(runner, BatchScheduler(max_batch=4), hooks)
    keep = engine.submit("keep", {}, {}, total_steps=5)
    drop = engine.submit("drop", {}, {}, total_steps=5)
    engine._drain_inbox(block=False)
    engine.step_once()
    engine.step_once()
    hooks.cancel.add("drop")
    run_until_idle(engine)
    assert drop.state["value"] == 2
    with pytest.raises(JobCancelled):
        drop.future.result()
    assert keep.future.result() == 5
    assert all("drop" not in b for b in runner.batches[2:])
    assert hooks.admitted == ["keep", "drop"]


def test_engine_thread_serves_jobs() -> None:
    engine = Engine(CountingRunner(), BatchScheduler(max_batch=2), idle_wait=0.01).start()
    try:
        jobs = [engine.submit(f"j{i}", {}, {}, total_steps=i + 1) for i in range(5)]
        assert [j.future.result(timeout=10) for j in jobs] == [1, 2, 3, 4, 5]
    finally:
        engine.stop()
    assert not engine.alive


class ReadLateRunner(CountingRunner):
    """Reads a step's results one step late, like the model runners (``workers/engine/settle.py``):
    a job listed in ``bad_at`` turns non-finite at that step, which only the next read finds."""

    def __init__(self, bad_at: dict[str, int]) -> None:
        super().__init__()
        self.bad_at = bad_at
        self.launched: list[tuple[EngineJob, int]] | None = None
        self.found: list[tuple[EngineJob, Exception]] = []
        self.reads: list[list[str]] = []  # per read, the jobs of the step it read

    def step(self, batch: list[EngineJob]) -> None:
        super().step(batch)
        launched = [(job, job.state["value"]) for job in batch]
        self.settle()
        self.launched = launched

    def settle(self) -> None:
        if self.launched is None:
            return
        self.reads.append([job.job_id for job, _ in self.launched])
        for job, value in self.launched:
            if self.bad_at.get(job.job_id) == value:
                job.state["failure"] = FloatingPointError(f"job {job.job_id}: non-finite latents at step {value - 1}")
                self.found.append((job, job.state["failure"]))
        self.launched = None

    def failures(self) -> list[tuple[EngineJob, Exception]]:
        out, self.found = self.found, []
        return out

    def read_steps(self) -> list[tuple[list[EngineJob], float]]:
        return []

    def unread(self, job: EngineJob) -> bool:
        return self.launched is not None and any(j is job for j, _ in self.launched)

    def result(self, job: EngineJob) -> int:
        if self.launched is not None and any(j is job for j, _ in self.launched):
            self.settle()
        if "failure" in job.state:
            raise job.state["failure"]
        return job.state["value"]


def test_a_job_found_non_finite_one_step_late_fails_and_the_others_finish() -> None:
    runner = ReadLateRunner(bad_at={"bad": 2})
    engine = Engine(runner, BatchScheduler(max_batch=4))
    good = engine.submit("good", {}, {}, total_steps=4)
    bad = engine.submit("bad", {}, {}, total_steps=4)
    run_until_idle(engine)
    assert good.future.result() == 4
    with pytest.raises(FloatingPointError, match="job bad: non-finite latents at step 1"):
        bad.future.result()
    # the bad job's second step is read while its third runs: it takes that one more step, no other
    assert runner.batches == [["good", "bad"], ["good", "bad"], ["good", "bad"], ["good"]]


def test_a_finished_job_is_handed_over_only_once_its_last_step_was_read() -> None:
    runner = ReadLateRunner(bad_at={"last": 2})
    engine = Engine(runner, BatchScheduler(max_batch=4))
    short = engine.submit("short", {}, {}, total_steps=1)
    last = engine.submit("last", {}, {}, total_steps=2)
    long = engine.submit("long", {}, {}, total_steps=3)
    engine._drain_inbox(block=False)
    engine.step_once()
    assert not short.future.done()  # its one step is not read yet
    engine.step_once()  # reads the first step: "short" is handed over while the second step runs
    assert short.future.result() == 1 and not last.future.done()
    assert runner.reads == [["short", "last", "long"]]
    engine.step_once()  # reads the second: "last" turned non-finite at its last step, never a result
    with pytest.raises(FloatingPointError, match="job last"):
        last.future.result()
    assert not long.future.done()
    assert not engine.step_once()  # idle: the last step is read and "long" handed over
    assert long.future.result() == 3
    assert runner.reads == [["short", "last", "long"], ["last", "long"], ["long"]]


def test_the_engine_thread_hands_over_every_job_of_a_late_reading_runner() -> None:
    engine = Engine(ReadLateRunner({}), BatchScheduler(max_batch=2), idle_wait=0.01).start()
    try:
        jobs = [engine.submit(f"j{i}", {}, {}, total_steps=i + 1) for i in range(5)]
        assert [j.future.result(timeout=10) for j in jobs] == [1, 2, 3, 4, 5]
    finally:
        engine.stop()


def test_scheduler_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        BatchScheduler(max_batch=0)
    with pytest.raises(ValueError):
        BatchScheduler(max_batch=1, mode="dynamic")
