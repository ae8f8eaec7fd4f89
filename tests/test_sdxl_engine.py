"""SDXL inpainting served exactly: a job prepared by the CPU task (two text encoders, pooled
embeddings, time ids) and denoised by the engine (added conditioning per row) equals
``StableDiffusionXLInpaintPipeline`` with the same seed and strength (1/255 in pixels, float32),
alone and batched with other jobs, and through the exact mask-aware path (a recording with the
job's own inputs, then the masked edit). The embedded ``tiny-sdxl-inpaint`` has SDXL's classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLInpaintPipeline
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from tests.test_lora_engine import run_engine
from workers.models.loader import load_cpu_pipeline, model_family, scheduler_config

SIZE = 128


@pytest.fixture(scope="module")
def sdxl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written by ``stencil model save DIR --model tiny-sdxl-inpaint``."""
    from app.cli import main

    out = tmp_path_factory.mktemp("sdxl") / "tiny-sdxl-inpaint"
    assert main(["model", "save", str(out), "--model", "tiny-sdxl-inpaint"]) == 0
    return out


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    arr = np.stack([np.sin(xx * rng.uniform(2, 8)), np.cos(yy * rng.uniform(2, 8)), np.sin((xx + yy) * 4)], -1)
    return Image.fromarray(((arr * 0.5 + 0.5) * 255).astype(np.uint8))


def _mask(seed: int, ratio: float = 0.25) -> Image.Image:
    return Image.fromarray(make_mask(ratio, (SIZE, SIZE), "blob", seed=seed).astype(np.uint8) * 255)


def stock(folder: Path, params: JobParams, dtype: torch.dtype = torch.float32) -> np.ndarray:
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(folder, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=params.prompt, image=_image(params.seed), mask_image=_mask(params.seed),
               num_inference_steps=params.steps, guidance_scale=params.guidance, strength=params.strength,
               height=SIZE, width=SIZE, generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
    return np.asarray(out, dtype=np.int16)


class Service:
    """What a CPU worker (prepare, finalize) and a GPU worker (runner) do, in process."""

    def __init__(self, folder: Path, tmp: Path, dtype: torch.dtype = torch.float32) -> None:
        from app.storage.local import LocalStore
        from workers.engine.sd_runner import SDRunner
        from workers.engine.template_cache import CacheRecorder, StepCacheProvider
        from workers.maskaware.activation_store import ActivationStore
        from workers.maskaware.unet import MaskAwareUNet
        from workers.models.loader import load_unet

        self.folder = folder
        self.cpu = load_cpu_pipeline(folder, dtype=dtype)
        unet = load_unet(folder, "cpu", dtype)
        store = ActivationStore(LocalStore(tmp))
        self.runner = SDRunner(unet, scheduler_config(folder), maskaware=MaskAwareUNet(unet),
                               caches=StepCacheProvider(store, 1 << 30), recorder=CacheRecorder(store))

    def prepare(self, params: JobParams, **meta: object) -> tuple[dict, dict]:
        from workers.sd_inputs import prepare_job_tensors
        from workers.tensors import pack, unpack

        prep = prepare_job_tensors(self.cpu, scheduler_config(self.folder), _image(params.seed), _mask(params.seed),
                                   params, SIZE, SIZE)
        tensors, _ = unpack(pack(prep.tensors))  # what crosses from the CPU task to the GPU worker
        return tensors, {**prep.meta, "cache_mode": "full", **meta}

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        from workers.sd_inputs import decode_latents
        from workers.tensors import pack, unpack

        latents = unpack(pack({"latents": latents}))[0]["latents"]
        return np.asarray(decode_latents(self.cpu, latents), dtype=np.int16)


JOBS = [JobParams(prompt="a cat", steps=6, guidance=7.5, seed=1, strength=1.0),
        JobParams(prompt="grass", steps=7, guidance=1.0, seed=2, strength=1.0),  # no CFG: one row
        JobParams(prompt="the moon", steps=8, guidance=5.0, seed=3, strength=0.75)]  # VAE-encoded start


def test_embedded_sdxl_model_is_the_stock_classes(sdxl_dir: Path) -> None:
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(sdxl_dir)
    assert model_family(sdxl_dir) == "sd"
    assert pipe.unet.config.in_channels == 9 and pipe.unet.config.addition_embed_type == "text_time"
    assert pipe.vae.config.force_upcast and pipe.text_encoder_2 is not None


def test_time_ids_equal_the_pipelines_own() -> None:
    """``sdxl_time_ids`` builds what ``_get_add_time_ids`` builds, with and without aesthetic scores."""
    from workers.models.tiny_sdxl import build_sdxl_pipeline
    from workers.sd_inputs import sdxl_time_ids

    for aesthetic in (False, True):
        pipe = build_sdxl_pipeline(requires_aesthetics_score=aesthetic)
        size = (96, 128)
        want = pipe._get_add_time_ids(size, (0, 0), size, 6.0, 2.5, size, (0, 0), size, dtype=torch.float32,
                                      text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
        got = sdxl_time_ids(pipe, 96, 128, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (aesthetic, got, want)
        assert got[0].shape[-1] == (5 if aesthetic else 6)


def test_sdxl_jobs_alone_and_batched_equal_stock(sdxl_dir: Path, tmp_path: Path) -> None:
    svc = Service(sdxl_dir, tmp_path)
    jobs = [svc.prepare(p) for p in JOBS]
    assert jobs[0][0]["add_text_embeds"].shape[0] == 2 and jobs[1][0]["add_time_ids"].shape[0] == 1
    alone = [run_engine(svc.runner, [job])[0][0] for job in jobs]
    together, engine = run_engine(svc.runner, jobs)
    assert any(len(r.job_ids) == 3 for r in engine.stats.history), "the jobs never shared a step"
    for params, a, b in zip(JOBS, alone, together):
        want = stock(sdxl_dir, params)
        for name, out in (("alone", a), ("batched", b)):
            diff = np.abs(svc.decode(out["latents"]) - want).max()
            assert diff <= 1, f"{params.prompt} {name}: max pixel diff {diff} vs StableDiffusionXLInpaintPipeline"


def test_sdxl_exact_maskaware_path_equals_stock(sdxl_dir: Path, tmp_path: Path) -> None:
    from workers.maskaware.activation_store import TemplateCacheKey

    svc = Service(sdxl_dir, tmp_path)
    params = JOBS[0]
    key = TemplateCacheKey("m", "t", SIZE, SIZE, "EulerDiscreteScheduler", params.steps, 1.0, "cfg2", "kv+y/exact-x")
    rec, _ = run_engine(svc.runner, [svc.prepare(params, cache_mode="record", cache_key=key.to_dict())])
    rec[0]["commit"].result(60)
    for step in range(params.steps):
        assert svc.runner.caches.wait(key, step, 30) is not None
    masked = svc.prepare(params, cache_mode="masked", cache_key=key.to_dict())
    other = svc.prepare(JOBS[1])
    out, _ = run_engine(svc.runner, [masked, other])
    assert out[0]["mode"] == "masked" and out[0]["masked_steps"] == params.steps
    want = stock(sdxl_dir, params)
    assert np.abs(svc.decode(out[0]["latents"]) - want).max() <= 1
    assert np.abs(svc.decode(out[1]["latents"]) - stock(sdxl_dir, JOBS[1])).max() <= 1
