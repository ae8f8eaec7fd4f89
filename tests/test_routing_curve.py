"""Routing and SLO admission on a curved batch step (``CostModel.curve``, ``app.costmodel.StepCurve``):
a job added to a worker costs ``t(W + w) - t(W)`` on the curve, the router prefers a worker below the
curve's knee, and a model without a curve keeps its linear step exactly."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from app.costmodel import (
    CostModel,
    StepCurve,
    admission_profile,
    min_service_seconds,
    queue_finish_time,
    step_time_predictor,
)
from app.routing import JobDemand, JobLoad, MaskAwareRouter, WorkerState, WorkerView, make_policy
from tests.test_routing import small_model

ROOT = Path(__file__).resolve().parents[1]


def roofline(h: float, c: float, p: float, work: float) -> float:
    """The curve's formula, written out here independently of ``StepCurve``."""
    return (h ** p + (c * work) ** p) ** (1.0 / p)


def curved(model: CostModel, h_jobs: float, c_jobs: float, p: float) -> CostModel:
    """``model`` with a curve whose floor and per-job slope are given in full jobs' seconds."""
    g = model.job_step_seconds(None)
    return dataclasses.replace(model, curve=StepCurve(h_jobs * g, c_jobs * g, p), _memo={})


def brute_finish(model: CostModel, running: list[JobLoad], queued: list[JobLoad], max_batch: int) -> float:
    """Seconds until the last of ``queued`` finishes: a step at a time, free slots filled in order,
    each step priced on the curve at its jobs' work (work = job seconds / a full job's seconds)."""
    assert model.curve is not None
    h, c, p = model.curve.floor_s, model.curve.per_job_s, model.curve.knee
    full = model.job_step_seconds(None)

    def sec(j: JobLoad) -> float:
        return model.job_seconds(mask_ratio=j.mask_ratio, cached=j.cached)

    batch = [[sec(j), j.remaining] for j in running]
    waiting = [[sec(j), j.remaining] for j in queued]
    target = waiting[-1]
    t = 0.0
    while True:
        while waiting and len(batch) < max_batch:
            batch.append(waiting.pop(0))
        t += roofline(h, c, p, sum(s for s, _ in batch) / full)
        for entry in batch:
            entry[1] -= 1
        if target[1] == 0 and any(e is target for e in batch):
            return t
        batch = [e for e in batch if e[1] > 0]


def test_a_job_added_to_a_batch_costs_the_curve_difference() -> None:
    h, c, p = 4.0, 1.0, 3.0
    model = curved(small_model(), h, c, p)
    g = model.job_step_seconds(None)
    masked = model.job_seconds(mask_ratio=0.1)
    w = masked / g
    assert 0.0 < w < 1.0  # a masked job is less work than a full one
    for full_jobs in range(0, 9):
        before = model.step_seconds([g] * full_jobs)
        after = model.step_seconds([g] * full_jobs + [masked])
        expected = roofline(h * g, c * g, p, full_jobs + w) - roofline(h * g, c * g, p, full_jobs)
        assert after - before == pytest.approx(expected, rel=1e-9)
    # below the knee a job adds far less than its linear seconds, past it about c per full job
    assert model.step_seconds([g] * 2) - model.step_seconds([g]) < 0.2 * g
    assert model.step_seconds([g] * 16) - model.step_seconds([g] * 15) == pytest.approx(c * g, rel=0.03)


def test_slo_admission_and_deadlines_use_the_curve() -> None:
    model = curved(small_model(), 4.0, 1.0, 3.0)
    g = model.job_step_seconds(None)
    jobs = [JobLoad("a", 5, 1.0, cached=False), JobLoad("b", 5, 0.3)]
    work = sum(model.job_seconds(mask_ratio=j.mask_ratio, cached=j.cached) for j in jobs) / g
    assert step_time_predictor(model)(jobs) == pytest.approx(roofline(4 * g, g, 3.0, work))
    alone = min_service_seconds(model, 20, mask_ratio=0.3)
    assert alone == pytest.approx(20 * roofline(4 * g, g, 3.0, model.job_seconds(mask_ratio=0.3) / g))


def test_the_router_integrates_the_curve_over_the_workers_future() -> None:
    rnd = random.Random(3)
    model = curved(small_model(), 3.0, 1.0, 2.5)
    router = MaskAwareRouter(model)
    for trial in range(60):
        mb = rnd.choice([2, 4, 8])
        running = [JobLoad(f"r{trial}-{k}", rnd.choice([1, 3, 7, 20]), rnd.choice([0.05, 0.3, 1.0]),
                           cached=rnd.random() > 0.2) for k in range(rnd.randrange(mb + 1))]
        waiting = [JobLoad(f"w{trial}-{k}", rnd.choice([2, 10]), rnd.choice([0.1, 0.5]))
                   for k in range(rnd.randrange(4))]
        mine = JobLoad(f"n{trial}", rnd.choice([5, 20]), rnd.choice([0.05, 0.3, 1.0]))
        w = WorkerState(str(trial), running=running, waiting=waiting, max_batch=mb)
        expected = brute_finish(model, running, waiting + [mine], mb)
        assert router.cost(mine, w, 0.0) == pytest.approx(expected, rel=1e-9), trial
        assert router.lower_bound(w, router.job_seconds(mine), mine.remaining) <= expected * (1 + 1e-12), trial
        js = router.job_seconds
        assert queue_finish_time([(js(j), j.remaining) for j in running],
                                 [(js(j), j.remaining) for j in waiting + [mine]], mb, model.intercept,
                                 model.step_function()) == pytest.approx(expected, rel=1e-9)


def test_with_a_curve_the_router_prefers_the_worker_below_the_knee() -> None:
    """Worker ``below`` holds 3 long jobs (a 4th sits below the knee, nearly free); ``past`` holds 6
    jobs with 8 steps left (a 7th shares 8 steps past the knee). The linear step (intercept 2 full jobs'
    seconds, each job its seconds) says ``past`` is cheaper; the curve (h = 4 jobs' seconds, c = 1, p = 4)
    says ``below``: on the curve the 4th job costs next to nothing."""
    linear = dataclasses.replace(small_model(), _memo={})
    linear = dataclasses.replace(linear, intercept=2 * linear.job_step_seconds(None), _memo={})
    curve = curved(linear, 4.0, 1.0, 4.0)

    def workers() -> WorkerView:
        below = WorkerState("below", running=[JobLoad(f"b{k}", 20, cached=False) for k in range(3)])
        past = WorkerState("past", running=[JobLoad(f"p{k}", 8, cached=False) for k in range(6)])
        return WorkerView([below, past])

    new = JobDemand("new", 20, cached=False)
    g = linear.job_step_seconds(None)
    t = lambda jobs: roofline(4 * g, g, 4.0, jobs)  # noqa: E731
    assert 20 * t(4) < 8 * t(7) + 12 * t(1)  # the curve's own numbers say below is cheaper
    assert 20 * (2 * g + 4 * g) > 8 * (2 * g + 7 * g) + 12 * (2 * g + g)  # the linear step says past
    for model, want in ((curve, "below"), (linear, "past")):
        for first in range(2):  # either rotation start: not a tie broken by order
            router = make_policy("mask_aware", model)
            for _ in range(first):
                router._rot.order([WorkerState("x")])  # type: ignore[attr-defined]
            assert router.choose(new, workers()) == want, (model.curve, first)


@pytest.mark.parametrize("policy", ["mask_aware", "mask_aware_marginal", "mask_aware_fetch", "mask_aware_unloaded"])
def test_pruned_choice_equals_evaluating_every_worker_with_a_curve(policy: str) -> None:
    rnd = random.Random(11)
    model = curved(small_model(fetch_bw=1e6), 3.0, 1.0, 3.0)
    router, brute = make_policy(policy, model), make_policy(policy, model)
    assert isinstance(router, MaskAwareRouter) and isinstance(brute, MaskAwareRouter)

    def jobs(k: int, prefix: str) -> list[JobLoad]:
        return [JobLoad(f"{prefix}{rnd.random()}", rnd.choice([1, 2, 5, 10, 20]), rnd.choice([0.02, 0.1, 0.3, 0.9]),
                        cached=rnd.random() > 0.2) for _ in range(k)]

    def worker(wid: str) -> WorkerState:
        mb = rnd.choice([2, 4, 8])
        return WorkerState(wid, running=jobs(rnd.randrange(mb + 1), "r"), waiting=jobs(rnd.randrange(3), "w"),
                           inflight=jobs(rnd.randrange(2), "i"), max_batch=mb)

    v = WorkerView(worker(str(k)) for k in range(12))
    for step in range(200):
        if step % 7 == 0:
            v = WorkerView(worker(w.worker_id) if rnd.random() < 0.5 else w for w in v.workers.values())
        d = JobDemand(f"new{step}", rnd.choice([10, 20]), rnd.choice([0.02, 0.1, 0.3]))
        mine = JobLoad.from_demand(d)
        order = brute._rot.order(v.candidates())
        expected = min(order, key=lambda w: (brute.cost(mine, w, 0.0), w.n_jobs)).worker_id
        assert router.choose(d, v) == expected, step
        v.assign(expected, d)


def test_linear_model_files_have_no_curve_and_keep_the_linear_step() -> None:
    for path in sorted((ROOT / "ops/sim/costmodels").glob("*--*.json")):
        if path.name.endswith(".points.json"):
            continue
        model = CostModel.load(path)
        assert model.curve is None and model.step_function() is None, path.name
        assert "curve" not in model.to_dict()
        assert model.step_seconds([0.01, 0.02]) == model.intercept + 0.03
    model = small_model()
    running, queued = [(0.002, 5), (0.003, 9)], [(0.001, 4), (0.004, 12)]
    t, alive = admission_profile(running, queued, 2, model.intercept)
    assert (t, alive) == admission_profile(running, queued, 2, model.intercept, model.step_function())


def test_the_curve_survives_the_json_round_trip_and_rejects_nonsense(tmp_path: Path) -> None:
    model = curved(small_model(), 4.0, 1.0, 3.13)
    path = model.save(tmp_path / "m--gpu.json")
    data = json.loads(path.read_text())
    assert data["curve"]["p"] == 3.13
    back = CostModel.load(path)
    assert back.curve == model.curve
    assert back.step_seconds([0.01]) == pytest.approx(model.step_seconds([0.01]))
    with pytest.raises(ValueError, match="step curve"):
        StepCurve(0.03, 0.0057, 0.5)


def test_the_marginal_variant_charges_the_curve_delay_to_the_batch_mates() -> None:
    """Two running jobs (5 and 10 steps left) and a new one of 10 steps, room for all: the others' extra
    time is 5 steps x 2 jobs x (t(3) - t(2)) + 5 steps x 1 job x (t(2) - t(1)), in full jobs' work."""
    model = curved(small_model(), 4.0, 1.0, 3.0)
    g = model.job_step_seconds(None)
    plain, marginal = make_policy("mask_aware", model), make_policy("mask_aware_marginal", model)
    w = WorkerState("w", running=[JobLoad("a", 5, cached=False), JobLoad("b", 10, cached=False)])
    mine = JobLoad("n", 10, cached=False)
    t = lambda jobs: roofline(4 * g, g, 3.0, jobs)  # noqa: E731
    extra = 5 * 2 * (t(3) - t(2)) + 5 * 1 * (t(2) - t(1))
    assert marginal.cost(mine, w, 0.0) - plain.cost(mine, w, 0.0) == pytest.approx(extra, rel=1e-9)
    assert plain.cost(mine, w, 0.0) == pytest.approx(5 * t(3) + 5 * t(2))
