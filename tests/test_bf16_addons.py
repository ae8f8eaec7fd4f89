"""Add-ons and mixed sizes in bfloat16 (STENCIL_DTYPE=bfloat16), against diffusers' own paths in
the same dtype and seed, within 2/255 (the bf16 exactness budget of ``test_bf16_exactness``):
a batch mixing LoRA adapter sets (``load_lora_weights`` + ``set_adapters``), a batch mixing
ControlNets (``StableDiffusionControlNetInpaintPipeline``), and a batch mixing image sizes and
aspect ratios (the stock pipeline at each job's own size). The fp32 versions of these checks
(1/255) are ``test_lora_engine``, ``test_controlnet_engine`` and ``test_mixed_sizes``."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from tests.support.controlnets import save_controlnet
from tests.support.loras import save_sd_lora
from tests.support.pipes import controlnet_call, cpu_bf16_convs, sd_pipe
from tests.test_controlnet_engine import _control
from tests.test_lora_engine import SD_DIR, SIZE, World, _image, run_engine
from tests.test_mixed_sizes import _image as _sized_image
from tests.test_mixed_sizes import _mask as _sized_mask
from workers.models.loader import scheduler_config

log = logging.getLogger(__name__)
BF16 = torch.bfloat16
TOL = 2  # of 255
# SD jobs here are 64 px (the fp32 checks run 128 px): without bf16 instructions (AVX2) a 128 px
# step of this UNet takes 14x and a VAE decode 56x (3 s) as long in bf16 as in fp32; rows, adapters
# and residuals are per job whatever the size. The Flux test keeps 128 px: its token count is what once
# tripped AMX's batch-dependent bf16 GEMMs (tests/test_batch_invariance.py).
SD_SIZE = 64


def _pil(mask: np.ndarray) -> Image.Image:
    return Image.fromarray(mask.astype(np.uint8) * 255)


def _decode(cpu, latents: torch.Tensor) -> np.ndarray:  # type: ignore[no-untyped-def]
    from workers.sd_inputs import decode_latents

    assert latents.dtype == BF16
    return np.asarray(decode_latents(cpu, latents), dtype=np.int16)


def _stock(pipe, image: Image.Image, mask: Image.Image, params: JobParams, w: int = SIZE, h: int = SIZE,  # type: ignore[no-untyped-def]
           **kw: object) -> np.ndarray:
    out = pipe(prompt=params.prompt, image=image, mask_image=mask, num_inference_steps=params.steps,
               guidance_scale=params.guidance, height=h, width=w,
               generator=torch.Generator("cpu").manual_seed(params.seed), **kw).images[0]
    return np.asarray(out, dtype=np.int16)


def _check(label: str, ours: np.ndarray, stock: np.ndarray) -> None:
    diff = int(np.abs(ours - stock).max())
    log.info("bf16 %s: max pixel diff %d", label, diff)
    assert diff <= TOL, f"{label}: max pixel diff {diff}/255 vs diffusers' own path in bf16"


def test_bf16_mixed_adapter_batch_equals_diffusers_lora_in_bf16(tmp_path: Path) -> None:
    from workers.adapters.bank import AdapterBank
    from workers.adapters.patcher import LoraPatcher
    from workers.engine.sd_runner import SDRunner
    from workers.sd_inputs import prepare_job_tensors

    files = {"a": save_sd_lora(sd_pipe(SD_DIR), tmp_path / "a", rank=4, seed=1),
             "b": save_sd_lora(sd_pipe(SD_DIR), tmp_path / "b", rank=8, seed=2, text_encoder=True, alpha=16)}
    world = World(files, SD_DIR)
    cpu = sd_pipe(SD_DIR, BF16)  # the CPU worker in bf16 (text encoder adapters merged there)
    te = LoraPatcher(cpu.text_encoder, "text_encoder", world.weights.__getitem__)
    unet = copy.deepcopy(cpu.unet).eval()
    bank = AdapterBank(world.read, budget_bytes=1 << 30)
    lora = LoraPatcher(unet, "unet", bank.get)
    runner = SDRunner(unet, scheduler_config(SD_DIR), lora=lora, adapters=bank)
    sets = [(("a", 0.8),), (("a", 0.5), ("b", 1.0)), (), (("b", 0.7),)]
    jobs = [(_image(i), make_mask(0.25, (SD_SIZE, SD_SIZE), "blob", seed=i),
             JobParams(prompt=p, steps=6, guidance=7.5, seed=10 + i, loras=s))
            for i, (p, s) in enumerate(zip(["a cat", "grass", "the moon", "a rocket"], sets))]
    prepared = []
    for img, mask, params in jobs:
        te.apply(tuple((i, s) for i, s in params.loras if world.weights[i].modules("text_encoder")))
        prep = prepare_job_tensors(cpu, scheduler_config(SD_DIR), img, _pil(mask), params, SD_SIZE, SD_SIZE)
        assert prep.tensors["latents"].dtype == BF16
        prepared.append((prep.tensors, dict(prep.meta, loras=[[i, s] for i, s in params.loras], cache_mode="full")))
    te.apply(())
    results, engine = run_engine(runner, prepared)
    assert any(len(rec.job_ids) == 4 for rec in engine.stats.history)
    assert lora.stats.steps_terms > 0, "the mixed batch did not use per-row low-rank terms"
    for (img, mask, params), out in zip(jobs, results):
        pipe = sd_pipe(SD_DIR, BF16)
        if params.loras:
            for lora_id, _ in params.loras:
                pipe.load_lora_weights(str(files[lora_id].parent), adapter_name=lora_id)
            pipe.set_adapters([i for i, _ in params.loras], [s for _, s in params.loras])
        _check(f"LoRA {params.loras}", _decode(cpu, out["latents"]),
               _stock(pipe, img, _pil(mask), params, SD_SIZE, SD_SIZE))


def test_bf16_mixed_controlnet_batch_equals_diffusers_controlnet_in_bf16(tmp_path: Path) -> None:
    from diffusers import ControlNetModel

    from workers.controlnets.bank import ControlNetBank
    from workers.controlnets.inputs import prepare_control_images
    from workers.engine.sd_runner import SDRunner
    from workers.sd_inputs import prepare_job_tensors

    fp32_unet = sd_pipe(SD_DIR).unet
    nets = {"edges": save_controlnet(fp32_unet, tmp_path / "edges", seed=1),
            "depth": save_controlnet(fp32_unet, tmp_path / "depth", seed=2)}
    cpu = sd_pipe(SD_DIR, BF16)
    def load(i: str) -> ControlNetModel:
        net = ControlNetModel.from_pretrained(nets[i], dtype=BF16).eval()
        cpu_bf16_convs(net)  # as controlnet_call's (tests/support/pipes.py)
        return net

    bank = ControlNetBank(load, 1 << 30)
    runner = SDRunner(copy.deepcopy(cpu.unet).eval(), scheduler_config(SD_DIR), controlnets=bank)
    cases = [[("edges", _control(1), 0.8, 0.0, 1.0)],
             [("edges", _control(2), 1.0, 0.0, 0.6), ("depth", _control(3), 0.5, 0.2, 1.0)],
             []]
    jobs = [(_image(30 + i), make_mask(0.3, (SD_SIZE, SD_SIZE), "blob", seed=30 + i),
             JobParams(prompt=p, steps=6, guidance=7.5, seed=i), c)
            for i, (p, c) in enumerate(zip(["a cat", "grass", "the moon"], cases))]
    prepared = []
    for img, mask, params, controls in jobs:
        prep = prepare_job_tensors(cpu, scheduler_config(SD_DIR), img, _pil(mask), params, SD_SIZE, SD_SIZE)
        tensors = dict(prep.tensors, **prepare_control_images(cpu, [c[1] for c in controls], SD_SIZE, SD_SIZE,
                                                                bool(prep.meta["do_cfg"])))
        prepared.append((tensors, dict(prep.meta, cache_mode="full",
                                       controls=[[c[0], c[2], c[3], c[4]] for c in controls])))
    results, engine = run_engine(runner, prepared)
    assert any(len(rec.job_ids) == 3 for rec in engine.stats.history), "jobs did not share steps"
    for (img, mask, params, controls), out in zip(jobs, results):
        if controls:
            pipe, args = controlnet_call(SD_DIR, [nets[c[0]] for c in controls], controls, BF16)
        else:
            pipe, args = sd_pipe(SD_DIR, BF16), {}
        _check(f"ControlNets {[c[0] for c in controls]}", _decode(cpu, out["latents"]),
               _stock(pipe, img, _pil(mask), params, SD_SIZE, SD_SIZE, **args))


def test_bf16_mixed_size_batch_equals_the_stock_pipeline_at_each_size() -> None:
    from workers.engine.sd_runner import SDRunner
    from workers.sd_inputs import prepare_job_tensors

    cpu = sd_pipe(SD_DIR, BF16)
    runner = SDRunner(copy.deepcopy(cpu.unet).eval(), scheduler_config(SD_DIR))
    sizes = [(64, 64), (64, 48), (48, 64), (32, 64)]  # (width, height): the fp32 test's sizes halved
    jobs = [(seed, size, JobParams(prompt=["a cat", "grass", "the moon", "a rocket"][seed], steps=5 + seed % 2,
                                   guidance=7.5, seed=seed))
            for seed, size in enumerate(sizes)]
    prepared = []
    for seed, (w, h), params in jobs:
        prep = prepare_job_tensors(cpu, scheduler_config(SD_DIR), _sized_image(seed, (w, h)),
                                   _sized_mask(seed, (w, h), 0.3), params, h, w)
        prepared.append((prep.tensors, {**prep.meta, "cache_mode": "full"}))
    results, engine = run_engine(runner, prepared)
    assert any(len(rec.job_ids) == 4 for rec in engine.stats.history), "the sizes did not share steps"
    for (seed, (w, h), params), out in zip(jobs, results):
        ours = _decode(cpu, out["latents"])
        assert ours.shape[:2] == (h, w)
        stock = _stock(sd_pipe(SD_DIR, BF16), _sized_image(seed, (w, h)), _sized_mask(seed, (w, h), 0.3), params, w, h)
        _check(f"size {w}x{h}", ours, stock)


def test_bf16_flux_mixed_adapter_batch_equals_diffusers_lora_in_bf16(tmp_path: Path) -> None:
    from diffusers import FluxFillPipeline

    from tests.support.loras import save_flux_lora
    from tests.test_lora_engine import FLUX_DIR
    from workers.adapters.bank import AdapterBank
    from workers.adapters.patcher import LoraPatcher
    from workers.engine.flux_runner import FluxRunner
    from workers.flux_inputs import decode_flux_latents, prepare_flux_job_tensors
    from workers.maskaware.flux import MaskAwareFlux

    def flux_pipe(dtype: torch.dtype) -> FluxFillPipeline:
        pipe = FluxFillPipeline.from_pretrained(FLUX_DIR, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        cpu_bf16_convs(pipe.vae)
        return pipe

    maker = flux_pipe(torch.float32)  # PEFT leaves its wrappers in a model it trained an adapter on
    files = {"fa": save_flux_lora(maker, tmp_path / "fa", rank=4, seed=3),
             "fb": save_flux_lora(maker, tmp_path / "fb", rank=8, seed=4)}
    world = World(files, FLUX_DIR)
    pipe = flux_pipe(BF16)
    model = copy.deepcopy(pipe.transformer).eval()
    bank = AdapterBank(world.read, 1 << 30)
    lora = LoraPatcher(model, "transformer", bank.get)
    runner = FluxRunner(model, scheduler_config(FLUX_DIR), pipe.vae_scale_factor, maskaware=MaskAwareFlux(model),
                        lora=lora, adapters=bank)
    sets = [(("fa", 0.9),), (("fa", 0.4), ("fb", 1.0)), ()]
    jobs = [(_image(20 + i), make_mask(0.3, (SIZE, SIZE), "blob", seed=i),
             JobParams(prompt="a cat", steps=5, guidance=30.0, seed=i, loras=s)) for i, s in enumerate(sets)]
    prepared = []
    for img, m, p in jobs:
        prep = prepare_flux_job_tensors(pipe, scheduler_config(FLUX_DIR), img, _pil(m), p, SIZE, SIZE)
        assert prep.tensors["latents"].dtype == BF16
        prepared.append((prep.tensors, dict(prep.meta, loras=[[i, s] for i, s in p.loras], cache_mode="full")))
    results, engine = run_engine(runner, prepared)
    assert any(len(rec.job_ids) == 3 for rec in engine.stats.history) and lora.stats.steps_terms > 0
    assert lora.stats.merges == 0, "a half-precision model merged an adapter"
    for (img, mask, params), out in zip(jobs, results):
        ours = np.asarray(decode_flux_latents(pipe, out["latents"], SIZE, SIZE), dtype=np.int16)
        ref = flux_pipe(BF16)
        if params.loras:
            for lora_id, _ in params.loras:
                ref.load_lora_weights(str(files[lora_id].parent), adapter_name=lora_id)
            ref.set_adapters([i for i, _ in params.loras], [s for _, s in params.loras])
        _check(f"Flux LoRA {params.loras}", ours, _stock(ref, img, _pil(mask), params))


def test_a_step_with_adapter_terms_leaves_no_layout_demand_behind(tmp_path: Path) -> None:
    """The patcher's demand for row layouts is thread-local: after the step it must be withdrawn,
    or every other model stepped later on this thread runs its eager, layout-declaring path (the
    compiled kernels of STENCIL_COMPILE silently unused)."""
    from workers.adapters import layout
    from workers.adapters.bank import AdapterBank
    from workers.adapters.patcher import LoraPatcher
    from workers.engine.sd_runner import SDRunner
    from workers.sd_inputs import prepare_job_tensors

    files = {"a": save_sd_lora(sd_pipe(SD_DIR), tmp_path / "a", rank=4, seed=1)}
    world = World(files, SD_DIR)
    cpu = sd_pipe(SD_DIR, BF16)
    unet = copy.deepcopy(cpu.unet).eval()
    bank = AdapterBank(world.read, budget_bytes=1 << 30)
    lora = LoraPatcher(unet, "unet", bank.get)
    runner = SDRunner(unet, scheduler_config(SD_DIR), lora=lora, adapters=bank)
    params = JobParams(prompt="a cat", steps=2, guidance=7.5, seed=1, loras=(("a", 1.0),))
    mask = _pil(make_mask(0.25, (SIZE, SIZE), "blob", seed=1))
    prep = prepare_job_tensors(cpu, scheduler_config(SD_DIR), _image(1), mask, params, SIZE, SIZE)
    run_engine(runner, [(prep.tensors, dict(prep.meta, loras=[["a", 1.0]], cache_mode="full"))])
    assert lora.stats.steps_terms > 0
    assert not layout.wanted()


def test_a_half_precision_patcher_stages_no_merge(tmp_path: Path) -> None:
    """A routed job's adapters are staged (merged in the background) on an idle engine so its first
    step swaps them in; a half-precision model never swaps a merged set in, so staging there would
    only take device time from that job: ``stage`` declines and merges nothing."""
    from workers.adapters.bank import AdapterBank
    from workers.adapters.patcher import LoraPatcher

    files = {"a": save_sd_lora(sd_pipe(SD_DIR), tmp_path / "a", rank=4, seed=1)}
    world = World(files, SD_DIR)
    bank = AdapterBank(world.read, budget_bytes=1 << 30)
    for dtype, staged in ((BF16, False), (torch.float32, True)):
        lora = LoraPatcher(copy.deepcopy(sd_pipe(SD_DIR, dtype).unet).eval(), "unet", bank.get)
        try:
            assert lora.stage((("a", 0.8),)) is staged, dtype
            if staged:
                while not lora.weights.ready((("a", 0.8),)):
                    time.sleep(0.01)
            assert (lora.weights.staged_seconds > 0) is staged, dtype
        finally:
            lora.weights.close()
    bank.close()
