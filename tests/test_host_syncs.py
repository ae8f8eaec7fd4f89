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

from ops.bench.harness.dispatch import DispatchCounter, counting_forward
from tests.test_maskaware_unet import sdxl_style_unet
from tests.test_plan_engine import _job, _runner_setup, _warm
from workers.engine.staging import CacheStager
from workers.maskaware import MaskAwareUNet, RowGroup, TemplateCacheKey
from workers.maskaware.tokens import blob_mask
from workers.models.loader import TRAINED_DIR

OPS_BOUND = 1.10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trained_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel.from_pretrained(TRAINED_DIR / "tiny-sd-inpaint-trained", subfolder="unet").eval()


def _count(unet: torch.nn.Module, ctrl: MaskAwareUNet, groups: list[RowGroup], args: tuple,
           steady: bool = True) -> DispatchCounter:
    """Operators of one call; ``steady``: after a first call of the same composition (the
    controller's batch index, built on the host once per composition, is then memoized)."""
    if steady:
        with torch.no_grad(), ctrl.batch(groups):
            unet(*args)
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
    cold = _count(unet, ctrl, [RowGroup(2, "masked", token_mask=fresh, cache=stager.take("j", 1, recorded))], args,
                  steady=False)
    assert cold.syncs.get("aten.nonzero.default", 0) > 0


@pytest.mark.parametrize("model", ["trained", "sdxl_style"])
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5])
def test_steady_forward_with_masked_resnets_has_no_host_sync(model: str, ratio: float) -> None:
    """ResNets at the masked tokens too (``workers/maskaware/resnets.py``), two jobs of different
    masks at one staged buffer: their gathers are built on the host once per composition and read
    on the device, so a steady forward dispatches no sync operator (a first one, which builds them,
    does)."""
    unet = _trained_unet() if model == "trained" else sdxl_style_unet()
    ctrl = MaskAwareUNet(unet, resnets="masked")
    latent = (32, 32) if model == "trained" else (16, 16)
    g = torch.Generator().manual_seed(0)
    cfg = unet.config
    args = (torch.randn(4, 9, *latent, generator=g), torch.tensor([500] * 4),
            torch.randn(4, 7, cfg.cross_attention_dim, generator=g))
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record"), RowGroup(2, "record")]) as ctx:
        unet(*args)
    staged = CacheStager("cpu").take_batch([(f"j{j}", 0, ctx.recorded[j], None) for j in range(2)])
    masks = [ctrl.token_masks(blob_mask(latent[0] * 8, latent[1] * 8, ratio, seed=3 + j), latent).prepare("cpu")
             for j in range(2)]
    groups = [RowGroup(2, "masked", token_mask=m, cache=s) for m, s in zip(masks, staged)]
    cold = _count(unet, ctrl, groups, args, steady=False)
    steady = _count(unet, ctrl, groups, args)
    assert steady.syncs == {}, steady.syncs
    if ratio < 0.5:  # some level takes the masked path (at 0.5 every level computes whole)
        assert cold.syncs.get("aten.nonzero.default", 0) > 0


@pytest.mark.parametrize("read_late", [False, True])
def test_a_steady_engine_step_reads_the_device_once(tmp_path: Path, read_late: bool) -> None:
    """Four masked jobs of one template at different masks, their caches resident: one engine step
    (plan, staging, the UNet call, guidance, four scheduler updates, finiteness) has exactly one
    host read, not one per job (on a GPU, of the step before it: ``tests/test_deferred_read.py``),
    and its results equal those of the same jobs stepped alone."""
    steps = 5
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        runner.read_late = read_late  # as on a GPU: each step reads the one before (none before the first)
        batch = [_job(runner, "masked", key, steps, seed=10 + i) for i in range(4)]
        alone = [_job(runner, "masked", key, steps, seed=10 + i) for i in range(4)]
        counts = counted_steps(runner, batch, steps)
        runner.settle()
        for job in alone:
            while not job.finished:
                runner.step([job])
                job.steps_done += 1
        reads = [c.syncs.get("aten._local_scalar_dense.default", 0) for c in counts]
        assert all(set(c.syncs) <= {"aten._local_scalar_dense.default"} for c in counts), [c.syncs for c in counts]
        assert reads == ([0] + [1] * (steps - 1) if read_late else [1] * steps), reads
        for a, b in zip(batch, alone):
            assert runner.result(a)["masked_steps"] == steps
            assert float((a.state.latents - b.state.latents).abs().max()) <= 1e-4 * float(b.state.latents.abs().max())
    finally:
        caches.close(wait=True)


def test_the_work_around_the_model_adds_nothing_per_job(tmp_path: Path) -> None:
    """Guidance, finiteness, the UNet's inputs and the DDIM update are launched once per step for
    the whole batch: going from 4 to 8 masked jobs adds no operator outside the UNet call (not
    per-job guidance, checks, concatenations or scheduler updates)."""
    steps = 4
    unet, ctrl, runner, caches, store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9)
    try:
        key = TemplateCacheKey("t", "tpl", 128, 128, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps)
        outside = {}
        for jobs in (4, 8):
            batch = [_job(runner, "masked", key, steps, seed=30 + i) for i in range(jobs)]
            runner.step(batch)  # the composition's first step builds its indices
            for job in batch:
                job.steps_done += 1
            whole = DispatchCounter()
            with counting_forward(unet) as model, whole:
                runner.step(batch)
            outside[jobs] = whole.kernels - model.kernels
        assert outside[8] == outside[4], outside
    finally:
        caches.close(wait=True)


def counted_steps(runner, batch: list, steps: int) -> list[DispatchCounter]:  # type: ignore[no-untyped-def]
    """Step ``batch`` ``steps`` times, each step's operators counted."""
    counts = []
    for _ in range(steps):
        counter = DispatchCounter()
        with counter:
            runner.step(batch)
        counts.append(counter)
        for job in batch:
            job.steps_done += 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_steady_masked_flux_forward_has_no_host_sync_and_few_operators(dtype: torch.dtype) -> None:
    """The trained Flux Fill at its default (roped) cache layout: a prepared mask at ratio 0.2 and a
    staged cache (what the engine hands the model), zero sync operators, operators (views included)
    within 1.1x of the stock forward's. In half precision RoPE takes diffusers' real-table
    arithmetic rather than the complex multiply (it must round as the stock forward does)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from workers.maskaware.flux import MaskAwareFlux
    from workers.maskaware.flux import RowGroup as FluxGroup

    tr = FluxTransformer2DModel.from_pretrained(TRAINED_DIR / "tiny-flux-fill-trained", subfolder="transformer")
    tr = tr.to(dtype).eval()
    ctrl = MaskAwareFlux(tr)
    cfg, h, w = tr.config, 16, 16
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, h * w, cfg.in_channels, generator=g).to(dtype),
              encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=g).to(dtype),
              pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dtype),
              timestep=torch.tensor([0.5], dtype=dtype),
              img_ids=FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", dtype),
              txt_ids=torch.zeros(8, 3, dtype=dtype),
              guidance=torch.tensor([30.0]))
    with torch.no_grad():
        with ctrl.batch([FluxGroup(1, "record")]) as ctx:
            tr(**kw)
        cache = ctx.recorded[0]
        mask = ctrl.prepared(ctrl.token_mask(blob_mask(h * 16, w * 16, 0.2, seed=2)), "cpu")
        assert 0 < mask.m < h * w
        staged = CacheStager("cpu").take("j", 0, cache)  # as the engine hands a step its cache
        full, masked = DispatchCounter(), DispatchCounter()
        with full:  # the stock forward
            tr(**kw)
        with masked, ctrl.batch([FluxGroup(1, "masked", token_mask=mask, cache=staged)]):
            tr(**kw)
    assert masked.syncs == {} and full.syncs == {}, masked.syncs
    assert masked.total <= OPS_BOUND * full.total, (masked.total, full.total)
    assert masked.kernels <= OPS_BOUND * full.kernels, (masked.kernels, full.kernels)


def test_a_steady_flux_engine_step_reads_the_device_once(tmp_path: Path) -> None:
    """Three masked Flux jobs of one template: one read per engine step, as for the UNet."""
    from tests.support.flux_world import FluxWorld

    world = FluxWorld(tmp_path)
    runner, steps = world.runner(), world.steps
    try:
        _warm(runner, world.caches, world.key, steps, rec=world.job(runner, 9, **world.warm_meta("record")))
        batch = [world.job(runner, 20 + i, **world.warm_meta("masked")) for i in range(3)]
        for _ in range(steps):
            counter = DispatchCounter()
            with counter:
                runner.step(batch)
            assert counter.syncs == {"aten._local_scalar_dense.default": 1}, counter.syncs
            for j in batch:
                j.steps_done += 1
        assert all(runner.result(j)["masked_steps"] == steps for j in batch)
    finally:
        world.caches.close(wait=True)


def test_flux_jobs_of_mixed_sizes_step_and_are_admitted_without_reading_the_device(tmp_path: Path) -> None:
    """Two image sizes in one Flux step: still one read per step (the batch's token grid and its
    image ids come from the host, not from the jobs' ids on the device), and none at admission."""
    from tests.support.flux_world import FluxWorld

    world = FluxWorld(tmp_path)
    runner = world.runner()
    try:
        batch = [world.job(runner, 20)]
        world.size = (64, 96)
        batch.append(world.job(runner, 21))
        admission = DispatchCounter()
        with admission:
            grids = [runner.latent_hw(job.state) for job in batch]
        assert admission.syncs == {} and grids[0] != grids[1], (admission.syncs, grids)
        counts = [c.syncs for c in counted_steps(runner, batch, world.steps)]
        # The first step compares the batch's new rotary tables once (memoised per table shape).
        assert all(c == {"aten._local_scalar_dense.default": 1} for c in counts[1:]), counts
    finally:
        world.caches.close(wait=True)


def test_attention_on_the_meta_device_counts_as_the_one_fused_kernel_it_is_on_a_gpu() -> None:
    """True-size counts run on the meta device, where attention would decompose into a dozen
    operators; the counter counts it once (positional or keyword call) and keeps its shape."""
    from ops.bench.harness.dispatch import FUSED_ATTENTION

    q = torch.empty(2, 4, 8, 16, device="meta")
    k, v = torch.empty(2, 4, 32, 16, device="meta"), torch.empty(2, 4, 32, 24, device="meta")
    counter = DispatchCounter()
    with counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        again = torch.nn.functional.scaled_dot_product_attention(query=q, key=k, value=v)
    assert counter.ops == {FUSED_ATTENTION: 2} and counter.kernels == 2
    assert out.shape == again.shape == (2, 4, 8, 24) and out.device.type == "meta"
    plain = DispatchCounter()
    with plain:  # anything else on the meta device is counted operator by operator
        torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    assert FUSED_ATTENTION not in plain.ops and plain.kernels >= 2


def test_the_work_around_flux_adds_nothing_per_job() -> None:
    """Flux's step around the transformer (input rows, Euler update, finiteness) is launched once for
    the batch: from 2 to 4 masked jobs of the trained Flux Fill, no operator outside the call is added."""
    from app.demo import demo_templates
    from app.jobs import JobParams
    from app.maskgen import make_mask
    from ops.bench.harness.edits import Family
    from ops.bench.harness.engine import kernels_around_the_model, record

    fam = Family("flux")
    image = demo_templates(128)[0][1].resize((fam.size, fam.size))
    params = JobParams(prompt="a hat", seed=1, steps=3, guidance=30.0)
    tensors, meta = fam.prepare(image, make_mask(0.1, (fam.size, fam.size), "blob", seed=1), params)
    key = fam.key("t0", params, meta)
    record(fam.runner_ma, tensors, meta, key, resident_steps=3)
    jobs = [(tensors, dict(meta, cache_mode="masked", cache_key=key.to_dict()))]
    outside = {b: kernels_around_the_model(fam.runner_ma, fam.runner_ma.transformer, jobs, b, 3)[1] for b in (2, 4)}
    assert outside[4] == outside[2], outside
