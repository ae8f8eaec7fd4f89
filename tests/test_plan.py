"""The per-step load/compute planner: exact (equals brute force) and never worse than baselines."""

from __future__ import annotations

import math
import random
import time

import pytest

from workers.engine.plan import (
    PLANNERS,
    RESIDENT,
    UNAVAILABLE,
    BlockCost,
    Tier,
    compare,
    plan_all_full,
    plan_brute_force,
    plan_greedy,
    plan_ideal,
    plan_naive,
    plan_optimal,
    plan_pipelined,
    simulate,
    step_time,
)

PCIE = Tier("host", 12e9)
S3 = Tier("s3", 400e6, latency_s=0.005)
DISK = Tier("disk", 2e9, latency_s=0.0001)


def random_blocks(rng: random.Random, n: int, tiers: list[Tier] | None = None) -> list[BlockCost]:
    tiers = tiers or [PCIE, S3, DISK, RESIDENT, UNAVAILABLE]
    blocks = []
    for i in range(n):
        full = rng.uniform(0.0005, 0.02)
        cached = full * rng.choice([rng.uniform(0.05, 0.6), rng.uniform(0.9, 1.1)])
        load_bytes = rng.choice([0, rng.randint(1, 40_000_000), rng.randint(1, 2_000_000)])
        blocks.append(BlockCost(f"blk{i}", cached, full, load_bytes, rng.choice(tiers)))
    return blocks


def test_dp_equals_brute_force_on_random_instances() -> None:
    rng = random.Random(1234)
    for trial in range(400):
        blocks = random_blocks(rng, rng.randint(0, 10))
        lead = rng.choice([0.0, rng.uniform(0, 0.05), rng.uniform(0, 0.5)])
        best = plan_brute_force(blocks, lead)
        dp = plan_optimal(blocks, lead)
        assert dp.exact
        assert dp.predicted_s == pytest.approx(best.predicted_s, rel=1e-12, abs=1e-15), trial
        assert dp.predicted_s == step_time(blocks, dp.use_cache, lead)


def test_dp_equals_brute_force_when_loads_dominate() -> None:
    """Slow tier, similar blocks: the regime where picking the right subset matters most."""
    rng = random.Random(7)
    slow = Tier("slow", 200e6)
    for _ in range(100):
        blocks = [
            BlockCost(f"b{i}", 0.002 * rng.uniform(0.8, 1.2), 0.01 * rng.uniform(0.8, 1.2),
                      int(2e6 * rng.uniform(0.5, 1.5)), slow)
            for i in range(rng.randint(1, 11))
        ]
        assert plan_optimal(blocks).predicted_s == pytest.approx(
            plan_brute_force(blocks).predicted_s, rel=1e-12
        )


def test_every_planner_reports_its_own_simulated_time() -> None:
    rng = random.Random(99)
    for _ in range(50):
        blocks = random_blocks(rng, rng.randint(1, 30))
        lead = rng.uniform(0, 0.05)
        for name, plan in compare(blocks, lead).items():
            assert len(plan.use_cache) == len(blocks)
            if name not in {"naive", "ideal"}:  # those two use their own execution models
                assert plan.predicted_s == step_time(blocks, plan.use_cache, lead)
            assert plan.timeline[-1].compute_done_s == pytest.approx(plan.predicted_s)


def test_optimal_never_slower_than_any_baseline() -> None:
    rng = random.Random(5)
    for _ in range(200):
        blocks = random_blocks(rng, rng.randint(1, 40))
        lead = rng.choice([0.0, rng.uniform(0, 0.1)])
        plans = compare(blocks, lead)
        opt = plans["optimal"].predicted_s
        tol = 1e-12 * max(1.0, opt)
        for name in ("all_full", "pipelined", "greedy", "naive"):
            assert opt <= plans[name].predicted_s + tol, name
        assert plans["ideal"].predicted_s <= opt + tol


def test_all_resident_equals_ideal() -> None:
    rng = random.Random(3)
    for _ in range(50):
        blocks = random_blocks(rng, rng.randint(1, 40), tiers=[RESIDENT])
        assert plan_optimal(blocks).predicted_s == pytest.approx(plan_ideal(blocks).predicted_s)
        assert plan_optimal(blocks).stall_s == 0


def test_enough_prefetch_lead_equals_ideal() -> None:
    rng = random.Random(11)
    blocks = random_blocks(rng, 30, tiers=[PCIE, S3])
    total_load = sum(b.load_s for b in blocks)
    plan = plan_optimal(blocks, lead_s=total_load)
    assert plan.predicted_s == pytest.approx(plan_ideal(blocks).predicted_s)


def test_unavailable_block_is_computed_full() -> None:
    blocks = [
        BlockCost("a", 0.001, 0.010, 1000, RESIDENT),
        BlockCost("b", 0.0001, 0.050, 1000, UNAVAILABLE),  # would be a huge win if it existed
        BlockCost("c", 0.001, 0.010, 1000, RESIDENT),
    ]
    for name, planner in PLANNERS.items():
        plan = planner(blocks, 0.0)
        assert plan.use_cache[1] is False, name
    assert plan_optimal(blocks).predicted_s == pytest.approx(0.001 + 0.050 + 0.001)
    with pytest.raises(ValueError):
        simulate(blocks, [True, True, True])


def test_hand_computed_timeline() -> None:
    """Loads 2 s each on one stream from t=-1 (lead); compute waits only for its own load."""
    tier = Tier("t", 1.0)  # 1 byte/s: load_bytes are seconds
    blocks = [
        BlockCost("b0", 1.0, 4.0, 2, tier),
        BlockCost("b1", 1.0, 4.0, 2, tier),
        BlockCost("b2", 1.0, 4.0, 2, tier),
    ]
    timeline = simulate(blocks, [True, True, True], lead_s=1.0)
    assert [(t.load_start_s, t.load_done_s) for t in timeline] == [(-1, 1), (1, 3), (3, 5)]
    assert [(t.compute_start_s, t.compute_done_s) for t in timeline] == [(1, 2), (3, 4), (5, 6)]
    assert plan_pipelined(blocks, 1.0).stall_s == 3.0
    assert plan_naive(blocks, 1.0).predicted_s == 5 + 3
    assert plan_all_full(blocks, 1.0).predicted_s == 12
    # 6 s is optimal, reached two ways: pipelining all three, or computing b0 fully while b1's
    # and b2's loads finish (b0 [0, 4], b1 [4, 5], b2 [5, 6]). The tie goes to the plan that
    # frees the copy stream earlier (at 3 s, not 5 s): that is the next step's prefetch lead.
    opt = plan_optimal(blocks, 1.0)
    assert opt.predicted_s == 6.0
    assert opt.use_cache == (False, True, True)
    assert opt.copy_free_s == 3.0


def test_optimal_beats_the_greedy_heuristic() -> None:
    """Greedy takes block 0's cache because it helps locally; its load then delays block 1's
    much more valuable load. The DP sees the whole step."""
    tier = Tier("t", 1.0)
    blocks = [
        BlockCost("b0", 8.0, 10.0, 2, tier),
        BlockCost("b1", 0.1, 10.0, 9, tier),
    ]
    assert plan_greedy(blocks).predicted_s == pytest.approx(11.1)
    opt = plan_optimal(blocks)
    assert opt.use_cache == (False, True)
    assert opt.predicted_s == pytest.approx(10.1)


def test_ties_prefer_freeing_the_copy_stream_early() -> None:
    """Loading a block whose cached compute is no faster only steals the next step's lead."""
    blocks = [BlockCost("b0", 1.0, 1.0, 1, Tier("t", 10.0))]
    plan = plan_optimal(blocks, lead_s=1.0)  # load done before compute starts: a pure tie
    assert plan_pipelined(blocks, lead_s=1.0).predicted_s == plan.predicted_s == 1.0
    assert plan.use_cache == (False,)
    assert plan.copy_free_s == -math.inf


def test_thinned_frontier_is_valid_and_flagged() -> None:
    rng = random.Random(21)
    slow = Tier("slow", 500e6)
    blocks = [
        BlockCost(f"b{i}", 0.002 * rng.uniform(0.9, 1.1), 0.01 * rng.uniform(0.9, 1.1),
                  int(5e6 * rng.uniform(0.9, 1.1)), slow)
        for i in range(40)
    ]
    exact = plan_optimal(blocks)
    thin = plan_optimal(blocks, max_states=4)
    assert exact.exact and not thin.exact
    assert exact.predicted_s <= thin.predicted_s == step_time(blocks, thin.use_cache)


def test_seventy_blocks_plan_quickly() -> None:
    """SDXL has 70 transformer blocks; the plan runs every step, so it must be cheap."""
    rng = random.Random(0)
    blocks = [
        BlockCost(f"b{i}", 0.002 * rng.uniform(0.9, 1.1), 0.01 * rng.uniform(0.9, 1.1),
                  int(5e6 * rng.uniform(0.9, 1.1)), Tier("host", 1e9))
        for i in range(70)
    ]
    t0 = time.perf_counter()
    plan = plan_optimal(blocks)
    elapsed = time.perf_counter() - t0
    assert plan.exact
    assert elapsed < 0.5
    assert plan.predicted_s < plan_pipelined(blocks).predicted_s
    assert plan.predicted_s < plan_all_full(blocks).predicted_s


def test_invalid_inputs_rejected() -> None:
    with pytest.raises(ValueError):
        BlockCost("x", -1.0, 1.0, 0, RESIDENT)
    with pytest.raises(ValueError):
        BlockCost("x", 1.0, math.nan, 0, RESIDENT)
    with pytest.raises(ValueError):
        BlockCost("x", 1.0, 1.0, -5, RESIDENT)
    with pytest.raises(ValueError):
        plan_optimal([BlockCost("x", 1.0, 1.0, 0, RESIDENT)], lead_s=-1)
    assert plan_optimal([]).predicted_s == 0.0


def test_next_lead_is_copy_idle_time_before_the_next_step() -> None:
    from workers.engine.plan import plan_optimal, simulate

    store = Tier("store", 1000.0)
    blocks = [BlockCost("a", 0.1, 2.0, 500, store), BlockCost("b", 0.1, 1.0, 500, store)]
    plan = plan_optimal(blocks)  # loads 0.5 + 0.5, compute waits: done at 1.1, copy free at 1.0
    assert plan.predicted_s == pytest.approx(1.1) and plan.copy_free_s == pytest.approx(1.0)
    assert plan.next_lead_s() == pytest.approx(0.1)
    assert plan_optimal(blocks, lead_s=5.0).next_lead_s() == pytest.approx(0.2)  # loads done before
    assert plan_optimal(blocks, lead_s=5.0).next_lead_s(queued_at_s=0.15) == pytest.approx(0.05)
    none = plan_optimal([BlockCost("a", 0.1, 0.2, 10**9, store)])  # never worth loading
    assert none.cached_blocks == 0 and none.next_lead_s() == pytest.approx(0.2)
    # With that lead the next step's first load is (partly) hidden: fewer bubbles than cold.
    nxt = plan_optimal(blocks, lead_s=plan.next_lead_s())
    assert nxt.predicted_s < plan.predicted_s
    assert simulate(blocks, nxt.use_cache, plan.next_lead_s())[0].load_start_s == pytest.approx(-0.1)


def test_a_busy_copy_stream_delays_loads_and_can_flip_the_decision() -> None:
    """Loads start after transfers already on the link: a load that pays off on an idle link is
    computed fully when the link stays busy past the block's start; copy_busy_s nets with lead_s."""
    tier = Tier("store", 1e9)
    blocks = [BlockCost("gap", 0.010, 0.010, 0, tier), BlockCost("u", 0.010, 0.040, 10_000_000, tier)]
    idle = plan_optimal(blocks)
    assert idle.use_cache[1] and idle.predicted_s == pytest.approx(0.020)  # 10 ms load hidden by the gap
    busy = plan_optimal(blocks, copy_busy_s=0.100)
    assert not busy.use_cache[1] and busy.predicted_s == pytest.approx(0.050)
    netted = plan_optimal(blocks, lead_s=0.100, copy_busy_s=0.100)
    assert netted.use_cache == idle.use_cache and netted.predicted_s == pytest.approx(idle.predicted_s)
    with pytest.raises(ValueError):
        plan_optimal(blocks, copy_busy_s=-1)
