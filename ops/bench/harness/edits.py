"""One edit through the engine in process, as the service runs it: the model family (pipeline,
runners, prepare, decode), warm-ups, edits under a fidelity option, and image metrics."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from skimage.metrics import structural_similarity

from app.fidelity import REFRESHES, refresh_schedule
from app.jobs import JobParams
from app.maskgen import SHAPES, make_mask
from app.storage import LocalStore
from ops.bench.harness.engine import record, run
from ops.sim.traces import load_trace
from workers import noise_blend
from workers.engine.flux_runner import FluxRunner
from workers.engine.sd_runner import SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.flux_inputs import decode_flux_latents, prepare_flux_job_tensors
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.maskaware.flux import MaskAwareFlux
from workers.maskaware.unet import MaskAwareUNet
from workers.sd_inputs import decode_latents, prepare_job_tensors

DEFAULT_MODELS = {"sd": "tiny-sd-inpaint-trained", "flux": "tiny-flux-fill-trained"}
# Edit prompts: captions the trained model knows, none of them the warm-up prompt ("").
EDIT_PROMPTS = ["a cat", "an astronaut", "grass", "a brick wall", "the moon", "a cup of coffee", "a rocket"]
TRACE_NAMES = ("spring", "controlnet", "adetailer")  # the mask-ratio traces, by the benchmarks' short names


def trace_edits(rng: np.random.Generator, trace: str, n: int, size: int, templates: int, steps: int,
                guidance: float) -> Iterator[tuple[int, np.ndarray, int, JobParams]]:
    """Up to ``n`` edits drawn from ``trace``: (index, mask, template index, params), each mask a
    ratio of the trace in the ``k``-th shape, a prompt the model knows, a random seed; empty and
    full masks are skipped (exact by construction)."""
    ratios = load_trace(trace)
    for k in range(n):
        mask = make_mask(float(rng.choice(ratios)), (size, size), SHAPES[k % len(SHAPES)],
                         seed=int(rng.integers(1 << 30)))
        if mask.mean() in (0.0, 1.0):
            continue
        t = int(rng.integers(templates))
        yield k, mask, t, JobParams(prompt=str(rng.choice(EDIT_PROMPTS)), seed=int(rng.integers(1 << 30)),
                                    steps=steps, guidance=guidance)


class Family:
    """Model-family specifics: pipeline, runners (full compute and mask-aware), prepare and decode."""

    @property
    def scheduler_config(self) -> dict:
        """The scheduler config as a saved folder holds it (with its class name)."""
        return {**dict(self.pipe.scheduler.config), "_class_name": type(self.pipe.scheduler).__name__}

    def __init__(self, name: str, activations: ActivationStore | None = None, model: str | None = None,
                 resnets: str = "full", size: int = 128) -> None:
        """``model``: an embedded model id or a pipeline folder (default: the family's trained one);
        ``resnets="masked"``: SD's ResNets computed at the masked tokens too (``workers/maskaware/resnets.py``);
        ``size``: the images' side in pixels (the trained models were trained at 128)."""
        self.name, self.size = name, size
        self.pipe = load_pipeline(name, DEFAULT_MODELS[name] if model is None else model)
        activations = activations or ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-bench-acts-")))
        caches = dict(caches=StepCacheProvider(activations, 1 << 30), recorder=CacheRecorder(activations),
                      prefetch_steps=64)
        if name == "sd":
            denoiser, extra = self.pipe.unet.eval(), ()
            runner, self.ctrl = SDRunner, MaskAwareUNet(denoiser, resnets=resnets)
            self.layout = self.ctrl.cache_layout
        else:
            denoiser, extra, self.layout = self.pipe.transformer.eval(), (self.pipe.vae_scale_factor,), "flux-kv-roped"
            runner, self.ctrl = FluxRunner, MaskAwareFlux(denoiser)
        self.runner_full = runner(denoiser, self.scheduler_config, *extra)
        self.runner_ma = runner(denoiser, self.scheduler_config, *extra, maskaware=self.ctrl, **caches)

    def prepare(self, image: Image.Image, mask: np.ndarray, params: JobParams) -> tuple[dict, dict]:
        prepare = prepare_job_tensors if self.name == "sd" else prepare_flux_job_tensors
        prep = prepare(self.pipe, self.scheduler_config, image, Image.fromarray(mask.astype(np.uint8) * 255), params,
                       self.size, self.size)
        return dict(prep.tensors), dict(prep.meta)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        if self.name == "sd":
            return np.asarray(decode_latents(self.pipe, latents))
        return np.asarray(decode_flux_latents(self.pipe, latents, self.size, self.size))

    def full(self, tensors: dict, meta: dict) -> np.ndarray:
        """The decoded image of a job's full compute (what every mask-aware edit is compared with)."""
        return self.decode(run(self.runner_full, [(tensors, dict(meta))])[0]["latents"])

    def warmed_templates(self, steps: int, guidance: float) -> tuple[list[Image.Image], list[TemplateCacheKey]]:
        """The demo templates at this family's size, each warmed as production does (empty mask, prompt "", seed 0)."""
        from app.demo import demo_templates

        templates = [img.resize((self.size, self.size)) for _n, img in demo_templates(128)]
        empty = np.zeros((self.size, self.size), bool)
        params = JobParams(prompt="", seed=0, steps=steps, guidance=guidance)
        return templates, [warm(self, f"t{i}", img, empty, params) for i, img in enumerate(templates)]

    def key(self, template_id: str, params: JobParams, meta: dict) -> TemplateCacheKey:
        return TemplateCacheKey(model_id=f"bench-{self.name}", template_id=template_id, height=self.size,
                                width=self.size, scheduler=str(self.pipe.scheduler.config["_class_name"]),
                                steps=params.steps, strength=params.strength,
                                guidance="cfg2" if meta["do_cfg"] else "single", layout=self.layout)


def model_folder(model: str) -> Path:
    """The pipeline folder of ``model``: a folder, a benchmark-only model (trained on first use), or
    an embedded model id (saved to a temporary home)."""
    from app.settings import Settings
    from ops.train.on_demand import RECIPES, ensure_trained
    from workers.models.loader import ensure_model_dir

    if model in RECIPES:  # a benchmark-only model the repository does not ship
        return ensure_trained(model)
    if Path(model).is_dir():
        return Path(model)
    return ensure_model_dir(
        Settings.from_env(home=Path(tempfile.mkdtemp(prefix="stencil-fid-home-")), model_dir="", model_id=model))


def load_pipeline(family: str, model: str):  # type: ignore[no-untyped-def]
    """The pipeline to measure: an embedded model id (saved to a temporary home), a pipeline folder, or
    for Flux "" = the random-init tiny Flux Fill. Fidelity of a random-init model measures noise
    against noise, so the default is the trained one."""
    from diffusers import FluxFillPipeline, StableDiffusionInpaintPipeline

    from workers.models.tiny_flux import build_flux_fill_pipeline

    if family == "flux" and not model:
        return build_flux_fill_pipeline(0)
    folder = model_folder(model)
    if family == "sd":
        pipe = StableDiffusionInpaintPipeline.from_pretrained(folder, safety_checker=None, feature_extractor=None,
                                                              requires_safety_checker=False, torch_dtype=torch.float32)
    else:
        pipe = FluxFillPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run a mask-aware edit: refresh steps (with the offset correction of
    ``runner_base``), the warm-up's noise outside the mask, or a warm-up of the edit itself."""

    name: str
    refreshes: int = 0
    warm_noise: bool = False  # start from the warm-up's noise at cached tokens (noise_blend)
    region: bool = False  # a warm-up recorded with this edit's mask, prompt and seed: exact
    at: tuple[int, ...] = ()  # explicit refresh steps (schedules no policy uses)
    reuse: bool = False  # temporal reuse of masked patches (``turbo``; the runner's ``reuse_rule``)

    def schedule(self, steps: int) -> list[int]:
        return list(self.at) if self.at else refresh_schedule(self.refreshes, steps)


# The policies of ``app/fidelity.py`` and the alternatives they were chosen over.
OPTIONS = {o.name: o for o in (
    Option("cache-as-is", warm_noise=True),  # the path before refresh steps (warm-up noise outside)
    Option("refresh-1", 1), Option("fast", REFRESHES["fast"]), Option("balanced", REFRESHES["balanced"]),
    Option("refresh-4", 4), Option("exact-region", region=True),
    Option("turbo", REFRESHES["turbo"], reuse=True),
)}


def metrics(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """SSIM and PSNR over the whole image, the unmasked region and the mask."""
    ssim_full, ssim_map = structural_similarity(a, b, channel_axis=2, data_range=255, full=True)
    out = {"ssim": float(ssim_full), "psnr": psnr(a, b)}
    for region, sel in (("unmasked", ~mask), ("masked", mask)):
        if sel.any():
            out[f"ssim_{region}"] = float(ssim_map[sel].mean())
            out[f"psnr_{region}"] = psnr(a[sel], b[sel])
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB, capped at 100 for identical images (so means stay finite)."""
    err = float(((a.astype(float) - b.astype(float)) ** 2).mean())
    return min(100.0, float(10 * np.log10(255**2 / err))) if err > 0 else 100.0


def warm(fam: Family, template_id: str, image: Image.Image, mask: np.ndarray, params: JobParams) -> TemplateCacheKey:
    """Record a warm-up as the service does and wait until its cache is committed."""
    tensors, meta = fam.prepare(image, mask, params)
    key = fam.key(template_id, params, meta)
    record(fam.runner_ma, tensors, meta, key)
    return key


def edit(fam: Family, option: Option, image: Image.Image, mask: np.ndarray, params: JobParams,
         key: TemplateCacheKey, warm_seed: int = 0) -> dict[str, Any]:
    """One mask-aware edit under ``option`` from the cache at ``key``."""
    tensors, meta = fam.prepare(image, mask, params)
    if option.warm_noise and params.seed != warm_seed:
        warm_t, _ = fam.prepare(image, mask, dataclasses.replace(params, seed=warm_seed))
        blend = noise_blend.blend_sd if fam.name == "sd" else noise_blend.blend_flux
        tensors = dict(tensors, latents=blend(tensors["latents"], warm_t["latents"], tensors["pixel_mask"],
                                              fam.pipe.vae_scale_factor))
    for step in range(int(meta["num_steps"])):  # resident, as after the service's prefetch
        fam.runner_ma.caches.wait(key, step, 30)  # type: ignore[union-attr]
    meta = dict(meta, cache_mode="masked", cache_key=key.to_dict(), refresh_steps=option.schedule(params.steps),
                temporal_reuse=option.reuse)
    return run(fam.runner_ma, [(tensors, meta)])[0]
