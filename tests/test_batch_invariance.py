"""Batch invariance in half precision (STENCIL_BATCH_INVARIANT, ``workers/adapters/layout.py``): a
job's result does not depend on the jobs it was batched with, or on its place in the batch. GEMM
kernels sum a row differently with the number of rows in the product and the row's place in its
tiles (oneDNN's AMX bf16 kernels on this CPU); in float32 that last bit never reaches a pixel, in
bfloat16 a few Flux steps amplify it to several /255. The engine therefore multiplies each job's
rows on their own in half precision: every job of a batch must equal the same job run alone, bit
for bit, and so equal the stock pipeline, which computes one job."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.jobs import JobParams
from app.maskgen import make_mask
from app.settings import Settings
from tests.support.loras import save_sd_lora
from tests.support.pipes import sd_pipe
from tests.test_bf16_addons import _pil
from tests.test_lora_engine import FLUX_DIR, SD_DIR, SIZE, World, _image, run_engine
from workers.adapters import layout
from workers.adapters.bank import AdapterBank
from workers.adapters.patcher import LoraLinear, LoraPatcher, install
from workers.models.loader import scheduler_config

BF16 = torch.bfloat16
PROMPTS = ["a cat", "grass", "the moon"]
SETS = [(("a", 0.9),), (("a", 0.4), ("b", 1.0)), ()]  # a mixed batch, as production sends them
ORDERS = ([0, 1], [1, 0], [0, 2], [2, 0], [1, 2], [2, 1], [0, 1, 2], [2, 1, 0])
# SD jobs at 64 px: the UNet and VAE in bf16 cost several times fp32 on a CPU without bf16
# instructions, even with channels-last convolutions (tests/support/pipes.py).
SD_SIZE = 64


def _jobs(steps: int, guidance: float, size: int) -> list[tuple]:
    return [(_image(20 + i), make_mask(0.3, (size, size), "blob", seed=i),
             JobParams(prompt=p, steps=steps, guidance=guidance, seed=i, loras=s))
            for i, (p, s) in enumerate(zip(PROMPTS, SETS))]


def _meta(meta: dict, params: JobParams) -> dict:
    return dict(meta, loras=[[i, s] for i, s in params.loras], cache_mode="full")


def _assert_invariant(make_runner, prepared: list[tuple[dict, dict]],  # type: ignore[no-untyped-def]
                      orders: tuple[list[int], ...] = ORDERS) -> None:
    """Each job batched with others (by default every pair in both orders, all three in two orders)
    equals the job alone, bit for bit. What plain batched GEMMs give instead is measured, not tested:
    it depends on the kernels (``ops/bench/batch_invariance.py``; without this, the Flux case fails
    on a CPU with AMX)."""
    alone = [run_engine(make_runner(), [p])[0][0]["latents"] for p in prepared]
    for order in orders:
        results, engine = run_engine(make_runner(), [prepared[i] for i in order])
        assert any(len(rec.job_ids) == len(order) for rec in engine.stats.history), "the jobs were not batched"
        for i, out in zip(order, results):
            assert torch.equal(out["latents"], alone[i]), \
                f"job {i} batched (order {order}) differs from the job alone by " \
                f"{(out['latents'].float() - alone[i].float()).abs().max().item()}"


def _prepared(prepare, steps: int, guidance: float, size: int = SIZE) -> list[tuple[dict, dict]]:  # type: ignore[no-untyped-def]
    """The jobs' tensors as the CPU task prepares them (``prepare(image, mask, params)``)."""
    out = []
    for img, mask, params in _jobs(steps, guidance, size):
        prep = prepare(img, _pil(mask), params)
        out.append((prep.tensors, _meta(prep.meta, params)))
    return out


def _runner(cls, model, component: str, world: World, *args, maskaware):  # type: ignore[no-untyped-def]
    """An engine runner as a worker builds it in bf16: adapters and mask-aware hooks, default settings."""
    bank = AdapterBank(world.read, 1 << 30)
    runner = cls(model, *args, maskaware=maskaware, lora=LoraPatcher(model, component, bank.get), adapters=bank)
    assert runner.batch_invariant  # the default in half precision
    return runner


def test_bf16_flux_jobs_batched_equal_the_jobs_alone(tmp_path: Path) -> None:
    from diffusers import FluxFillPipeline

    from tests.support.loras import save_flux_lora
    from workers.engine.flux_runner import FluxRunner
    from workers.flux_inputs import prepare_flux_job_tensors
    from workers.maskaware.flux import MaskAwareFlux

    maker = FluxFillPipeline.from_pretrained(FLUX_DIR, dtype=torch.float32)
    world = World({"a": save_flux_lora(maker, tmp_path / "a", rank=4, seed=3),
                   "b": save_flux_lora(maker, tmp_path / "b", rank=8, seed=4)}, FLUX_DIR)
    pipe = FluxFillPipeline.from_pretrained(FLUX_DIR, dtype=BF16)

    def make_runner() -> FluxRunner:
        model = copy.deepcopy(pipe.transformer).eval()
        return _runner(FluxRunner, model, "transformer", world, scheduler_config(FLUX_DIR), pipe.vae_scale_factor,
                       maskaware=MaskAwareFlux(model))

    prepared = _prepared(lambda img, mask, params: prepare_flux_job_tensors(
        pipe, scheduler_config(FLUX_DIR), img, mask, params, SIZE, SIZE), steps=5, guidance=30.0)
    _assert_invariant(make_runner, prepared)


def test_bf16_sd_jobs_batched_equal_the_jobs_alone(tmp_path: Path) -> None:
    from workers.engine.sd_runner import SDRunner
    from workers.maskaware.unet import MaskAwareUNet
    from workers.sd_inputs import prepare_job_tensors

    maker = sd_pipe(SD_DIR)
    world = World({"a": save_sd_lora(maker, tmp_path / "a", rank=4, seed=1),
                   "b": save_sd_lora(maker, tmp_path / "b", rank=8, seed=2, alpha=16)}, SD_DIR)
    cpu = sd_pipe(SD_DIR, BF16)

    def make_runner() -> SDRunner:
        unet = copy.deepcopy(cpu.unet).eval()
        return _runner(SDRunner, unet, "unet", world, scheduler_config(SD_DIR), maskaware=MaskAwareUNet(unet))

    prepared = _prepared(lambda img, mask, params: prepare_job_tensors(
        cpu, scheduler_config(SD_DIR), img, mask, params, SD_SIZE, SD_SIZE), steps=3, guidance=7.5, size=SD_SIZE)
    _assert_invariant(make_runner, prepared)


def test_job_by_job_linear_gathers_a_jobs_spans_in_layout_order() -> None:
    """A token pack whose jobs' rows are interleaved (the single Flux blocks' pack: every job's
    text, then every job's image tokens): each job's output rows are the product of its own rows,
    concatenated in layout order, as the stock block computes them for that job alone."""
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(640, 128).to(BF16)
    install(torch.nn.Sequential(lin))
    assert isinstance(lin, LoraLinear)
    text = [torch.randn(5, 640, generator=gen).to(BF16) for _ in range(2)]
    image = [torch.randn(n, 640, generator=gen).to(BF16) for n in (90, 37)]
    pack = torch.cat([text[0], text[1], image[0], image[1]])
    lay = layout.flat([(0, 5), (1, 5), (0, 90), (1, 37)])
    layout.set_invariant(True)
    try:
        with layout.use(lay), torch.no_grad():
            out = lin(pack)
    finally:
        layout.set_invariant(False)
    with torch.no_grad():
        own = [F.linear(torch.cat([text[j], image[j]]), lin.weight, lin.bias) for j in (0, 1)]
    assert torch.equal(out[:5], own[0][:5]) and torch.equal(out[10:100], own[0][5:])
    assert torch.equal(out[5:10], own[1][:5]) and torch.equal(out[100:], own[1][5:])
    with torch.no_grad():  # the flag is per step: outside it the module is one product again
        assert torch.equal(lin(pack), F.linear(pack, lin.weight, lin.bias))


@pytest.mark.parametrize(("mode", "dtype", "device", "expected"), [
    ("auto", "bfloat16", "cpu", True), ("auto", "float16", "cpu", True), ("auto", "float32", "cpu", False),
    ("auto", "bfloat16", "cuda", False), ("auto", "bfloat16", "cuda:1", False), ("on", "bfloat16", "cuda", True),
    ("on", "float32", "cpu", True), ("off", "bfloat16", "cpu", False)])
def test_batch_invariance_setting(mode: str, dtype: str, device: str, expected: bool) -> None:
    assert Settings(batch_invariant=mode).batch_invariant_for(dtype, device) is expected


def test_batch_invariance_setting_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="STENCIL_BATCH_INVARIANT"):
        Settings(batch_invariant="sometimes")
