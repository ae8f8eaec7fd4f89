"""SLO admission's policy choices (workers/engine/scheduler.py): size affinity inside SLO admission,
jobs predicted to make their own deadline admitted before jobs that would not, the one-deadline
trade allowed only where filling a slot is nearly free (sublinear batch cost), the slot of a job the
batch makes late given back (``slo_yield="batch"``) and the margin on predicted finishes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from workers.engine.job import EngineJob
from workers.engine.scheduler import SLO_TRADE_MARGINAL, BatchScheduler

A, B = (16, 16), (8, 16)
NOW = 1000.0


def per_size(jobs: Sequence[EngineJob]) -> float:
    """0.1 s per distinct size in the step (one denoiser call each) + 0.01 s per job."""
    return 0.1 * len({j.latent_hw for j in jobs}) + 0.01 * len(jobs)


def job(job_id: str, hw: tuple[int, int], steps: int, deadline: float | None, arrival: float = 0.0,
        hard: bool = False) -> EngineJob:
    return EngineJob(job_id, steps, arrival=arrival, latent_hw=hw, deadline=deadline, hard_deadline=hard)


def _ids(jobs: Sequence[EngineJob]) -> list[str]:
    return [j.job_id for j in jobs]


def _admitted_beside_a_running_job(waiting: list[EngineJob], affinity: int = 0,
                                   cost: Callable[[Sequence[EngineJob]], float] = per_size,
                                   order: str = "slack") -> tuple[list[str], list[str]]:
    """One long job of size A runs (batch of 2: one slot free); ``waiting`` arrive; one schedule.
    Returns (admitted ids, still waiting ids)."""
    s = BatchScheduler(2, step_time=cost, clock=lambda: NOW, size_affinity_steps=affinity, slo_order=order)
    s.add(job("run", A, 100, None))
    s.schedule()
    for j in waiting:
        s.add(j)
    _, admitted = s.schedule()
    return _ids(admitted), _ids(s.waiting)


def test_relaxed_jobs_of_another_size_wait_behind_the_batchs_size_under_slo_admission() -> None:
    # b0 has less slack than a1 (slack order puts it first), but both have plenty: a1 joins run's size.
    relaxed = [job("b0", B, 10, NOW + 100.0), job("a1", A, 10, NOW + 200.0)]
    assert _admitted_beside_a_running_job(relaxed, affinity=50)[0] == ["a1"]


def test_slack_order_without_affinity() -> None:
    relaxed = [job("b0", B, 10, NOW + 100.0), job("a1", A, 10, NOW + 200.0)]
    assert _admitted_beside_a_running_job(relaxed, affinity=0)[0] == ["b0"]


def test_an_urgent_job_keeps_its_slack_order_over_affinity() -> None:
    def cheap_sizes(jobs: Sequence[EngineJob]) -> float:  # an extra size costs 0.01 s here
        return 0.09 + 0.01 * len({j.latent_hw for j in jobs}) + 0.01 * len(jobs)

    # b0 alone needs 10 x 0.11 s = 1.1 s, beside run 1.3 s; its deadline leaves 1.35 s: on time,
    # but its slack (0.25 s) is under 0.25 x 1.1 s: it cannot wait behind a1.
    urgent = [job("b0", B, 10, NOW + 1.35), job("a1", A, 10, NOW + 200.0)]
    assert _admitted_beside_a_running_job(urgent, affinity=50, cost=cheap_sizes)[0] == ["b0"]


def test_arrival_order_offers_the_slot_to_the_oldest_job_that_can_make_its_deadline() -> None:
    # Both make their deadlines beside run; "young" has the least slack, "old" came first.
    both = [job("young", B, 10, NOW + 5.0, arrival=NOW - 1.0), job("old", B, 10, NOW + 50.0, arrival=NOW - 2.0)]
    assert _admitted_beside_a_running_job(both, order="slack")[0] == ["young"]
    assert _admitted_beside_a_running_job(both, order="arrival")[0] == ["old"]


def test_deadline_order_offers_the_slot_to_the_earliest_deadline_that_can_be_made() -> None:
    # "early" came later but is due first; "old" came first; "tight" is due before both but would
    # miss beside run (10 x 0.21 s > 1.5 s): deadline order still offers it no slot ahead of them.
    jobs = [job("old", B, 10, NOW + 50.0, arrival=NOW - 2.0), job("early", B, 10, NOW + 20.0, arrival=NOW - 1.0),
            job("tight", B, 10, NOW + 1.5, arrival=NOW - 0.5)]
    assert _admitted_beside_a_running_job(jobs, order="arrival")[0] == ["old"]
    assert _admitted_beside_a_running_job(jobs, order="deadline")[0] == ["early"]


def test_deadline_order_keeps_size_affinity_and_puts_late_jobs_last() -> None:
    def cheap_sizes(jobs: Sequence[EngineJob]) -> float:  # an extra size costs 0.01 s here
        return 0.09 + 0.01 * len({j.latent_hw for j in jobs}) + 0.01 * len(jobs)

    urgent = [job("b0", B, 10, NOW + 1.35, arrival=NOW - 2.0), job("a1", A, 10, NOW + 200.0, arrival=NOW - 1.0)]
    assert _admitted_beside_a_running_job(urgent, affinity=50, cost=cheap_sizes, order="deadline") == (["a1"], ["b0"])
    jobs = [job("late", B, 10, NOW + 0.5, arrival=NOW - 2.0), job("later", B, 10, NOW + 50.0, arrival=NOW - 1.0)]
    assert _admitted_beside_a_running_job(jobs, order="deadline") == (["later"], ["late"])


def test_arrival_order_keeps_size_affinity_even_for_a_job_with_little_slack() -> None:
    def cheap_sizes(jobs: Sequence[EngineJob]) -> float:  # an extra size costs 0.01 s here
        return 0.09 + 0.01 * len({j.latent_hw for j in jobs}) + 0.01 * len(jobs)

    # b0 came first and has little slack (slack order takes it over affinity, test above); arrival
    # order ranks as plain admission does: run's size first, b0 waits (it is not late).
    urgent = [job("b0", B, 10, NOW + 1.35, arrival=NOW - 2.0), job("a1", A, 10, NOW + 200.0, arrival=NOW - 1.0)]
    assert _admitted_beside_a_running_job(urgent, affinity=50, cost=cheap_sizes, order="arrival") == (["a1"], ["b0"])


def test_arrival_order_still_puts_late_jobs_last() -> None:
    # "late" came first but cannot make its deadline even alone (10 x 0.11 s > 0.5 s): it goes behind.
    jobs = [job("late", B, 10, NOW + 0.5, arrival=NOW - 2.0), job("later", B, 10, NOW + 50.0, arrival=NOW - 1.0)]
    assert _admitted_beside_a_running_job(jobs, order="arrival") == (["later"], ["late"])


def test_slo_order_setting_resolves_per_device_and_rejects_unknown_values() -> None:
    import pytest

    from ops.bench import mixed_sizes
    from workers.engine.scheduler import slo_order_for

    assert slo_order_for("auto", "cpu") == "slack"
    assert slo_order_for("auto", "cuda:0") == "deadline"
    assert slo_order_for("slack", "cuda") == "slack"
    assert slo_order_for("deadline", "cpu") == "deadline"
    with pytest.raises(ValueError, match="SLO order"):
        slo_order_for("fifo", "cpu")
    with pytest.raises(SystemExit):  # the mixed-sizes benchmark's option refuses it before any run
        mixed_sizes.main(["--slo-order", "fifo"])
    with pytest.raises(ValueError, match="slack, arrival or deadline"):
        BatchScheduler(2, slo_order="auto")


def test_a_job_that_would_make_its_own_deadline_goes_before_one_that_would_not() -> None:
    # "tight" meets its deadline alone (10 x 0.11 s = 1.1 s <= 1.5 s) but not beside run
    # (10 x 0.21 s = 2.1 s): it is not late, yet admitting it now would waste the slot on a miss.
    both = [job("tight", B, 10, NOW + 1.5), job("fits", A, 10, NOW + 50.0)]
    assert _admitted_beside_a_running_job(both) == (["fits"], ["tight"])


def test_a_job_that_would_miss_is_still_admitted_into_a_slot_nobody_else_wants() -> None:
    assert _admitted_beside_a_running_job([job("tight", B, 10, NOW + 1.5)])[0] == ["tight"]


def _one_deadline_trade(step: float) -> list[str]:
    """A running job that misses if anyone joins; a newcomer that meets its own deadline either way.
    ``step``: what the newcomer adds to a step, as a share of its own step alone."""
    def cost(jobs: Sequence[EngineJob]) -> float:
        return 1.0 + step * (len(jobs) - 1)

    s = BatchScheduler(2, step_time=cost, clock=lambda: NOW)
    s.add(job("edge", A, 10, NOW + 10.0 + 1e-6))  # 10 steps x 1.0 s alone: just on time
    s.schedule()
    s.add(job("new", A, 10, NOW + 100.0))
    _, admitted = s.schedule()
    return _ids(admitted)


def test_one_deadline_is_traded_for_a_slot_only_where_filling_it_is_nearly_free() -> None:
    assert _one_deadline_trade(0.5 * SLO_TRADE_MARGINAL) == ["new"]  # GPU-like: nearly free
    assert _one_deadline_trade(0.9) == []  # CPU-like: a batch costs the sum of its jobs


def test_never_two_deadlines_for_one_slot() -> None:
    def cost(jobs: Sequence[EngineJob]) -> float:
        return 1.0 + 0.01 * (len(jobs) - 1)

    s = BatchScheduler(3, step_time=cost, clock=lambda: NOW)
    s.add(job("e1", A, 10, NOW + 10.1 + 1e-6))  # both on time together (10 x 1.01 s), not beside a third
    s.add(job("e2", A, 10, NOW + 10.1 + 1e-6))
    s.schedule()
    assert len(s.running) == 2
    s.add(job("new", A, 10, NOW + 100.0))
    _, admitted = s.schedule()
    assert admitted == [] and s.refused == 1


def test_a_late_job_takes_no_slot_in_a_step_where_an_on_time_job_was_refused() -> None:
    def by_ratio(jobs: Sequence[EngineJob]) -> float:  # a batch costs the sum of its jobs (CPU-like)
        return sum(j.mask_ratio for j in jobs)

    def soft(job_id: str, ratio: float, deadline: float) -> EngineJob:
        return EngineJob(job_id, 10, deadline=deadline, latent_hw=A, mask_ratio=ratio, hard_deadline=False)

    s = BatchScheduler(2, step_time=by_ratio, clock=lambda: NOW)
    s.add(soft("edge", 1.0, NOW + 10.05))  # 10 x 1.0 s alone: on time with 0.05 s to spare
    s.schedule()
    s.add(soft("on-time", 1.0, NOW + 100.0))  # would make edge take 20 s: refused
    s.add(soft("late", 0.001, NOW + 0.001))  # cheap (edge still on time beside it) but out of reach
    _, admitted = s.schedule()
    assert admitted == [] and s.refused == 1  # the slot is kept for the on-time job
    s.remove("on-time")
    _, admitted = s.schedule()
    assert _ids(admitted) == ["late"]  # nobody on time wants it now


def _traded_then_a_third_waits(slo_yield: str) -> BatchScheduler:
    """A full batch of 2: "edge" (soft deadline, just on time alone) and "new", admitted by the
    one-deadline trade that costs edge its deadline in the batch; then "third", on time, waits."""
    def nearly_free(jobs: Sequence[EngineJob]) -> float:
        return 1.0 + 0.1 * SLO_TRADE_MARGINAL * (len(jobs) - 1)

    s = BatchScheduler(2, step_time=nearly_free, clock=lambda: NOW, slo_yield=slo_yield)
    s.add(job("edge", A, 10, NOW + 10.0 + 1e-6))
    s.schedule()
    s.add(job("new", A, 10, NOW + 100.0))
    assert _ids(s.schedule()[1]) == ["new"]
    s.add(job("third", A, 10, NOW + 100.0))
    return s


def test_batch_yield_gives_the_slot_of_a_job_the_batch_makes_late_to_an_on_time_one() -> None:
    s = _traded_then_a_third_waits("batch")
    batch, admitted = s.schedule()
    assert _ids(admitted) == ["third"] and sorted(_ids(batch)) == ["new", "third"]
    assert _ids(s.waiting) == ["edge"] and s.yielded == 1  # it keeps its progress and rejoins later


def test_alone_yield_keeps_a_job_that_could_still_make_it_alone() -> None:
    s = _traded_then_a_third_waits("alone")
    batch, admitted = s.schedule()
    assert admitted == [] and sorted(_ids(batch)) == ["edge", "new"] and s.yielded == 0


def test_the_margin_stretches_predicted_finishes() -> None:
    def one_second(jobs: Sequence[EngineJob]) -> float:
        return 1.0

    def first_admitted(margin: float) -> list[str]:
        s = BatchScheduler(1, step_time=one_second, clock=lambda: NOW, slo_order="arrival", slo_margin=margin)
        s.add(job("tight", A, 10, NOW + 10.05, arrival=0.0))  # 10 x 1 s: 0.5% to spare
        s.add(job("roomy", A, 10, NOW + 100.0, arrival=1.0))
        return _ids(s.schedule()[1])

    assert first_admitted(0.0) == ["tight"]
    assert first_admitted(0.01) == ["roomy"]  # 10.1 s > 10.05 s: predicted to miss, it goes after


def test_slo_yield_and_margin_settings_resolve_per_device_and_reject_bad_values() -> None:
    import pytest

    from ops.bench import mixed_sizes
    from workers.engine.scheduler import SLO_MARGIN_CUDA, slo_margin_for, slo_yield_for

    assert slo_yield_for("auto", "cpu") == "alone" and slo_yield_for("auto", "cuda:1") == "batch"
    assert slo_yield_for("alone", "cuda") == "alone"
    assert slo_margin_for("auto", "cpu") == 0.0 and slo_margin_for("auto", "cuda") == SLO_MARGIN_CUDA > 0
    assert slo_margin_for("0.05", "cpu") == 0.05
    for bad in ("-0.1", "nan", "lots"):
        with pytest.raises(ValueError, match="SLO margin"):
            slo_margin_for(bad, "cpu")
        with pytest.raises(SystemExit):  # the mixed-sizes benchmark's option refuses it before any run
            mixed_sizes.main(["--slo-margin", bad])
    with pytest.raises(ValueError, match="SLO yield"):
        slo_yield_for("never", "cpu")
    with pytest.raises(SystemExit):
        mixed_sizes.main(["--slo-yield", "never"])
    with pytest.raises(ValueError):
        BatchScheduler(2, slo_yield="auto")
    with pytest.raises(ValueError):
        BatchScheduler(2, slo_margin=-0.5)
