"""A cold start (a worker without the job's template cache) priced as what it costs: full compute
until the cache lands, the delay to its batch-mates, and the delay to later arrivals, which grows
as the cluster's free batch slots run out (``app/coldstart.py``, ``MaskAwareRouter.cold_start_cost``)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from app.coldstart import ClusterLoad, cold_start
from app.costmodel import finish_after_admission
from app.routing import JobDemand, JobLoad, MaskAwareRouter, WorkerState, WorkerView, make_policy
from ops.sim import gpu_dispatch
from tests.test_routing import small_model
from tests.test_routing_curve import curved

H200 = "sd15-inpaint-512--h200-bf16"
SD15_ARCH = "ops/sim/costmodels/sd15-arch--cpu-1t-projected.json"


def step_by_step(t_admit: float, alive: list[tuple[float, int]], warm_s: float, cold_s: float, lands: float,
                 steps: int, seconds: Callable[[float], float]) -> tuple[float, float, float, float]:
    """(finish, extra work, batch-mates' delay, exposure), one step at a time: a step that starts
    before ``lands`` runs the job in full; its extra seconds delay every mate still running."""
    t = t_admit
    extra = delay = exposure = 0.0
    for k in range(steps):
        mates = [g for g, r in alive if r > k]
        if t < lands:
            dur = seconds(sum(mates) + cold_s)
            added = dur - seconds(sum(mates) + warm_s)
            extra += added
            delay += added * len(mates)
            exposure += added * (t + dur)
        else:
            dur = seconds(sum(mates) + warm_s)
        t += dur
    return t, extra, delay, exposure


@pytest.mark.parametrize("shape", ["linear", "curve"])
def test_cold_start_integrates_full_steps_until_the_cache_lands(shape: str) -> None:
    rnd = random.Random(11)
    model = small_model() if shape == "linear" else curved(small_model(), 3.0, 1.0, 3.0)
    step = model.step_function()
    seconds = (lambda w: model.intercept + w) if step is None else step
    g = model.job_step_seconds(None)
    for trial in range(200):
        alive = [(rnd.choice([0.2, 0.5, 1.0]) * g, rnd.choice([1, 4, 9, 30])) for _ in range(rnd.randrange(8))]
        warm_s, cold_s = rnd.choice([0.1, 0.4]) * g, g
        steps, t_admit = rnd.choice([5, 20, 30]), rnd.choice([0.0, 0.3, 2.0]) * g
        lands = rnd.choice([0.0, 0.5, 3.0, 10.0, 100.0]) * g
        cs = cold_start(t_admit, alive, warm_s, cold_s, lands, steps, model.intercept, step)
        want = step_by_step(t_admit, alive, warm_s, cold_s, lands, steps, seconds)
        got = (cs.finish, cs.extra_work, cs.mates_delay, cs.exposure)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), trial


def test_a_cache_that_lands_while_the_job_queues_costs_nothing() -> None:
    model = small_model()
    g = model.job_step_seconds(None)
    alive = [(0.3 * g, 4), (0.5 * g, 25)]
    cs = cold_start(5 * g, alive, 0.2 * g, g, 4 * g, 20, model.intercept)
    assert cs.finish == pytest.approx(finish_after_admission(5 * g, alive, 0.2 * g, 20, model.intercept))
    assert cs.extra_work == cs.mates_delay == cs.exposure == 0.0
    assert cs.later_arrivals(ClusterLoad(100.0, 0.01)) == 0.0


def h200_router() -> MaskAwareRouter:
    router = make_policy("mask_aware", gpu_dispatch.load(H200, SD15_ARCH).model)
    assert isinstance(router, MaskAwareRouter)
    return router


def batch(prefix: str, n: int, template: str, *, fresh: bool = False) -> list[JobLoad]:
    """``n`` jobs (mask ratio 0.2) of ``template``, 30 steps left if ``fresh`` (waiting), else spread over 1-30."""
    return [JobLoad(f"{prefix}{i}", 30 if fresh else (3 + 4 * i) % 30 + 1, 0.2, template_id=template)
            for i in range(n)]


def cluster(saturated: bool) -> WorkerView:
    """``warm``: the new job's template, a full batch of 8 and 2 queued; ``cold``: other templates and
    a free slot (3 under slack, 1 saturated); six more workers, 5 jobs each under slack, a full batch
    and 4 queued each when saturated (every slot in the cluster but the cold worker's taken)."""
    warm = WorkerState("warm", running=batch("w", 8, "tpl"), waiting=batch("q", 2, "tpl", fresh=True),
                       templates=frozenset({"tpl"}))
    cold = WorkerState("cold", running=batch("c", 7 if saturated else 5, "x"), templates=frozenset({"x"}))
    others = [WorkerState(f"o{k}", running=batch(f"o{k}-", 8 if saturated else 5, "x"),
                          waiting=batch(f"oq{k}-", 4 if saturated else 0, "x", fresh=True), templates=frozenset({"x"}))
              for k in range(6)]
    return WorkerView([warm, cold, *others])


def test_with_free_slots_a_cold_worker_beats_a_warm_queue() -> None:
    """On the H200 curve a cold start costs a few full-compute steps (its 0.9 s fetch runs while the job
    computes), less than queueing behind 2 jobs at the template's worker: the router spreads."""
    router = h200_router()
    view = cluster(saturated=False)
    chosen = view.workers[router.choose(JobDemand("new", 30, 0.2, template_id="tpl"), view)]
    assert chosen.worker_id != "warm"
    assert chosen.n_jobs < chosen.max_batch and "tpl" not in (chosen.templates or ())


def test_with_every_slot_taken_the_warm_worker_wins() -> None:
    """The same cold start near saturation: its extra work delays the later arrivals the cluster has no
    free slot for (the price's multiplier at its bound, 8), so the job queues at the worker holding
    its template."""
    router = h200_router()
    view = cluster(saturated=True)
    job = JobDemand("new", 30, 0.2, template_id="tpl")
    assert router.choose(job, view) == "warm"
    # without the later arrivals' term the cold worker would be cheaper: the load decides
    mine, fetch_s = JobLoad.from_demand(job), router.template_fetch_s(job)
    assert router.cost(mine, view.workers["cold"], fetch_s) < router.cost(mine, view.workers["warm"], fetch_s)


def test_the_cold_price_grows_with_load_and_the_warm_price_does_not() -> None:
    router = h200_router()
    view = cluster(saturated=False)
    job = JobLoad.from_demand(JobDemand("new", 30, 0.2, template_id="tpl"))
    fetch_s = router.template_fetch_s(JobDemand("new", 30, 0.2, template_id="tpl"))
    loads = [ClusterLoad(), ClusterLoad(5.0, 0.5), ClusterLoad(5.0, 0.05), ClusterLoad(20.0, 0.05)]
    cold = [router.cost(job, view.workers["cold"], fetch_s, load=load) for load in loads]
    warm = {router.cost(job, view.workers["warm"], fetch_s, load=load) for load in loads}
    assert cold == sorted(cold) and cold[0] < cold[-1]
    assert len(warm) == 1
    # with no later arrivals: the job's own finish, computing fully until the cache lands, + its mates' delay
    t_admit, alive = router.profile(view.workers["cold"])
    full_s = router.model.job_seconds(mask_ratio=0.2, cached=False)
    cs = cold_start(t_admit, alive, router.job_seconds(job), full_s, fetch_s, 30, router.model.intercept,
                    router.model.step_function())
    assert cs.extra_work > 0 and cs.mates_delay > cs.extra_work  # the cache lands after the job's first steps
    assert cold[0] == pytest.approx(cs.finish + cs.mates_delay, rel=1e-12)


def test_cluster_load_is_the_completion_rate_and_the_free_slot_share() -> None:
    router = h200_router()
    model = router.model
    running = batch("r", 4, "x")
    view = WorkerView([WorkerState("idle"), WorkerState("busy", running=running, waiting=batch("q", 6, "x"))])
    load = router.cluster_load(view.candidates(), 30)
    step = model.step_seconds([model.job_seconds(mask_ratio=0.2)] * 4)
    assert load.arrivals_per_s == pytest.approx(4 / (30 * step) / 2)
    assert load.free_share == pytest.approx(8 / 16)  # the busy worker's queue fills its slots
    full = WorkerView([WorkerState(str(k), running=batch(f"{k}-", 8, "x")) for k in range(3)])
    assert router.cluster_load(full.candidates(), 30).free_share == pytest.approx(3 / 24)  # one slot per worker


def test_the_ablations_price_the_fetch_or_leave_out_the_load() -> None:
    """``mask_aware_fetch``: a cold worker costs the warm finish + the whole fetch (the job waiting for
    its cache); ``mask_aware_unloaded``: the cold price with no later arrivals; both pick ``warm`` and
    ``cold`` where the default price picks the other (the tests above)."""
    model = gpu_dispatch.load(H200, SD15_ARCH).model
    job = JobDemand("new", 30, 0.2, template_id="tpl")
    mine = JobLoad.from_demand(job)
    fetch, unloaded = make_policy("mask_aware_fetch", model), make_policy("mask_aware_unloaded", model)
    assert isinstance(fetch, MaskAwareRouter) and isinstance(unloaded, MaskAwareRouter)
    saturated = cluster(saturated=True)
    cold, warm = saturated.workers["cold"], saturated.workers["warm"]
    fetch_s = fetch.template_fetch_s(job)
    busy = fetch.cluster_load(saturated.candidates(), 30)
    t_admit, alive = fetch.profile(cold)
    assert fetch.cost(mine, cold, fetch_s, load=busy) == pytest.approx(
        finish_after_admission(t_admit, alive, fetch.job_seconds(mine), 30, model.intercept, model.step_function())
        + fetch_s)
    assert fetch.cost(mine, warm, fetch_s, load=busy) == unloaded.cost(mine, warm, fetch_s, load=busy)
    assert unloaded.cost(mine, cold, fetch_s, load=busy) == unloaded.cost(mine, cold, fetch_s)
    assert fetch.choose(job, cluster(saturated=False)) == "warm"  # the fetch outweighs the queue
    assert unloaded.choose(job, cluster(saturated=True)) == "cold"  # blind to the load
