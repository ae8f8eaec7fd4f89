"""Continuous batching's size affinity: under a queue, free slots go to jobs of sizes already in the
batch (fewer denoiser calls per step), bounded so that no job waits for ever; strict FCFS without a
queue or with the setting at 0."""

from __future__ import annotations

from workers.engine.job import EngineJob
from workers.engine.scheduler import BatchScheduler

A, B = (16, 16), (8, 16)


def sized(job_id: str, hw: tuple[int, int], arrival: float, steps: int = 50, **kw: object) -> EngineJob:
    return EngineJob(job_id, steps, arrival=arrival, latent_hw=hw, **kw)  # type: ignore[arg-type]


def _ids(jobs: list[EngineJob]) -> list[str]:
    return [j.job_id for j in jobs]


def _step(s: BatchScheduler) -> list[EngineJob]:
    batch, admitted = s.schedule()
    s.complete_step(batch)
    return admitted


def _crowded(affinity: int) -> BatchScheduler:
    s = BatchScheduler(2, "continuous", size_affinity_steps=affinity)
    s.add(sized("a0", A, 0, steps=1))
    s.add(sized("a1", A, 1))
    assert _ids(_step(s)) == ["a0", "a1"]  # a0 leaves after this step: one slot frees
    for k, (job_id, hw) in enumerate([("b0", B), ("a2", A), ("a3", A)]):
        s.add(sized(job_id, hw, 2 + k, steps=1))
    return s


def test_a_free_slot_goes_to_a_size_already_in_the_batch_when_jobs_queue() -> None:
    s = _crowded(affinity=20)
    assert _ids(_step(s)) == ["a2"]  # b0 is older but of another size: a2 joins a1's size
    assert _ids(_step(s)) == ["a3"]
    assert _ids(_step(s)) == ["b0"]  # no job of the batch's size waits: b0 goes


def test_strict_fcfs_with_affinity_off() -> None:
    s = _crowded(affinity=0)
    assert _ids(_step(s)) == ["b0"]


def test_a_passed_over_job_goes_first_after_the_bound() -> None:
    s = BatchScheduler(2, "continuous", size_affinity_steps=3)
    s.add(sized("a0", A, 0))
    s.add(sized("old", B, 1))
    s.add(sized("a1", A, 2, steps=1))
    admitted = _step(s)  # two free slots, three waiting: a0 first (FCFS), then a1 (a0's size) over old
    assert _ids(admitted) == ["a0", "a1"]
    arrival = 3.0
    passed = 1
    while True:  # a stream of one-step jobs of a0's size keeps coming
        s.add(sized(f"a{arrival:.0f}", A, arrival, steps=1))
        arrival += 1
        admitted = _step(s)
        if _ids(admitted) == ["old"]:
            break
        passed += 1
        assert passed <= 3, "the passed-over job must go first once it was passed over size_affinity_steps times"
    assert passed == 3


def test_every_job_is_admitted_at_once_while_slots_are_free() -> None:
    s = BatchScheduler(4, "continuous", size_affinity_steps=20)
    s.add(sized("a0", A, 0))
    _step(s)
    s.add(sized("b0", B, 1))
    s.add(sized("a1", A, 2))
    assert _ids(_step(s)) == ["b0", "a1"]  # no queue: FCFS, sizes mix


def test_priority_and_user_deadlines_are_not_overtaken() -> None:
    s = BatchScheduler(2, "continuous", size_affinity_steps=20)
    s.add(sized("a0", A, 0))
    s.add(sized("a1", A, 1, steps=1))
    _step(s)
    s.add(sized("urgent", B, 2, priority=1))
    s.add(sized("a2", A, 3))
    assert _ids(_step(s)) == ["urgent"]
    s2 = _crowded(affinity=20)
    s2.waiting[0].deadline = 10_000.0  # b0 with a user (hard) deadline keeps its place
    assert _ids(_step(s2)) == ["b0"]


def test_a_passed_over_job_opens_its_size_for_the_jobs_behind_it() -> None:
    """Once a passed-over job of another size gets in, free slots go to its size first: the batch
    switches size as a group instead of carrying one job of another size (one more call) at a time."""
    s = BatchScheduler(2, "continuous", size_affinity_steps=2)
    s.add(sized("long", A, 0, steps=100))
    s.add(sized("b0", B, 1, steps=1))
    s.add(sized("a1", A, 2, steps=1))
    assert _ids(_step(s)) == ["long", "a1"]  # crowded: a1 joins the batch's size over the older b0
    arrival = 3
    for _ in range(10):
        s.add(sized(f"a{arrival}", A, arrival, steps=1))
        arrival += 1
        if _ids(_step(s)) == ["b0"]:
            break
    else:
        raise AssertionError("b0 was never admitted")
    s.add(sized(f"a{arrival}", A, arrival, steps=1))
    s.add(sized("b1", B, arrival + 1, steps=1))  # younger than the A job waiting beside it
    assert _ids(_step(s)) == ["b1"], "b0's size-mate must follow it before jobs of the batch's other size"
    assert [j.latent_hw for j in _step(s)] == [A]  # no B job waits: the target is dropped, A goes on
    assert s._target_hw is None
