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


def test_scheduler_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        BatchScheduler(max_batch=0)
    with pytest.raises(ValueError):
        BatchScheduler(max_batch=1, mode="dynamic")
