"""SLO-aware admission in the engine scheduler: expiry with a reason, slack order, refusal to
admit a job that would make a running job miss its deadline; the engine loop with it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from workers.engine.engine import Engine
from workers.engine.job import EngineJob, JobCancelled, JobExpired
from workers.engine.scheduler import BatchScheduler


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def linear(jobs: Sequence[EngineJob]) -> float:
    """One step: 0.1 s + 0.1 s per unit of mask ratio of each job (a toy linear cost model)."""
    return 0.1 + sum(0.1 * j.mask_ratio for j in jobs)


def _admission_order(s: BatchScheduler) -> list[str]:
    """Run every waiting job to completion (one step each); the ids in the order they were admitted."""
    order: list[str] = []
    while s.waiting:
        batch, admitted = s.schedule()
        order += [j.job_id for j in admitted]
        for j in batch:
            j.steps_done = j.total_steps
        s.complete_step(batch)
    return order


def mk(job_id: str, steps: int, ratio: float = 1.0, deadline: float | None = None, priority: int = 0,
       arrival: float = 0.0) -> EngineJob:
    return EngineJob(job_id, steps, priority=priority, deadline=deadline, arrival=arrival, mask_ratio=ratio)


def test_hopeless_waiting_job_is_expired_with_a_reason() -> None:
    clock = Clock()
    expired: list[tuple[str, str]] = []
    s = BatchScheduler(4, step_time=linear, clock=clock, on_expire=lambda j, why: expired.append((j.job_id, why)))
    late = mk("late", 10, deadline=clock.t + 1.0)  # alone: 10 x 0.2 s = 2 s > 1 s
    ok = mk("ok", 10, deadline=clock.t + 5.0)
    s.add(late)
    s.add(ok)
    batch, admitted = s.schedule()
    assert [j.job_id for j in batch] == ["ok"] and admitted == [ok]
    assert [j for j, _ in expired] == ["late"] and "deadline unreachable" in expired[0][1]
    assert late.expired_reason == expired[0][1] and s.pop_expired() == [late] and s.pop_expired() == []
    with pytest.raises(JobExpired):
        late.future.result(timeout=0)
    assert issubclass(JobExpired, JobCancelled)  # the GPU task treats it like a cancellation


def test_admission_refused_when_a_running_job_would_miss_its_deadline() -> None:
    clock = Clock()
    s = BatchScheduler(4, step_time=linear, clock=clock)
    # Running alone: 10 steps x 0.2 s = 2.0 s; its deadline leaves 2.3 s.
    tight = mk("tight", 10, ratio=1.0, deadline=clock.t + 2.3)
    s.add(tight)
    s.schedule()
    big = mk("big", 10, ratio=1.0, arrival=1.0)  # would make each step 0.3 s: 3.0 s > 2.3 s
    small = mk("small", 10, ratio=0.2, arrival=2.0)  # 0.22 s per step: 2.2 s <= 2.3 s
    s.add(big)
    s.add(small)
    batch, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["small"]
    assert [j.job_id for j in s.waiting] == ["big"] and s.refused == 1
    # Once the deadline job is gone, the big one gets in.
    s.remove("tight")
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["big"]


def test_a_job_already_missing_its_deadline_does_not_block_admission() -> None:
    clock = Clock()
    s = BatchScheduler(4, step_time=linear, clock=clock)
    doomed = mk("doomed", 10, deadline=clock.t + 5.0)
    s.add(doomed)
    s.schedule()
    clock.t += 4.5  # 10 steps still to go: will miss whatever happens
    s.add(mk("other", 10))
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["other"]


def test_waiting_jobs_are_ordered_by_priority_then_slack() -> None:
    clock = Clock()
    s = BatchScheduler(1, step_time=linear, clock=clock)
    loose = mk("loose", 10, deadline=clock.t + 100.0, arrival=0.0)
    long_tight = mk("long", 30, deadline=clock.t + 8.0, arrival=1.0)  # alone 6 s: slack 2 s
    short = mk("short", 5, deadline=clock.t + 4.0, arrival=2.0)  # alone 1 s: slack 3 s (earlier deadline!)
    vip = mk("vip", 5, priority=5, arrival=3.0)
    for j in (loose, long_tight, short, vip):
        s.add(j)
    order = _admission_order(s)
    # Earliest-deadline order would be short before long; slack order runs long first.
    assert order == ["vip", "long", "short", "loose"]


def test_without_a_predictor_nothing_changes() -> None:
    s = BatchScheduler(2, clock=Clock())
    s.add(mk("a", 5, deadline=1.0))  # long past: still admitted (today's behaviour)
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["a"] and s.expired == []


class StepRunner:
    def init_state(self, tensors, meta):  # type: ignore[no-untyped-def]
        return 0

    def step(self, batch: list[EngineJob]) -> None:
        for j in batch:
            j.state += 1

    def result(self, job: EngineJob) -> int:
        return job.state


def test_engine_with_slo_admission_expires_and_serves() -> None:
    clock = Clock()
    expired: list[str] = []
    sched = BatchScheduler(2, step_time=linear, clock=clock, on_expire=lambda j, why: expired.append(j.job_id))
    engine = Engine(StepRunner(), sched)
    ok = engine.submit("ok", {}, {}, total_steps=3, deadline=clock.t + 60, mask_ratio=0.5)
    late = engine.submit("late", {}, {}, total_steps=30, deadline=clock.t + 1, mask_ratio=0.5)
    engine._drain_inbox(block=False)
    while engine.step_once():
        pass
    assert ok.future.result(timeout=0) == 3
    with pytest.raises(JobExpired):
        late.future.result(timeout=0)
    assert expired == ["late"]


def test_soft_deadlines_never_expire_a_job_they_put_late_jobs_last() -> None:
    clock = Clock()
    expired: list[str] = []
    s = BatchScheduler(1, step_time=linear, clock=clock, on_expire=lambda j, why: expired.append(j.job_id))
    late = EngineJob("late", 10, deadline=clock.t + 1.0, arrival=0.0, mask_ratio=1.0, hard_deadline=False)
    on_time = EngineJob("on-time", 10, deadline=clock.t + 5.0, arrival=1.0, mask_ratio=1.0, hard_deadline=False)
    s.add(late)
    s.add(on_time)
    order = _admission_order(s)
    assert order == ["on-time", "late"] and expired == [] and s.expired == []


def test_soft_deadlines_do_not_reorder_plain_fcfs_batching() -> None:
    s = BatchScheduler(1, clock=Clock())
    first = EngineJob("first", 5, deadline=2000.0, arrival=0.0, hard_deadline=False)
    urgent = EngineJob("urgent", 5, deadline=1001.0, arrival=1.0, hard_deadline=False)
    user = EngineJob("user", 5, deadline=1500.0, arrival=2.0)  # a user's (hard) deadline still orders
    for j in (first, urgent, user):
        s.add(j)
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["user"]
    s.running.clear()
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["first"]


def sized(job_id: str, hw: tuple[int, int], arrival: float, steps: int = 3) -> EngineJob:
    return EngineJob(job_id, steps, arrival=arrival, latent_hw=hw)


def test_bucketed_batches_hold_one_size_and_the_next_bucket_is_the_oldest_jobs() -> None:
    s = BatchScheduler(4, "bucketed", clock=Clock())
    a1, b1, a2, a3, b2 = (sized("a1", (16, 16), 0), sized("b1", (8, 16), 1), sized("a2", (16, 16), 2),
                          sized("a3", (16, 16), 3), sized("b2", (8, 16), 4))
    for j in (a1, b1, a2, a3, b2):
        s.add(j)
    batch, admitted = s.schedule()  # the oldest job's size; every waiting job of that size joins
    assert [j.job_id for j in admitted] == ["a1", "a2", "a3"] and {j.latent_hw for j in batch} == {(16, 16)}
    a4 = sized("a4", (16, 16), 5)
    s.add(a4)
    _, admitted = s.schedule()  # b1 waits and is older: the bucket takes no newcomer
    assert admitted == []
    for j in list(s.running):
        j.steps_done = j.total_steps
    s.complete_step(list(s.running))
    _, admitted = s.schedule()  # drained: the next bucket is b1's size
    assert [j.job_id for j in admitted] == ["b1", "b2"]
    c = sized("c", (8, 16), 6)
    s.add(c)
    _, admitted = s.schedule()  # a4 (older, other size) waits: no join
    assert admitted == []
    for j in list(s.running):
        j.steps_done = j.total_steps
    s.complete_step(list(s.running))
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["a4"]
    _, admitted = s.schedule()  # nothing older of another size waits now: c would join a (8, 16) bucket only
    assert admitted == [] and [j.job_id for j in s.waiting] == ["c"]


def test_bucketed_joins_while_no_older_job_of_another_size_waits() -> None:
    s = BatchScheduler(4, "bucketed", clock=Clock())
    s.add(sized("a1", (16, 16), 0))
    s.schedule()
    s.add(sized("a2", (16, 16), 1))
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == ["a2"]


def test_engine_sets_each_jobs_latent_grid_and_rows() -> None:
    class SizedRunner(StepRunner):
        def init_state(self, tensors, meta):  # type: ignore[no-untyped-def]
            import torch

            class St:
                latents = torch.zeros(1, 4, meta["h"], meta["w"])
                rows = 2
            return St()

        def step(self, batch: list[EngineJob]) -> None:
            pass

    engine = Engine(SizedRunner(), BatchScheduler(4, "bucketed"))
    engine.submit("a", {}, {"h": 16, "w": 12}, total_steps=2)
    engine._drain_inbox(block=False)
    assert engine.scheduler.waiting[0].latent_hw == (16, 12) and engine.scheduler.waiting[0].rows == 2


def test_a_running_job_late_for_its_soft_deadline_yields_its_slot_to_an_on_time_one() -> None:
    clock = Clock()
    s = BatchScheduler(1, step_time=linear, clock=clock)
    slow = EngineJob("slow", 10, deadline=clock.t + 10.0, mask_ratio=1.0, hard_deadline=False, arrival=0.0)
    s.add(slow)
    batch, _ = s.schedule()
    batch[0].steps_done = 4
    clock.t += 9.5  # 6 steps x 0.2 s still to go: late for good
    fresh = EngineJob("fresh", 5, deadline=clock.t + 5.0, mask_ratio=1.0, hard_deadline=False, arrival=1.0)
    s.add(fresh)
    batch, admitted = s.schedule()
    assert [j.job_id for j in batch] == ["fresh"] and s.yielded == 1 and slow in s.waiting and slow.steps_done == 4
    fresh.steps_done = fresh.total_steps
    s.complete_step([fresh])
    batch, admitted = s.schedule()  # nobody on time waits: the late job resumes where it was
    assert [j.job_id for j in batch] == ["slow"] and slow.steps_done == 4


def test_a_late_job_with_a_hard_deadline_keeps_running() -> None:
    clock = Clock()
    s = BatchScheduler(1, step_time=linear, clock=clock)
    mine = EngineJob("mine", 10, deadline=clock.t + 10.0, mask_ratio=1.0, arrival=0.0)
    s.add(mine)
    s.schedule()
    clock.t += 9.5
    s.add(EngineJob("other", 5, deadline=clock.t + 5.0, mask_ratio=1.0, hard_deadline=False, arrival=1.0))
    batch, _ = s.schedule()
    assert [j.job_id for j in batch] == ["mine"] and s.yielded == 0
