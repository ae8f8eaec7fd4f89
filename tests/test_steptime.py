"""The resolution-aware batch step-time predictor: features that know sizes, the SVR kept as JSON
and served with numpy (equal to scikit-learn's ``predict``), its use by the cost model, the
scheduler's vectorized deadline check (same decisions as the general one)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from app.costmodel import CostModel, UNetArch, min_service_seconds, step_time_predictor
from app.steptime import BatchPredictor, FeatureSpec, JobShape, SVRModel, fit, sklearn_predict
from workers.engine.job import EngineJob
from workers.engine.scheduler import BatchScheduler

SIZES = ((16, 16), (16, 12), (12, 16), (8, 16))  # latent grids of 128x128, 96x128 (WxH), 128x96, 128x64


def test_features_count_jobs_per_size_calls_and_tokens_per_level() -> None:
    spec = FeatureSpec(2, SIZES)
    names = spec.names()
    full = JobShape((16, 16), None, 2)
    masked = JobShape((8, 16), (20, 8), 2)
    f = dict(zip(names, spec.features([full, masked, full])))
    assert f["jobs"] == 3 and f["calls"] == 2 and f["rows"] == 6 and f["masked_jobs"] == 1
    assert f["jobs_16x16"] == 2 and f["jobs_8x16"] == 1 and f["jobs_16x12"] == 0
    assert f["full_l0"] == pytest.approx((2 * 2 * 256 + 2 * 128) / 1e3)  # rows x tokens, thousands
    assert f["computed_l0"] == pytest.approx((2 * 2 * 256 + 2 * 20) / 1e3)
    assert f["full_l1"] == pytest.approx((2 * 2 * 64 + 2 * 32) / 1e3)  # level 1: ceil halving
    assert f["attn_l1"] == pytest.approx((2 * 2 * 64 * 64 + 2 * 8 * 32) / 1e6)
    # A mask covering everything is full compute; an unknown size still counts by its tokens.
    assert spec.features([JobShape((8, 16), (128, 32), 2)]) == spec.features([JobShape((8, 16), None, 2)])
    other = dict(zip(names, spec.features([JobShape((10, 10), None, 1)])))
    assert other["full_l0"] == pytest.approx(0.1) and sum(other[f"jobs_{h}x{w}"] for h, w in SIZES) == 0


def _data(n: int = 120, seed: int = 0) -> tuple[FeatureSpec, list[list[JobShape]], np.ndarray]:
    """Synthetic batches with a nonlinear step time (per-call overhead, quadratic attention)."""
    rng = random.Random(seed)
    spec = FeatureSpec(2, SIZES)
    batches, ys = [], []
    for _ in range(n):
        jobs = []
        for _ in range(rng.randint(1, 8)):
            h, w = rng.choice(SIZES)
            tokens = None if rng.random() < 0.3 else (rng.randint(1, h * w), rng.randint(1, (h // 2) * (w // 2)))
            jobs.append(JobShape((h, w), tokens, 2))
        f = dict(zip(spec.names(), spec.features(jobs)))
        ys.append(0.004 + 0.002 * f["calls"] + 0.01 * f["full_l0"] + 0.02 * f["computed_l0"] + 0.3 * f["attn_l0"])
        batches.append(jobs)
    return spec, batches, np.array(ys)


@pytest.mark.parametrize(("kernel", "target"), [("rbf", "log"), ("rbf", "seconds"), ("linear", "seconds")])
def test_json_svr_predicts_what_scikit_learn_predicts(kernel: str, target: str) -> None:
    spec, batches, y = _data()
    x = np.array([spec.features(b) for b in batches])
    model, info = fit(x, y, kernels=(kernel,), targets=(target,), folds=3)
    assert info["kernel"] == kernel and info["target"] == target
    restored = SVRModel.from_dict(json.loads(json.dumps(model.to_dict())))  # plain JSON, no pickle
    scaler, svr = sklearn_predict(x, y, info)
    expected = svr.predict(scaler.transform(x))
    expected = np.exp(expected) if target == "log" else np.maximum(expected, 0.0)
    np.testing.assert_allclose(restored.predict(x), expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(restored.predict(x), model.predict(x), rtol=1e-12)


def test_fit_chooses_by_cross_validation_and_predicts_held_out_batches() -> None:
    spec, batches, y = _data(200)
    x = np.array([spec.features(b) for b in batches])
    model, info = fit(x[:150], y[:150])
    err = np.abs(model.predict(x[150:]) - y[150:]) / y[150:]
    assert info["cv_mape"] < 0.1 and float(err.mean()) < 0.1


def _cost_model() -> CostModel:
    cfg = {"block_out_channels": [32, 64], "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
           "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "layers_per_block": 1, "cross_attention_dim": 32,
           "in_channels": 9, "out_channels": 4}
    spec, batches, y = _data()
    svr, info = fit(np.array([spec.features(b) for b in batches]), y, kernels=("rbf",), targets=("log",), folds=3)
    arch = UNetArch.from_unet_config(cfg, (16, 16))
    return CostModel("m", "cpu", arch, 0.01, (0.0, 0.0, 0.0, 0.0, 0.001), batch=BatchPredictor(spec, svr, 8, info))


def test_cost_model_keeps_the_batch_predictor_in_its_json_and_uses_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _cost_model()
    path = model.save(tmp_path / "m.json")
    loaded = CostModel.load(path)
    assert loaded.batch is not None and json.loads(path.read_text())["batch"]["svr"]["kernel"] == "rbf"
    jobs = [EngineJob("a", 10, latent_hw=(16, 16)), EngineJob("b", 10, latent_hw=(8, 16), cached=True,
                                                                masked_tokens=(30, 10), mask_ratio=0.2)]
    shapes = [JobShape((16, 16), None, 2), JobShape((8, 16), (30, 10), 2)]
    predict = step_time_predictor(loaded)
    assert predict(jobs) == pytest.approx(model.batch.step_seconds(shapes), rel=1e-12)  # type: ignore[union-attr]
    # Many batches at once (SLO admission) = one at a time.
    sets = np.array([[1, 0], [0, 1], [1, 1]], dtype=bool)
    np.testing.assert_allclose(predict.predict_sets(jobs, sets),  # type: ignore[attr-defined]
                               [predict([jobs[0]]), predict([jobs[1]]), predict(jobs)], rtol=1e-12)
    # Standalone time at the job's own size: the predictor's; without a size: the linear model's.
    alone = min_service_seconds(loaded, 10, masked_tokens=(30, 10), cached=True, latent_hw=(8, 16))
    assert alone == pytest.approx(10 * predict([jobs[1]]), rel=1e-12)
    assert min_service_seconds(loaded, 10, cached=False) == pytest.approx(10 * (0.01 + 0.001))
    big, small = (min_service_seconds(loaded, 10, cached=False, latent_hw=hw) for hw in ((16, 16), (8, 16)))
    assert big > small


def test_vectorized_deadline_check_decides_as_the_general_one() -> None:
    model = _cost_model()
    fast = step_time_predictor(model)
    plain = lambda jobs: fast(jobs)  # noqa: E731  (no predict_sets: the general walk)
    rng = random.Random(3)
    for trial in range(30):
        now = 100.0
        jobs = []
        for i in range(rng.randint(1, 10)):
            h, w = rng.choice(SIZES)
            cached = rng.random() < 0.7
            j = EngineJob(f"j{i}", rng.randint(2, 12), latent_hw=(h, w), cached=cached,
                          masked_tokens=(rng.randint(1, h * w), rng.randint(1, h * w // 4)) if cached else None,
                          deadline=now + rng.uniform(0.05, 1.5) if rng.random() < 0.8 else None, arrival=float(i),
                          hard_deadline=rng.random() < 0.5)
            j.steps_done = rng.randint(0, j.total_steps - 1)
            jobs.append(j)
        running, waiting = jobs[: len(jobs) // 2], jobs[len(jobs) // 2:]
        outcomes = []
        for predictor in (fast, plain):
            s = BatchScheduler(6, step_time=predictor, clock=lambda: now)
            s.running = list(running)
            for j in waiting:
                s.add(j)
            _, admitted = s.schedule()
            outcomes.append(([j.job_id for j in admitted], [j.job_id for j in s.expired], s.refused))
            for j in jobs:  # undo what the scheduler did to the shared jobs
                j.future = type(j.future)()
                j.expired_reason = None
        assert outcomes[0] == outcomes[1], trial


def test_slo_admission_is_on_by_default_only_with_the_batch_predictor() -> None:
    from app.costmodel import slo_admission_on

    with_batch = _cost_model()
    linear = CostModel("m", "cpu", with_batch.arch, 0.01, (0.0,) * 5)
    assert slo_admission_on("auto", with_batch) and not slo_admission_on("auto", linear)
    assert slo_admission_on("1", linear) and slo_admission_on("on", with_batch)
    assert not slo_admission_on("off", with_batch) and not slo_admission_on("on", None)
    with pytest.raises(ValueError):
        slo_admission_on("sometimes", with_batch)


def test_slo_admission_tries_the_queue_a_chunk_at_a_time_not_whole() -> None:
    """Under a long queue a scheduling pass asks the predictor about the candidates it walks (in slack
    order, stopping at the first it can take), not about every waiting job at every admission: that
    made a pass cost as much as a step. The choice is the same as trying them all (test above)."""
    fast = step_time_predictor(_cost_model())
    asked: list[int] = []

    def predictor(jobs: Any) -> float:
        return fast(jobs)

    def counting(jobs: Any, sets: Any) -> Any:
        asked.append(len(sets))
        return fast.predict_sets(jobs, sets)  # type: ignore[attr-defined]

    predictor.predict_sets = counting  # type: ignore[attr-defined]
    now = 100.0
    s = BatchScheduler(8, step_time=predictor, clock=lambda: now)
    for i in range(300):
        s.add(EngineJob(f"j{i}", 10, latent_hw=SIZES[i % len(SIZES)], deadline=now + 1000.0 + 10.0 * i,
                        arrival=float(i)))
    _, admitted = s.schedule()
    assert [j.job_id for j in admitted] == [f"j{i}" for i in range(8)]  # slack order: the earliest deadlines
    assert sum(asked) < 300  # trying every candidate once would already ask 300 batches
