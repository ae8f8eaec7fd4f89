"""GPU step costs measured on a card (``ops/sim/gpu_costs.py``): the data, the fitted curve, its
held-out error as the report states it, and the simulations' switch between measured and sourced."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ops.sim import gpu_costs

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(gpu_costs.COSTMODELS.glob("*--h200-bf16.json"))


def test_every_measured_cost_file_loads_with_its_provenance() -> None:
    assert {f.name for f in FILES} >= {"sd15-inpaint-512--h200-bf16.json", "sdxl-inpaint-1024--h200-bf16.json",
                                       "flux-fill-1024--h200-bf16.json"}
    for f in FILES:
        costs = gpu_costs.load(f)
        assert costs.data["device"] == {"gpu": "NVIDIA H200", "dtype": "bfloat16", "torch": "2.11",
                                        "diffusers": "0.42.1"}
        assert costs.data["provenance"]["harness"].startswith("python -m ops.bench.gpu_step --parts ")
        assert len(costs.data["one_job"]["ratios"]) == len(costs.data["one_job"]["speed"])
    with pytest.raises(ValueError, match="no batch curve"):
        gpu_costs.load(gpu_costs.COSTMODELS / "sdxl-inpaint-1024--h200-bf16.json").step_seconds(2)
    with pytest.raises(ValueError, match="not a stencil-gpu-costs"):
        gpu_costs.load(ROOT / "ops/sim/costmodels/tiny-sd-inpaint--cpu-1t.json")


def test_gpu_cost_files_stay_out_of_the_routing_models_folder() -> None:
    """The dispatcher loads every file of ``ops/sim/costmodels`` as a routing cost model at start:
    a file of another format there stops it."""
    from app.costmodel import SHIPPED_DIR, CostModel

    assert gpu_costs.COSTMODELS != SHIPPED_DIR
    for path in SHIPPED_DIR.glob("*--*.json"):
        if not path.name.endswith(".points.json"):
            CostModel.load(path)


def test_the_curve_reproduces_the_points_it_was_fitted_on_and_bends_as_measured() -> None:
    costs = gpu_costs.load()
    jobs, secs = costs.full_points
    assert jobs == [1, 2, 4, 8, 16] and secs[0] == pytest.approx(0.0297)
    errors = [abs(costs.step_seconds(j) - s) / s for j, s in zip(jobs, secs)]
    assert max(errors) < 0.03, errors
    # host-bound floor up to 4 jobs, about one job's device time per job past the knee
    assert costs.curve.floor_s == pytest.approx(0.030, abs=0.001)
    assert costs.curve.per_job_s == pytest.approx(0.0057, abs=0.0003)
    assert all(costs.step_seconds(a) < costs.step_seconds(b) for a, b in zip(jobs, jobs[1:]))


def test_a_roofline_is_recovered_from_its_own_points() -> None:
    truth = gpu_costs.Roofline(0.02, 0.004, 2.5)
    jobs = [1, 2, 3, 6, 12, 24]
    fitted = gpu_costs.fit_roofline(jobs, [truth(j) for j in jobs])
    assert max(abs(fitted(j) - truth(j)) / truth(j) for j in jobs) < 1e-3
    with pytest.raises(ValueError):
        gpu_costs.fit_roofline([1, 2], [0.03, 0.031])


def test_held_out_error_is_what_the_report_says_and_under_the_target() -> None:
    costs = gpu_costs.load()
    loo = costs.leave_one_out()
    assert len(loo) == 5 and costs.mape() == pytest.approx(float(np.mean(loo)))
    assert costs.mape() < 0.10  # issue 41's target for held-out GPU measurements
    # piecewise-linear interpolation (the sourced curve's form) does worse on the same points
    linear = gpu_costs.leave_one_out(*costs.full_points, fit=gpu_costs.piecewise_linear)
    assert float(np.mean(linear)) > costs.mape()
    report = json.loads((ROOT / "docs/bench/gpu_measured_costs.json").read_text())["fit"]
    assert report["loo_mape"] == pytest.approx(costs.mape(), abs=5e-4)
    assert report["loo_errors"] == pytest.approx(loo, abs=5e-4)
    assert report["piecewise_linear_loo_mape"] == pytest.approx(float(np.mean(linear)), abs=5e-4)
    # the linear cost model's form (intercept + per-job seconds) misses the knee: over 10%, the curve under
    line = gpu_costs.leave_one_out(*costs.full_points, fit=gpu_costs.straight_line)
    assert float(np.mean(line)) > 0.10 > costs.mape()
    assert report["straight_line_loo_mape"] == pytest.approx(float(np.mean(line)), abs=5e-4)


def test_host_bound_mask_aware_speed_is_interpolated_and_exact_at_the_measured_points() -> None:
    costs = gpu_costs.load()
    assert costs.mask_aware_speed(4) == pytest.approx(0.75)
    assert costs.mask_aware_speed(3) == pytest.approx((0.82 + 0.75) / 2)
    assert costs.mask_aware_speed(64) == pytest.approx(1.03)  # held at the last measured point
    assert gpu_costs.host_bound_factor(costs, 8, 1.0) == pytest.approx(1 / 0.86)
    assert gpu_costs.host_bound_factor(costs, 8, 0.0) == 1.0


def test_the_option_switches_the_simulations_gpu_curve() -> None:
    from app.costmodel import CostModel
    from app.steptime import JobShape
    from ops.bench.mixed_sizes import GPU_COSTS, TRANSFORMER_SHARE, gpu_step_seconds, sim_costs
    from ops.sim.mixed import ShapeJob

    cost = CostModel.load(ROOT / "ops/sim/costmodels/tiny-sd-inpaint-trained--cpu-1t-mixed.json")
    assert cost.batch is not None
    grid, small = cost.batch.latent_hw(128, 128), cost.batch.latent_hw(64, 128)
    full = ShapeJob(JobShape(grid, None, 2))
    tokens = dataclasses.replace(cost.arch, latent_hw=grid).tokens_from_ratio(0.2)[:cost.batch.spec.levels]
    masked = ShapeJob(JobShape(grid, tuple(int(t) for t in tokens), 2))
    other = ShapeJob(JobShape(small, None, 2))
    steps = {name: sim_costs(cost, name)["gpu-shaped"][0] for name in GPU_COSTS}
    measured = gpu_costs.load()
    # one full 512x512-equivalent job: the sourced A100 point, or the measured H200 curve at 1 job
    assert steps["sourced"]([full]) == pytest.approx(1 / 22.24)
    assert steps["measured"]([full]) == pytest.approx(measured.step_seconds(1))
    assert steps["measured-host-bound"]([full]) == pytest.approx(measured.step_seconds(1))
    # masked work: by its tokens (cheaper than full), or as the measured host-bound step ran (dearer)
    assert steps["measured"]([masked]) < steps["measured"]([full])
    assert steps["measured-host-bound"]([masked]) == pytest.approx(measured.step_seconds(1) / 0.86)
    # the sourced path prices a mixed-size step as before: packed transformer share, convolutions per size
    cpu = sim_costs(cost, "sourced")["cpu-fitted"][0]
    ref = cpu([full])
    w_full, w_other = 1.0, cpu([other]) / ref
    expected = (TRANSFORMER_SHARE * gpu_step_seconds(w_full + w_other)
                + (1 - TRANSFORMER_SHARE) * (gpu_step_seconds(w_full) + gpu_step_seconds(w_other)))
    assert steps["sourced"]([full, other]) == pytest.approx(expected)
    assert "H200" in sim_costs(cost, "measured")["gpu-shaped"][1]
