"""The mask-aware step is device-bound: no host synchronisation in a steady step's model forward,
one read per engine step, and no more operators than full compute (within 10%).

Counted on the CPU with a ``TorchDispatchMode`` (``ops/bench/harness/dispatch.py``): an operator
that reads a device value on the host (``item``, ``nonzero``, boolean indexing, ...) is a stall on
a GPU, and the operator count is the kernel-launch count's proxy. The GPU itself is checked by
``tests/test_gpu.py`` under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from ops.bench.harness.dispatch import DispatchCounter
from tests.test_maskaware_unet import sdxl_style_unet
from tests.test_plan_engine import _job, _runner_setup
from workers.engine.staging import CacheStager
from workers.maskaware import MaskAwareUNet, RowGroup, TemplateCacheKey
from workers.maskaware.tokens import blob_mask
from workers.models.loader import TRAINED_DIR

OPS_BOUND = 1.10


@pytest.fixture(autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trained_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel.from_pretrained(TRAINED_DIR / "tiny-sd-inpaint-trained", subfolder="unet").eval()


def _count(unet: torch.nn.Module, ctrl: MaskAwareUNet, groups: list[RowGroup], args: tuple) -> DispatchCounter:
    counter = DispatchCounter()
    with torch.no_grad(), counter, ctrl.batch(groups):
        unet(*args)
    return counter


@pytest.mark.parametrize("model", ["trained", "sdxl_style"])
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5])
def test_steady_masked_forward_has_no_host_sync_and_few_operators(model: str, ratio: float) -> None:
    """One CFG job at a staged cache (what the engine hands the model): zero sync operators, and
    all operators and kernel-launching operators each within 1.1x of the same call in full."""
    unet = _trained_unet() if model == "trained" else sdxl_style_unet()
    ctrl = MaskAwareUNet(unet)
    latent = (32, 32) if model == "trained" else (16, 16)
    g = torch.Generator().manual_seed(0)
    cfg = unet.config
    args = (torch.randn(2, 9, *latent, generator=g), torch.tensor([500, 500]),
            torch.randn(2, 7, cfg.cross_attention_dim, generator=g))
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record")]) as ctx:
        unet(*args)
    recorded = ctx.recorded[0]
    assert recorded
    masks = ctrl.token_masks(blob_mask(latent[0] * 8, latent[1] * 8, ratio, seed=3), latent).prepare("cpu")
    assert 0 < masks.counts()[0] < masks.levels[0].numel()  # masked tokens computed, the rest from the cache
    stager = CacheStager("cpu")
    full = _count(unet, ctrl, [RowGroup(2, "full")], args)
    masked = _count(unet, ctrl, [RowGroup(2, "masked", token_mask=masks, cache=stager.take("j", 0, recorded))], args)
    assert masked.syncs == {}, masked.syncs
    assert full.syncs == {}
    assert masked.total <= OPS_BOUND * full.total, (masked.total, full.total)
    assert masked.kernels <= OPS_BOUND * full.kernels, (masked.kernels, full.kernels)
    # The counter sees syncs: building a mask's indices inside the step would be one.
    fresh = ctrl.token_masks(blob_mask(latent[0] * 8, latent[1] * 8, ratio, seed=4), latent)
    cold = _count(unet, ctrl, [RowGroup(2, "masked", token_mask=fresh, cache=stager.take("j", 1, recorded))], args)
    assert cold.syncs.get("aten.nonzero.default", 0) > 0


def test_a_steady_engine_step_reads_the_device_once(tmp_path: Path) -> None:
    """Four masked jobs of one template at different masks, their caches resident: one engine step
    (plan, staging, the UNet call, guidance, four scheduler updates, finiteness) has exactly one
    host read, not one per job, and its results equal those of the same jobs stepped alone."""
    steps = 5
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        rec = _job(runner, "record", key, steps)
        while not rec.finished:
            runner.step([rec])
            rec.steps_done += 1
        runner.result(rec)["commit"].result(timeout=60)
        for s in range(steps):
            assert caches.wait(key, s, timeout=30) is not None  # every step resident: a steady state
        batch = [_job(runner, "masked", key, steps, seed=10 + i) for i in range(4)]
        alone = [_job(runner, "masked", key, steps, seed=10 + i) for i in range(4)]
        counts = []
        for step in range(steps):
            counter = DispatchCounter()
            with counter:
                runner.step(batch)
            counts.append(counter)
            for job in batch:
                job.steps_done += 1
        for job in alone:
            while not job.finished:
                runner.step([job])
                job.steps_done += 1
        assert all(c.syncs == {"aten._local_scalar_dense.default": 1} for c in counts), [c.syncs for c in counts]
        for a, b in zip(batch, alone):
            assert runner.result(a)["masked_steps"] == steps
            assert float((a.state.latents - b.state.latents).abs().max()) <= 1e-4 * float(b.state.latents.abs().max())
    finally:
        caches.close(wait=True)
