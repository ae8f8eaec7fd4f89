"""Template caches that store n steps of their schedule (STENCIL_CACHE_STEPS): which steps, how the
provider serves every step from its segment's stored step, the keys that say so, that exact-region
caches keep every step, and that the default is the measured one (docs/bench/cache_steps.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.settings import AUTO_CACHE_STEPS, Settings
from app.storage.local import LocalStore
from tests.test_plan_engine import LATENT, _job, _run, _runner_setup
from workers.engine.template_cache import CacheRecorder, StepCacheProvider, serving_step, stored_steps
from workers.maskaware import ActivationStore, TemplateCacheKey

ROOT = Path(__file__).resolve().parents[1]


def _key(steps: int, layout: str) -> TemplateCacheKey:
    return TemplateCacheKey("m", "tpl", 64, 64, "ddim", steps, 1.0, "cfg2", layout)


@pytest.mark.parametrize("steps", [5, 6, 20, 49, 50])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_each_stored_step_is_the_middle_of_its_segment_and_serves_it(steps: int, n: int) -> None:
    stored = stored_steps(steps, n)
    assert len(stored) == n and stored == sorted(set(stored))
    served = [serving_step(s, stored, steps) for s in range(steps)]
    for m in stored:
        segment = [s for s in range(steps) if served[s] == m]
        assert segment == list(range(segment[0], segment[-1] + 1)), "a segment is contiguous"
        assert m == segment[len(segment) // 2], "its middle step is stored"
    assert max(len([s for s in served if s == m]) for m in stored) - \
        min(len([s for s in served if s == m]) for m in stored) <= 1, "segments are equal to a step"
    assert stored_steps(steps, 0) == list(range(steps)) == stored_steps(steps, steps)


def test_the_key_says_how_many_steps_and_exact_region_caches_keep_every_step() -> None:
    assert _key(20, "kv+y/noise-0/steps-3").stored_step_count == 3
    assert _key(20, "kv+y@bfloat16/noise-0/with-lora-x/steps-2").stored_step_count == 2
    assert _key(20, "kv+y/noise-0").stored_step_count == 0
    assert _key(3, "kv+y/noise-0/steps-3").stored_step_count == 0  # as many as the schedule: every step
    assert _key(20, "kv+y/exact-abc/steps-2").stored_step_count == 0  # exact: never fewer steps
    assert _key(20, "kv+y/noise-0/steps-3").digest() != _key(20, "kv+y/noise-0").digest()


def test_recorder_stores_n_steps_and_the_provider_serves_each_segment_from_its_stored_step(tmp_path: Path) -> None:
    acts = ActivationStore(LocalStore(tmp_path))
    rec = CacheRecorder(acts, codec="float32")
    steps, n = 10, 3
    every, fewer = _key(steps, "kv+y/noise-0"), _key(steps, f"kv+y/noise-0/steps-{n}")
    recorded = {s: {"blk.k": torch.full((2, 4, 3), float(s)), "blk.y": torch.randn(2, 4, 3)} for s in range(steps)}
    for key in (every, fewer):
        for s in range(steps):
            rec.put(key, s, recorded[s])
        rec.commit(key).result(30)
    manifest = acts.manifest(fewer)
    assert manifest["stored_steps"] == stored_steps(steps, n)
    assert sorted(int(s) for s in manifest["steps"]) == stored_steps(steps, n)  # nothing else written
    assert manifest["nbytes"] * steps == pytest.approx(acts.manifest(every)["nbytes"] * n, rel=0.02)
    assert "stored_steps" not in acts.manifest(every)
    provider = StepCacheProvider(acts, 1 << 30)
    try:
        for s in range(steps):
            got = provider.wait(fewer, s, 30)
            want = recorded[serving_step(s, stored_steps(steps, n), steps)]
            assert got is not None and all(torch.equal(got[name], want[name]) for name in want), f"step {s}"
            full = provider.wait(every, s, 30)
            assert full is not None and torch.equal(full["blk.k"], recorded[s]["blk.k"])
        # One host-tier entry per stored step: a segment shares one copy.
        assert len([slot for slot in provider.host.keys() if slot[0] == fewer.digest()]) == n
    finally:
        provider.close()
        rec.close()


def test_an_edit_from_an_n_step_cache_runs_every_step_mask_aware(tmp_path: Path) -> None:
    steps = 6
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "all")
    key = TemplateCacheKey("t", "tpl", LATENT[0] * 8, LATENT[1] * 8, "ddim", steps, 1.0, "cfg2",
                           f"{ctrl.cache_layout}/noise-0/steps-2")
    _run(runner, _job(runner, "record", key, steps))["commit"].result(timeout=60)
    assert sorted(int(s) for s in caches.activations.manifest(key)["steps"]) == stored_steps(steps, 2)
    out = _run(runner, _job(runner, "masked", key, steps, seed=4))
    assert out["masked_steps"] == steps and out["fallback_steps"] == 0
    assert torch.isfinite(out["latents"]).all()


def test_template_warm_ups_store_the_configured_steps_and_region_warm_ups_every_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from app.jobs import JobParams
    from workers import context as ctx
    from workers.cpu_tasks import template_cache_key

    family = ["sd"]
    monkeypatch.setattr(ctx, "settings", lambda: Settings(cache_steps="2"))
    monkeypatch.setattr(ctx, "model_id", lambda: "m")
    monkeypatch.setattr(ctx, "model_family", lambda: family[0])
    monkeypatch.setattr(ctx, "scheduler_config", lambda: {"_class_name": "DDIMScheduler"})
    meta = {"height": 128, "width": 128, "do_cfg": True}
    params = JobParams(steps=20, template_id="tpl")
    assert template_cache_key(params, meta, 0).stored_step_count == 2
    assert template_cache_key(params, meta, region="abc").stored_step_count == 0
    assert template_cache_key(JobParams(steps=2, template_id="tpl"), meta, 0).stored_step_count == 0
    monkeypatch.setattr(ctx, "settings", lambda: Settings(cache_steps="0"))
    assert template_cache_key(params, meta, 0).stored_step_count == 0
    monkeypatch.setattr(ctx, "settings", lambda: Settings())  # auto: the family's measured default
    for family[0] in ("sd", "flux"):
        assert template_cache_key(params, meta, 0).stored_step_count == AUTO_CACHE_STEPS[family[0]]
    for bad in ("-1", "two", "2.5"):
        with pytest.raises(ValueError, match="STENCIL_CACHE_STEPS"):
            Settings(cache_steps=bad)
    monkeypatch.setenv("STENCIL_CACHE_STEPS", "3")
    assert Settings.from_env().cache_steps_for("flux") == 3


def test_the_auto_defaults_are_the_fewest_measured_steps_within_the_fidelity_budget() -> None:
    measured = json.loads((ROOT / "docs/bench/cache_steps.json").read_text())
    assert not measured["quick"], "the committed measurement is a quick smoke run"
    assert measured["default"] == AUTO_CACHE_STEPS
    for family, default in AUTO_CACHE_STEPS.items():
        worst = {int(n): float(v) for n, v in measured["worst"][family].items()}
        if default:
            assert worst[default] <= measured["criterion"]
        assert all(worst[n] > measured["criterion"] for n in worst if default == 0 or n < default), \
            f"{family}: a smaller measured count also fits the budget"
