"""The dispatch simulator on measured GPU step costs (``ops/sim/gpu_dispatch.py``, ``simulate --gpu-costs``):
the step times are the fitted curve's, the router's linear model is close to it, bad names fail clearly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.costmodel import CostModel
from app.routing import make_policy
from ops.bench import simulate
from ops.sim import gpu_costs, gpu_dispatch
from ops.sim.bounds import pooled_batches, pooled_ps
from ops.sim.cluster import Cluster, ClusterConfig
from ops.sim.workload import SimJob

ROOT = Path(__file__).resolve().parents[1]
NAME = "sd15-inpaint-512--h200-bf16"
BASE = str(ROOT / "ops/sim/costmodels/sd15-arch--cpu-1t-projected.json")


def costs(masked_work: str = "tokens") -> gpu_dispatch.GpuDispatchCosts:
    return gpu_dispatch.load(NAME, BASE, masked_work, 8)


def test_unknown_or_unusable_cost_files_fail_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"unknown GPU cost file 'sd15-h100'.*sd15-inpaint-512--h200-bf16"):
        gpu_dispatch.cost_file("sd15-h100")
    with pytest.raises(ValueError, match="unknown GPU cost file"):
        gpu_dispatch.cost_file("../costmodels/sd-arch-320-640--cpu-1t")
    with pytest.raises(ValueError, match="no batch curve"):  # measured one job only
        gpu_dispatch.load("sdxl-inpaint-1024--h200-bf16", BASE, "tokens", 8)
    with pytest.raises(ValueError, match="masked work must be one of"):
        gpu_dispatch.load(NAME, BASE, "bytes", 8)
    with pytest.raises(SystemExit):
        simulate.main(["--gpu-costs", "nope", "--out", ""])
    assert "unknown GPU cost file 'nope'" in capsys.readouterr().err


def test_step_times_are_the_fitted_curve_at_the_measured_points() -> None:
    measured = gpu_costs.load(gpu_dispatch.cost_file(NAME))
    full = costs().probe(1.0, False)
    for jobs, seconds in zip(*measured.full_points):
        step = costs().step_cost([full] * int(jobs))
        assert step == pytest.approx(measured.step_seconds(jobs), rel=1e-12)
        assert abs(step - seconds) / seconds < 0.05  # the fit's in-sample error at that point
    # tokens: a masked job costs its share of a full job's work; host-bound: the step stretched by the
    # measured mask-aware speed at its job count (all masked at the measured ratio)
    masked = costs().probe(0.2, True)
    assert 0.3 < costs().job_work(masked) < 1.0
    assert costs().step_cost([masked] * 8) == pytest.approx(measured.step_seconds(8 * costs().job_work(masked)))
    host = costs("host-bound")
    speed = measured.data["mask_aware_speed"]
    for jobs, s in zip(speed["jobs"], speed["speed"]):
        assert host.step_cost([host.probe(0.2, True)] * jobs) == pytest.approx(measured.step_seconds(jobs) / s)


def test_the_routers_linear_model_follows_the_curve_and_is_a_cost_model() -> None:
    for variant in gpu_dispatch.MASKED_WORK:
        c = costs(variant)
        model = c.model
        assert isinstance(model, CostModel) and model.batch is None
        full = c.probe(1.0, False)
        for jobs in range(1, 9):
            predicted = model.intercept + jobs * model.job_seconds(mask_ratio=1.0, cached=False)
            truth = c.step_cost([full] * jobs)
            assert abs(predicted - truth) / truth < 0.12, (variant, jobs, predicted, truth)
        assert c.router_mape < 0.06
    tokens, host = costs().model, costs("host-bound").model
    assert tokens.job_seconds(mask_ratio=0.1) < tokens.job_seconds(mask_ratio=0.6) < tokens.job_seconds(cached=False)
    # host-bound: the measured mask-aware step is slower than the full one, and the router knows it
    assert host.job_seconds(mask_ratio=0.1) > host.job_seconds(cached=False)


def test_a_simulation_runs_on_the_curve_and_routes_with_its_fit() -> None:
    case = dict(cost_model=BASE, gpu_costs=NAME, masked_work="tokens", steps=10, max_batch=8, slo_factor=2.0,
                uncached_fraction=0.05, noise=0.0, host_templates=32, prepare_s=0.0, view_refresh_s=0.0, seed=0,
                trace="spring_festival", workers=2, load=0.9, policy="mask_aware", slo_admission=True, jobs=120)
    out = simulate.run_case(case)
    c = costs()
    assert out["capacity_jobs_s"] == pytest.approx(c.capacity("spring_festival", 2, 10, 0.05, 0))
    s = out["stats"]
    assert s["completed"] + s["expired"] == s["jobs"] and s["p95_s"] >= s["floor_p95_s"] > 0
    # one job alone on an idle worker takes steps x the curve's one-job step (about 30 ms on the H200)
    assert s["floor_p95_s"] == pytest.approx(10 * c.step_cost([c.probe(1.0, False)]), rel=0.01)
    ideal = simulate.run_case(dict(case, policy="ideal_pooled", slo_admission=False))
    assert ideal["stats"]["p95_s"] <= s["p95_s"]


def test_a_job_whose_template_is_still_fetching_is_priced_as_full_compute() -> None:
    c = costs()
    seen: list[list[bool]] = []

    def step_cost(batch: list) -> float:  # type: ignore[type-arg]
        seen.append([j.cached for j in batch])
        return c.step_cost(batch)

    job = SimJob(index=0, arrival=0.0, ratio=0.1, steps=3, cached=True, template_id="t0",
                 masked_tokens=c.model.arch.tokens_from_ratio(0.1), deadline=math.inf, alone_s=0.1)
    for fetch_aware, first in ((True, False), (False, True)):
        seen.clear()
        cfg = ClusterConfig(workers=1, noise=0.0, step_cost=step_cost, step_cost_fetch=fetch_aware)
        Cluster(c.model, cfg, make_policy("least_requests")).run([SimJob(**{**job.__dict__, "extra": {}})])
        assert seen[0] == [first]  # the first step starts before the template's fetch lands
        assert len(seen) == 3


def test_pooled_batches_is_processor_sharing_for_a_linear_curve_and_equal_jobs() -> None:
    jobs = [SimJob(index=i, arrival=0.05 * i, ratio=0.5, steps=10, cached=True, template_id="t",
                   masked_tokens=(1,), deadline=math.inf, alone_s=1.0) for i in range(40)]
    linear = pooled_batches(jobs, 3, 8, lambda active, workers: 0.1 * len(active) / workers)
    ps = pooled_ps(jobs, 3, 8)
    assert linear == pytest.approx(ps)
    # a batch curve flat up to the max batch: the pool finishes every job in its time alone
    flat = pooled_batches(jobs, 3, 8, lambda active, workers: 0.1)
    assert all(flat[j.index] == pytest.approx(j.arrival + 1.0) for j in jobs)


def test_the_tokens_router_prices_steps_on_the_files_curve_and_host_bound_stays_linear() -> None:
    c = costs()
    curve, fitted = c.model.curve, c.curve
    assert curve is not None
    assert (curve.floor_s, curve.per_job_s, curve.knee) == (fitted.floor_s, fitted.per_job_s, fitted.knee)
    # the router's step of a single-size batch is the truth's: its work in full jobs on the curve
    for ratios in ([1.0], [0.2] * 4, [0.05, 0.3, 0.6, 1.0, 0.2, 0.1, 0.4, 1.0]):
        probes = [c.probe(r, r < 1.0) for r in ratios]
        believed = c.model.step_seconds(c.model.job_seconds(mask_ratio=p.mask_ratio, masked_tokens=p.masked_tokens,
                                                            cached=p.cached) for p in probes)
        assert believed == pytest.approx(c.step_cost(probes), rel=1e-9)
    assert gpu_dispatch.load(NAME, BASE, "tokens", 8, "linear").model.curve is None
    assert costs("host-bound").model.curve is None  # its truth is not a function of work alone
    with pytest.raises(ValueError, match="host-bound step is not a function of work"):
        gpu_dispatch.load(NAME, BASE, "host-bound", 8, "curve")
    with pytest.raises(ValueError, match="router step must be one of"):
        gpu_dispatch.load(NAME, BASE, "tokens", 8, "cubic")
