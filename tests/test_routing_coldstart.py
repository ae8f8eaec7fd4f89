"""A cold start priced as what it costs (``app/coldstart.py``, ``MaskAwareRouter.cold_start_cost``):
full compute until the cache lands, the delay to batch-mates and, scaled by load, to later arrivals."""

from __future__ import annotations

import random

import pytest

from app.coldstart import ClusterLoad, cold_start
from app.costmodel import finish_after_admission
from app.routing import JobDemand, JobLoad, MaskAwareRouter, WorkerState, WorkerView, make_policy
from ops.sim import gpu_dispatch
from tests.test_routing import small_model
from tests.test_routing_curve import curved


@pytest.mark.parametrize("shape", ["linear", "curve"])
def test_cold_start_matches_a_step_by_step_integration(shape: str) -> None:
    rnd = random.Random(11)
    model = small_model() if shape == "linear" else curved(small_model(), 3.0, 1.0, 3.0)
    step, g = model.step_function(), model.job_step_seconds(None)
    seconds = step or (lambda work: model.intercept + work)
    for trial in range(200):
        alive = [(rnd.choice([0.2, 0.5, 1.0]) * g, rnd.choice([1, 4, 9, 30])) for _ in range(rnd.randrange(8))]
        warm_s, steps, t_admit = rnd.choice([0.1, 0.4]) * g, rnd.choice([5, 20, 30]), rnd.choice([0, 0.3, 2]) * g
        lands = rnd.choice([0.0, 0.5, 3.0, 10.0, 100.0]) * g
        t, want = t_admit, [0.0, 0.0, 0.0]  # one step at a time: before ``lands`` the job runs in full
        for k in range(steps):
            mates = [m for m, r in alive if r > k]
            dur = seconds(sum(mates) + (g if t < lands else warm_s))
            added = dur - seconds(sum(mates) + warm_s)
            want = [want[0] + added, want[1] + added * len(mates), want[2] + added * (t + dur)]
            t += dur
        cs = cold_start(t_admit, alive, warm_s, g, lands, steps, model.intercept, step)
        got = [cs.finish, cs.extra_work, cs.mates_delay, cs.exposure]
        assert got == pytest.approx([t, *want], rel=1e-9, abs=1e-12), trial
    assert cs.later_arrivals(ClusterLoad(5.0, 0.25)) == pytest.approx(20.0 * cs.exposure)


def h200(policy: str = "mask_aware") -> MaskAwareRouter:
    model = gpu_dispatch.load("sd15-inpaint-512--h200-bf16", "ops/sim/costmodels/sd15-arch--cpu-1t-projected.json")
    router = make_policy(policy, model.model)
    assert isinstance(router, MaskAwareRouter)
    return router


def batch(prefix: str, n: int, template: str, fresh: bool = False) -> list[JobLoad]:
    return [JobLoad(f"{prefix}{i}", 30 if fresh else (3 + 4 * i) % 30 + 1, 0.2, template_id=template)
            for i in range(n)]


def cluster(saturated: bool) -> WorkerView:
    """``warm`` holds the job's template, 8 running and 2 queued; ``cold`` has a free slot (3 with
    slack, 1 saturated); six others have 5 jobs each, or 8 and 4 queued when saturated."""
    warm = WorkerState("warm", running=batch("w", 8, "tpl"), waiting=batch("q", 2, "tpl", True),
                       templates=frozenset({"tpl"}))
    cold = WorkerState("cold", running=batch("c", 7 if saturated else 5, "x"), templates=frozenset({"x"}))
    others = [WorkerState(f"o{k}", running=batch(f"o{k}-", 8 if saturated else 5, "x"),
                          waiting=batch(f"p{k}-", 4 if saturated else 0, "x", True), templates=frozenset({"x"}))
              for k in range(6)]
    return WorkerView([warm, cold, *others])


JOB = JobDemand("new", 30, 0.2, template_id="tpl")


def test_with_free_slots_a_cold_worker_beats_a_warm_queue() -> None:
    view = cluster(saturated=False)
    chosen = view.workers[h200().choose(JOB, view)]
    assert chosen.n_jobs < chosen.max_batch and "tpl" not in (chosen.templates or ())
    assert h200("mask_aware_fetch").choose(JOB, cluster(saturated=False)) == "warm"  # the fetch outweighs it


def test_with_every_slot_taken_the_warm_worker_wins() -> None:
    router, view = h200(), cluster(saturated=True)
    assert router.choose(JOB, view) == "warm"
    assert h200("mask_aware_unloaded").choose(JOB, cluster(saturated=True)) == "cold"  # blind to the load


def test_the_cold_price_adds_up_and_grows_with_load() -> None:
    router, view = h200(), cluster(saturated=False)
    mine, fetch_s = JobLoad.from_demand(JOB), router.template_fetch_s(JOB)
    cold, warm = view.workers["cold"], view.workers["warm"]
    loads = [ClusterLoad(), ClusterLoad(5.0, 0.5), ClusterLoad(5.0, 0.05), ClusterLoad(20.0, 0.05)]
    prices = [router.cost(mine, cold, fetch_s, load=load) for load in loads]
    assert prices == sorted(prices) and prices[0] < prices[-1]
    assert len({router.cost(mine, warm, fetch_s, load=load) for load in loads}) == 1
    t_admit, alive = router.profile(cold)
    js, step = router.job_seconds(mine), router.model.step_function()
    cs = cold_start(t_admit, alive, js, router.model.job_seconds(mask_ratio=0.2, cached=False), fetch_s, 30,
                    router.model.intercept, step)
    assert cs.mates_delay > cs.extra_work > 0
    assert prices[2] == pytest.approx(cs.finish + cs.mates_delay + cs.later_arrivals(loads[2]), rel=1e-12)
    fetch = h200("mask_aware_fetch")
    assert fetch.cost(mine, cold, fetch_s) == pytest.approx(
        finish_after_admission(t_admit, alive, js, 30, router.model.intercept, step) + fetch_s)


def test_cluster_load_is_the_completion_rate_and_the_free_slot_share() -> None:
    router = h200()
    busy = WorkerState("busy", running=batch("r", 4, "x"), waiting=batch("q", 6, "x"))
    view = WorkerView([WorkerState("idle"), busy])
    load = router.cluster_load(view.candidates(), 30)
    step = router.model.step_seconds([router.model.job_seconds(mask_ratio=0.2)] * 4)
    assert load.arrivals_per_s == pytest.approx(4 / (30 * step) / 2)
    assert load.free_share == pytest.approx(8 / 16)  # the busy worker's queue fills its slots
    full = WorkerView([WorkerState(str(k), running=batch(f"{k}-", 8, "x")) for k in range(3)])
    assert router.cluster_load(full.candidates(), 30).free_share == pytest.approx(3 / 24)  # one per worker
