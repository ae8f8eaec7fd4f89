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


# -- changing size by draining (size_switch="drain", the CPU default) --------------------------------


def _overloaded_run(switch: str, seed: int = 0, steps: int = 400, weights: tuple[float, ...] = (1, 1, 1),
                    affinity: int = 6) -> tuple[int, int, int]:
    """Overload: jobs of 4-16 steps arrive every other step at 4 slots (the batch ends 0.4 jobs a step
    at most), three sizes drawn at random (``weights``). Returns (steps that ran more than one size,
    steps that ran, the longest any job waited, in job-steps run meanwhile: the time it waited
    where a batch costs the sum of its jobs, the devices drain is for)."""
    import random

    rng = random.Random(seed)
    sizes = [A, B, (16, 8)]
    s = BatchScheduler(4, "continuous", size_affinity_steps=affinity, size_switch=switch)
    arrived: dict[str, int] = {}  # job -> job-steps run before it arrived
    mixed = ran = longest = work = 0
    for step in range(steps):
        for k in range(12 if step == 0 else step % 2):  # a queue from the start, growing all along
            job_id = f"j{step}.{k}"
            s.add(sized(job_id, rng.choices(sizes, weights)[0], step + k / 100, steps=rng.randint(4, 16)))
            arrived[job_id] = work
        batch, _ = s.schedule()
        longest = max([longest] + [work - arrived[j.job_id] for j in s.waiting])
        work += len(batch)
        ran += bool(batch)
        mixed += len({j.latent_hw for j in batch}) > 1
        s.complete_step(batch)
    return mixed, ran, longest


def test_drain_never_mixes_sizes_under_a_queue_and_mix_does() -> None:
    mixed, ran, _ = _overloaded_run("drain")
    assert ran == 400 and mixed == 0, f"{mixed} of {ran} steps ran two sizes while jobs queued"
    mixed, ran, _ = _overloaded_run("mix")
    assert mixed >= 10  # the same stream mixes when the new size joins beside the old (30 of 400 steps)


def test_drain_starves_nobody() -> None:
    """A passed-over job waits its bound, one drain (the batch's remaining steps) and the jobs of
    its size ahead of it: no job waits for ever, even when one size keeps coming, and not much
    longer than when sizes mix."""
    majority = (0.9, 0.05, 0.05)
    unbounded = _overloaded_run("drain", 0, 800, majority, affinity=10**6)[2]
    for seed in range(3):
        drained = _overloaded_run("drain", seed, 800, majority)[2]
        mixed = _overloaded_run("mix", seed, 800, majority)[2]
        assert drained <= 2 * mixed, (seed, drained, mixed)
        assert drained < unbounded / 2, (seed, drained, unbounded)


def test_drain_opens_the_passed_over_size_once_the_batch_finished() -> None:
    s = BatchScheduler(2, "continuous", size_affinity_steps=2, size_switch="drain")
    s.add(sized("a0", A, 0, steps=3))
    s.add(sized("b0", B, 1, steps=1))
    s.add(sized("a1", A, 2, steps=1))
    assert _ids(_step(s)) == ["a0", "a1"]  # crowded: a1 joins a0's size over the older b0
    s.add(sized("a2", A, 3, steps=1))
    s.add(sized("b1", B, 4, steps=1))
    assert _ids(_step(s)) == ["a2"]  # b0 passed over twice now: its bound is up
    s.add(sized("a3", A, 5, steps=1))
    assert _ids(_step(s)) == [], "the batch must drain (a0's last step alone), not take b0 beside a0"
    assert [j.job_id for j in s.running] == []
    assert _ids(_step(s)) == ["b0", "b1"], "the empty batch opens b0's size and b1 follows it"


def test_drain_switches_to_the_oldest_waiting_size_when_none_of_the_batch_size_waits() -> None:
    s = BatchScheduler(2, "continuous", size_affinity_steps=20, size_switch="drain")
    s.add(sized("a0", A, 0, steps=2))
    s.add(sized("a1", A, 1, steps=1))
    _step(s)
    s.add(sized("b0", B, 2, steps=1))
    s.add(sized("c0", (16, 8), 3, steps=1))
    s.add(sized("b1", B, 4, steps=1))
    assert _ids(_step(s)) == [], "no job of A waits: the batch drains instead of mixing b0 in"
    assert _ids(_step(s)) == ["b0", "b1"], "then it opens the oldest waiting job's size, whose size-mates follow"


def test_drain_opens_an_empty_batch_with_the_first_ready_job() -> None:
    """A job whose adapters are still loading does not hold an empty batch idle: the first ready
    job opens it and its size-mates follow."""
    s = BatchScheduler(2, "continuous", size_affinity_steps=20, size_switch="drain",
                       ready=lambda job: job.job_id != "a0")
    s.add(sized("a0", A, 0))
    s.add(sized("b0", B, 1))
    s.add(sized("a1", A, 2))
    s.add(sized("b1", B, 3))
    assert _ids(_step(s)) == ["b0", "b1"]


def test_drain_still_mixes_without_a_queue_and_for_user_deadlines() -> None:
    s = BatchScheduler(4, "continuous", size_affinity_steps=20, size_switch="drain")
    s.add(sized("a0", A, 0))
    _step(s)
    s.add(sized("b0", B, 1))
    s.add(sized("a1", A, 2))
    assert _ids(_step(s)) == ["b0", "a1"]  # slots for everybody: nobody waits for a drain
    s2 = _crowded(affinity=20)
    s2.size_switch = "drain"
    s2.waiting[0].deadline = 10_000.0  # b0 with a user (hard) deadline joins beside the A job
    assert _ids(_step(s2)) == ["b0"]


def test_size_switch_setting_resolves_per_device_and_rejects_unknown_values() -> None:
    import pytest

    from ops.bench import mixed_sizes
    from workers.engine.scheduler import size_switch_for

    assert size_switch_for("auto", "cpu") == "drain"
    assert size_switch_for("auto", "cuda:1") == "mix"
    assert size_switch_for("mix", "cpu") == "mix"
    with pytest.raises(ValueError, match="size switch"):
        size_switch_for("bucket", "cpu")
    with pytest.raises(SystemExit):  # the mixed-sizes benchmark's option refuses it before any run
        mixed_sizes.main(["--size-switch", "sometimes"])
    with pytest.raises(ValueError, match="size switch"):
        BatchScheduler(2, size_switch="auto")
