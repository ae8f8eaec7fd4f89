"""A benchmark-size runner per model family with a real warm-up cache, resident, and synthetic job
tensors of real shapes: what the per-step option benchmarks (``policy_speed``, ``temporal_reuse``)
step through the engine's runner."""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch

from app.maskgen import make_mask
from app.storage import LocalStore
from ops.bench.harness.engine import record
from ops.bench.harness.models import build_flux, build_sd_unet, ddim_config, flux_image_ids
from workers.engine.flux_runner import FluxRunner
from workers.engine.job import EngineJob
from workers.engine.sd_runner import SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.maskaware.flux import MaskAwareFlux
from workers.maskaware.unet import MaskAwareUNet
from workers.models.tiny_flux import FLUX_SCHEDULER_CONFIG


class Bench:
    """One family's runner on a benchmark-size model, with synthetic job tensors of real shapes."""

    SHAPES = {"sd": "unet (320, 640), 4096 tokens, CFG", "flux": "flux 2+4 blocks, inner 512, 1024 tokens, T=64"}

    def __init__(self, family: str, steps: int, seed: int = 0, resnets: str = "full") -> None:
        """``resnets="masked"``: the UNet's ResNets computed at the masked tokens too
        (``workers/maskaware/resnets.py``; SD only)."""
        if resnets != "full" and family != "sd":
            raise ValueError(f"masked ResNets are the UNet's: family {family!r} has none")
        self.family, self.steps = family, steps
        self.activations = ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-polspeed-")))
        caches = StepCacheProvider(self.activations, 16 << 30)
        g = torch.Generator().manual_seed(seed)
        if family == "sd":
            model = build_sd_unet((320, 640), 64, 1, 1, 768, seed)
            cfg = ddim_config()
            ctrl = MaskAwareUNet(model, resnets=resnets)  # type: ignore[arg-type]
            self.runner = SDRunner(model, cfg, maskaware=ctrl, caches=caches,
                                   recorder=CacheRecorder(self.activations), prefetch_steps=steps)
            self.size, self.layout, self.shape = 512, ctrl.cache_layout, self.SHAPES["sd"]
            self.base = {"latents": torch.randn(1, 4, 64, 64, generator=g),
                         "mask": torch.zeros(2, 1, 64, 64),
                         "masked_image_latents": torch.randn(2, 4, 64, 64, generator=g),
                         "prompt_embeds": torch.randn(2, 77, 768, generator=g)}
            self.meta = {"t_start": 0, "num_steps": steps, "do_cfg": True, "guidance": 7.5,
                         "height": 512, "width": 512}
        else:
            model = build_flux(seed)
            cfg = {**FLUX_SCHEDULER_CONFIG, "_class_name": "FlowMatchEulerDiscreteScheduler"}
            self.runner = FluxRunner(model, cfg, 16, maskaware=MaskAwareFlux(model), caches=caches,
                                     recorder=CacheRecorder(self.activations), prefetch_steps=steps)
            self.size, self.layout, self.shape = 512, "flux-kv-roped", self.SHAPES["flux"]
            side = 32
            self.base = {"latents": torch.randn(1, side * side, 64, generator=g),
                         "masked_image_latents": torch.randn(1, side * side, 320, generator=g),
                         "prompt_embeds": torch.randn(1, 64, 4096, generator=g),
                         "pooled_prompt_embeds": torch.randn(1, 768, generator=g),
                         "text_ids": torch.zeros(64, 3), "image_ids": flux_image_ids(side)}
            self.meta = {"family": "flux", "t_start": 0, "num_steps": steps, "guidance": 30.0,
                         "height": 512, "width": 512, "do_cfg": False}
        self.key = TemplateCacheKey(model_id=f"polspeed-{family}", template_id="t", height=self.size,
                                    width=self.size, scheduler=cfg["_class_name"], steps=steps, strength=1.0,
                                    guidance="cfg2" if self.meta["do_cfg"] else "single", layout=self.layout)

    def tensors(self, ratio: float) -> dict[str, torch.Tensor]:
        pixel = make_mask(ratio, (self.size, self.size), "blob", seed=3) if ratio > 0 else \
            np.zeros((self.size, self.size), bool)
        return {**self.base, "pixel_mask": torch.from_numpy(pixel.astype(np.uint8)),
                "generator_state": torch.Generator("cpu").manual_seed(1).get_state()}

    def warm(self) -> None:
        """A real warm-up through the engine (every step recorded and committed)."""
        record(self.runner, self.tensors(0.0), self.meta, self.key, resident_steps=self.steps)

    def job(self, ratio: float, mode: str, refresh: list[int]) -> EngineJob:
        meta = dict(self.meta) if mode == "full" else dict(self.meta, cache_mode=mode, cache_key=self.key.to_dict(),
                                                           refresh_steps=refresh)
        job = EngineJob(job_id=f"{mode}", total_steps=self.steps)
        job.state = self.runner.init_state(self.tensors(ratio), meta)
        return job

    def step(self, job: EngineJob) -> float:
        t0 = time.thread_time()
        self.runner.step([job])
        seconds = time.thread_time() - t0
        job.steps_done += 1
        return seconds
