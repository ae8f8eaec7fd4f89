"""Fidelity policies (app/fidelity.py) and what they promise on the trained default model.

The model-level checks run the engine's own runner in process on the trained SD model at the
client's default guidance (7.5), against full compute of the same job: the default policy is
faithful where the old path (the template's cache as is) was not, and the default seed is not a
worse path than any other seed. They can fail: ``cache-as-is`` is asserted to be far off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.fidelity import POLICIES, REFRESHES, check_policy, expected_ssim, policy_schedule, refresh_schedule
from app.jobs import JobParams
from app.maskgen import make_mask


@pytest.mark.parametrize("steps", [1, 2, 5, 10, 20, 37, 50])
@pytest.mark.parametrize("refreshes", [1, 2, 3, 4])
def test_refresh_schedule_starts_at_zero_and_stays_in_range(refreshes: int, steps: int) -> None:
    sched = refresh_schedule(refreshes, steps)
    assert sched[0] == 0 and sched == sorted(set(sched))
    assert all(0 <= s < steps for s in sched)
    assert len(sched) == min(refreshes, steps) or steps < 2 * refreshes  # collisions only on tiny schedules
    if refreshes > 1 and steps >= 10:
        assert sched[-1] >= int(0.8 * steps)  # late steps decide detail: the last refresh is late


def test_policies_and_their_schedules() -> None:
    assert policy_schedule("exact", 20) == [] and refresh_schedule(0, 20) == []
    assert len(policy_schedule("balanced", 20)) == REFRESHES["balanced"] > len(policy_schedule("fast", 20))
    assert check_policy(" Balanced ") == "balanced" and check_policy("") == ""
    with pytest.raises(ValueError, match="fidelity must be one of"):
        check_policy("fastest")
    assert set(POLICIES) == {"exact", "balanced", "fast", "turbo"}
    assert JobParams(fidelity="nope").validate(200) is not None
    assert JobParams(fidelity="fast").validate(200) is None


def test_expected_ssim_reads_the_benchmark_table(tmp_path: Path) -> None:
    """The shipped table (``ops.bench.fidelity --write-expected``) covers the embedded trained
    models under the identity a worker serving them reports (``model_identity``: their weights,
    wherever a host keeps them)."""
    import shutil

    from app.settings import Settings
    from workers.models.loader import ensure_model_dir, model_identity

    for name in ("tiny-sd-inpaint-trained", "tiny-flux-fill-trained"):
        folder = ensure_model_dir(Settings.from_env(home=tmp_path / name, model_dir="", model_id=name))
        model = model_identity(shutil.copytree(folder, tmp_path / "copies" / name))
        for policy in ("fast", "balanced"):
            for g in (1.0, 3.0, 7.5):
                value = expected_ssim(model, policy, g)
                assert value is not None and 0.95 <= value <= 1.0, (model, policy, g, value)
    assert expected_ssim("no-such-model", "balanced", 7.5) is None


@pytest.fixture(scope="module")
def sd_family(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from app.storage import LocalStore
    from ops.bench.harness.edits import Family
    from workers.maskaware.activation_store import ActivationStore

    return Family("sd", ActivationStore(LocalStore(tmp_path_factory.mktemp("fid"))))


def _template() -> Image.Image:
    from app.demo import demo_templates

    return demo_templates(128)[1][1]


def test_the_policies_are_faithful_at_guidance_7_5_where_the_cache_as_is_is_not(sd_family) -> None:  # type: ignore[no-untyped-def]
    from app.settings import Settings
    from ops.bench.harness.edits import OPTIONS, edit, metrics, warm

    assert Settings().fidelity == "fast"  # the default these numbers vouch for
    fam, image, steps, g = sd_family, _template(), 12, 7.5
    key = warm(fam, "tpl", image, np.zeros((128, 128), bool), JobParams(prompt="", seed=0, steps=steps, guidance=g))
    scores: dict[str, list[float]] = {"fast": [], "balanced": [], "cache-as-is": []}
    for k, (ratio, prompt, seed) in enumerate([(0.1, "a cat", 11), (0.3, "the moon", 12)]):
        mask = make_mask(ratio, (128, 128), "blob", seed=k)
        params = JobParams(prompt=prompt, seed=seed, steps=steps, guidance=g)
        tensors, meta = fam.prepare(image, mask, params)
        full = fam.full(tensors, meta)
        for name in scores:
            out = edit(fam, OPTIONS[name], image, mask, params, key)
            scores[name].append(metrics(full, fam.decode(out["latents"]), mask)["ssim"])
            if name in ("fast", "balanced"):
                assert out["refresh_steps"] == len(policy_schedule(name, steps))
    assert min(scores["balanced"]) >= 0.95 and min(scores["fast"]) >= 0.95, scores
    assert max(scores["cache-as-is"]) < 0.9, scores  # what the refresh steps fix


def test_the_default_seed_is_no_worse_than_other_seeds(sd_family) -> None:  # type: ignore[no-untyped-def]
    """Seed 0 (the client's default and the warm-up's) with another prompt than the warm-up's used
    to take the cache as is (16.6 dB): it now takes the same path as every seed."""
    from ops.bench.harness.edits import OPTIONS, edit, metrics, warm

    fam, image, steps, g = sd_family, _template(), 12, 7.5
    key = warm(fam, "tpl-seeds", image, np.zeros((128, 128), bool), JobParams(prompt="", seed=0, steps=steps,
                                                                               guidance=g))
    mask = make_mask(0.15, (128, 128), "rect", seed=5)
    ssim = {}
    for seed in (0, 1, 2, 3):
        params = JobParams(prompt="a rocket", seed=seed, steps=steps, guidance=g)
        tensors, meta = fam.prepare(image, mask, params)
        full = fam.full(tensors, meta)
        out = edit(fam, OPTIONS["fast"], image, mask, params, key)
        ssim[seed] = metrics(full, fam.decode(out["latents"]), mask)["ssim"]
    assert ssim[0] >= min(ssim[s] for s in (1, 2, 3)) - 0.005, ssim
    assert ssim[0] >= 0.95, ssim


def test_a_refresh_whose_template_step_is_not_resident_computes_fully_until_it_is(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The offset needs the template's cache of the refresh step. While that step is not resident
    the job may not use the cache with a stale or missing offset: its steps compute fully (counted
    as fallback), so the result is full compute; once the step arrives, the offset is set."""
    import torch

    from app.storage import LocalStore
    from ops.bench.harness.edits import Family, warm
    from ops.bench.harness.engine import run
    from workers.engine.template_cache import StepCacheProvider
    from workers.maskaware.activation_store import ActivationStore

    class Hiding(StepCacheProvider):
        hidden: set[int] = set()

        def ready(self, key, step, fetch=True):  # type: ignore[no-untyped-def]
            return None if step in self.hidden else super().ready(key, step, fetch)

    activations = ActivationStore(LocalStore(tmp_path))
    fam = Family("sd", activations)
    fam.runner_ma.caches = Hiding(activations, 1 << 30)
    fam.runner_ma.caches.set_units({u: fam.ctrl.unit_tensor_names(u) for u in fam.ctrl.units})
    image, steps = _template(), 8
    key = warm(fam, "tpl", image, np.zeros((128, 128), bool), JobParams(prompt="", seed=0, steps=steps, guidance=7.5))
    mask = make_mask(0.2, (128, 128), "blob", seed=1)
    params = JobParams(prompt="a cat", seed=4, steps=steps, guidance=7.5)
    tensors, meta = fam.prepare(image, mask, params)
    full = run(fam.runner_full, [(tensors, dict(meta))])[0]["latents"]
    masked_meta = dict(meta, cache_mode="masked", cache_key=key.to_dict(), refresh_steps=[0, 5])
    Hiding.hidden = {0, 5}
    out = run(fam.runner_ma, [(tensors, dict(masked_meta))])[0]
    assert out["refresh_steps"] == 2 and out["masked_steps"] == 0 and out["fallback_steps"] == steps - 2
    assert torch.allclose(out["latents"], full, atol=1e-4)
    Hiding.hidden = {5}  # step 0 arrives: steps 1-4 use the offset, 6-7 compute fully again
    out = run(fam.runner_ma, [(tensors, dict(masked_meta))])[0]
    assert out["masked_steps"] == 4 and out["fallback_steps"] == 2, out
    assert not torch.allclose(out["latents"], full, atol=1e-4)
