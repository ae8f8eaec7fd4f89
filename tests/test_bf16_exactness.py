"""Exactness in bfloat16 (STENCIL_DTYPE=bfloat16): the service's path (CPU task in bf16, tensors
serialized as safetensors, engine in bf16, decode in bf16) equals the stock diffusers pipeline
loaded with ``torch_dtype=torch.bfloat16`` and the same seed within 2/255, for SD and Flux Fill
(the small trained models) and SDXL (tiny, random init), with full compute (alone and batched with
another job) and with the exact mask-aware path (a recording with the job's own inputs, then the
masked edit with identical inputs)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxFillPipeline, StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from tests.support.pipes import cpu_bf16_convs
from tests.test_lora_engine import FLUX_DIR, SD_DIR, run_engine
from workers.maskaware.activation_store import TemplateCacheKey
from workers.models.loader import (
    load_cpu_pipeline,
    load_flux_transformer,
    load_unet,
    save_embedded,
    scheduler_config,
    vae_scale_factor,
)
from workers.tensors import pack, unpack

log = logging.getLogger(__name__)
BF16 = torch.bfloat16
SIZE = 128
TOL = 2  # of 255


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    arr = np.stack([np.sin(xx * rng.uniform(2, 8)), np.cos(yy * rng.uniform(2, 8)), np.sin((xx + yy) * 4)], -1)
    return Image.fromarray(((arr * 0.5 + 0.5) * 255).astype(np.uint8))


def _mask(seed: int) -> Image.Image:
    return Image.fromarray(make_mask(0.25, (SIZE, SIZE), "blob", seed=seed).astype(np.uint8) * 255)


@pytest.fixture(scope="module")
def sdxl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_embedded("tiny-sdxl-inpaint", tmp_path_factory.mktemp("sdxl") / "tiny-sdxl-inpaint")


_STOCK_PICTURES: dict[tuple[str, ...], np.ndarray] = {}


class Service:
    """A CPU worker and a GPU worker of one model, both in ``dtype``, in process."""

    def __init__(self, family: str, folder: Path, tmp: Path, dtype: torch.dtype = BF16, device: str = "cpu") -> None:
        from app.storage.local import LocalStore
        from workers.engine.template_cache import CacheRecorder, StepCacheProvider
        from workers.maskaware.activation_store import ActivationStore

        self.family, self.folder, self.dtype, self.device = family, folder, dtype, device
        self.cpu = load_cpu_pipeline(folder, device, dtype=dtype)  # the stages on the worker's device
        store = ActivationStore(LocalStore(tmp))
        # As the GPU worker sets them up (workers/gpu_tasks.py): caches handed to the model in its dtype,
        # the exact path's recordings stored losslessly, i.e. in the dtype they were recorded in.
        provider = StepCacheProvider(store, 1 << 30, device=device)
        provider.dtype = dtype
        cache = {"caches": provider, "recorder": CacheRecorder(store, codec=str(dtype).removeprefix("torch."))}
        if family == "flux":
            from workers.engine.flux_runner import FluxRunner
            from workers.maskaware.flux import MaskAwareFlux

            model = load_flux_transformer(folder, device, dtype)
            self.runner = FluxRunner(model, scheduler_config(folder), vae_scale_factor(folder), device,
                                     maskaware=MaskAwareFlux(model), **cache)
        else:
            from workers.engine.sd_runner import SDRunner
            from workers.maskaware.unet import MaskAwareUNet

            unet = load_unet(folder, device, dtype)
            self.runner = SDRunner(unet, scheduler_config(folder), device, maskaware=MaskAwareUNet(unet), **cache)
        self.model = self.runner.transformer if family == "flux" else self.runner.unet
        cpu_bf16_convs(self.cpu.vae, self.model)
        assert self.model.dtype == dtype

    def prepare(self, params: JobParams, **meta: object) -> tuple[dict, dict]:
        from workers.flux_inputs import prepare_flux_job_tensors
        from workers.sd_inputs import prepare_job_tensors

        fn = prepare_flux_job_tensors if self.family == "flux" else prepare_job_tensors
        prep = fn(self.cpu, scheduler_config(self.folder), _image(params.seed), _mask(params.seed), params, SIZE, SIZE)
        assert prep.tensors["latents"].dtype == self.dtype and prep.tensors["prompt_embeds"].dtype == self.dtype
        tensors, _ = unpack(pack(prep.tensors))  # what the CPU task hands to the GPU worker
        return tensors, {**prep.meta, "cache_mode": "full", **meta}

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        from workers.flux_inputs import decode_flux_latents
        from workers.sd_inputs import decode_latents

        assert latents.dtype == self.dtype
        latents = unpack(pack({"latents": latents.cpu()}))[0]["latents"]
        if self.family == "flux":
            return np.asarray(decode_flux_latents(self.cpu, latents, SIZE, SIZE), dtype=np.int16)
        return np.asarray(decode_latents(self.cpu, latents), dtype=np.int16)

    def stock(self, params: JobParams) -> np.ndarray:
        """The stock pipeline's picture, run once per model, dtype, device and job in this process
        (deterministic: the full-compute and the exact mask-aware checks of job 0 share it)."""
        key = (self.family, str(self.folder), str(self.dtype), self.device, repr(params))
        if key not in _STOCK_PICTURES:
            _STOCK_PICTURES[key] = self._stock(params)
        return _STOCK_PICTURES[key]

    def _stock(self, params: JobParams) -> np.ndarray:
        kwargs = {"strength": params.strength}
        if self.family == "flux":
            pipe = FluxFillPipeline.from_pretrained(self.folder, dtype=self.dtype)
        elif self.family == "sdxl":
            pipe = StableDiffusionXLInpaintPipeline.from_pretrained(self.folder, dtype=self.dtype)
        else:
            pipe = StableDiffusionInpaintPipeline.from_pretrained(
                self.folder, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
                dtype=self.dtype)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.device)
        cpu_bf16_convs(pipe.vae, pipe.transformer if self.family == "flux" else pipe.unet)
        out = pipe(prompt=params.prompt, image=_image(params.seed), mask_image=_mask(params.seed),
                   num_inference_steps=params.steps, guidance_scale=params.guidance, height=SIZE, width=SIZE,
                   generator=torch.Generator("cpu").manual_seed(params.seed), **kwargs).images[0]
        return np.asarray(out, dtype=np.int16)


def _jobs(family: str) -> list[JobParams]:
    g = 30.0 if family == "flux" else 7.5
    # The second job starts from the VAE-encoded template (strength < 1): SDXL's VAE encodes in
    # float32 there (force_upcast), inside the pipeline's own method, in the stock call and in ours.
    return [JobParams(prompt="a cat", steps=6, guidance=g, seed=1),
            JobParams(prompt="grass", steps=5, guidance=g, seed=2, strength=0.8)]


def _world(family: str, tmp: Path, sdxl_dir: Path, device: str = "cpu") -> Service:
    folder = {"sd": SD_DIR, "flux": FLUX_DIR, "sdxl": sdxl_dir}[family]
    return Service(family, folder, tmp, device=device)


@pytest.mark.parametrize("family", ["sd", "flux", "sdxl"])
def test_bf16_full_compute_equals_stock_bf16(family: str, tmp_path: Path, sdxl_dir: Path) -> None:
    svc = _world(family, tmp_path, sdxl_dir)
    jobs = _jobs(family)
    prepared = [svc.prepare(p) for p in jobs]
    alone = run_engine(svc.runner, prepared[:1])[0][0]
    together, engine = run_engine(svc.runner, prepared)
    assert any(len(r.job_ids) == 2 for r in engine.stats.history)
    stock = [svc.stock(p) for p in jobs]
    checks = [(0, alone, "alone"), (0, together[0], "batched"), (1, together[1], "batched")]
    for i, out, how in checks:
        params, want = jobs[i], stock[i]
        diff = int(np.abs(svc.decode(out["latents"]) - want).max())
        log.info("%s bf16 %s seed %d: max pixel diff %d", family, how, params.seed, diff)
        assert diff <= TOL, f"{family} {how} seed {params.seed}: max pixel diff {diff} vs the stock pipeline in bf16"


@pytest.mark.parametrize("family", ["sd", "flux", "sdxl"])
def test_bf16_exact_maskaware_path_equals_stock_bf16(family: str, tmp_path: Path, sdxl_dir: Path) -> None:
    svc = _world(family, tmp_path, sdxl_dir)
    params = _jobs(family)[0]
    sched = str(scheduler_config(svc.folder)["_class_name"])
    layout = ("flux-kv-roped" if family == "flux" else "kv+y") + "@bfloat16/exact-x"  # as cpu_tasks keys it
    key = TemplateCacheKey("m", "t", SIZE, SIZE, sched, params.steps, 1.0, "single" if family == "flux" else "cfg2",
                           layout)
    rec, _ = run_engine(svc.runner, [svc.prepare(params, cache_mode="record", cache_key=key.to_dict())])
    rec[0]["commit"].result(60)
    for step in range(params.steps):
        cached = svc.runner.caches.wait(key, step, 30)
        assert cached is not None
        dtypes = {t.dtype for t in cached.values()}
        assert cached and dtypes == {BF16}, f"step {step}: the cache was stored as {dtypes}, recorded in bf16"
    out, _ = run_engine(svc.runner, [svc.prepare(params, cache_mode="masked", cache_key=key.to_dict())])
    assert out[0]["mode"] == "masked" and out[0]["masked_steps"] == params.steps
    diff = int(np.abs(svc.decode(out[0]["latents"]) - svc.stock(params)).max())
    log.info("%s bf16 exact mask-aware: max pixel diff %d", family, diff)
    assert diff <= TOL, f"{family}: exact mask-aware path differs by {diff}/255 from the stock pipeline in bf16"


def test_a_cache_recorded_in_another_dtype_is_refused(tmp_path: Path) -> None:
    """Exact caches are exact in the dtype they were recorded in: a bf16 worker refuses a float32 key."""
    svc = Service("sd", SD_DIR, tmp_path)
    params = _jobs("sd")[0]
    key = TemplateCacheKey("m", "t", SIZE, SIZE, "DDIMScheduler", params.steps, 1.0, "cfg2", "kv+y/exact-x")
    tensors, meta = svc.prepare(params, cache_mode="masked", cache_key=key.to_dict())
    with pytest.raises(ValueError, match="recorded in float32"):
        svc.runner.init_state(tensors, meta)
