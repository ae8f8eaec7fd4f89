"""The trained Flux Fill in process for engine-level tests: a provider and recorder over a local
store, the mask-aware controller, runners on demand and edit jobs of one template."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from app.jobs import JobParams
from app.storage.local import LocalStore
from tests.test_lora_engine import FLUX_DIR, _flux_pipe
from tests.test_mixed_sizes import _image, _mask
from workers.engine.flux_runner import FluxRunner
from workers.engine.job import EngineJob
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.flux_inputs import prepare_flux_job_tensors
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey, recorded_layout
from workers.maskaware.flux import MaskAwareFlux
from workers.models.loader import scheduler_config


class FluxWorld:
    def __init__(self, tmp_path: Path, steps: int = 4, size: tuple[int, int] = (96, 96), device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.steps, self.size, self.device = steps, size, device
        self.pipe = _flux_pipe()
        self.model = copy.deepcopy(self.pipe.transformer).eval().to(device, dtype)
        self.store = ActivationStore(LocalStore(tmp_path))
        self.caches = StepCacheProvider(self.store, 1 << 30, device=device)
        self.caches.dtype = dtype
        self.ctrl = MaskAwareFlux(self.model)
        self.key = TemplateCacheKey("m", "t", size[1], size[0], "FlowMatchEulerDiscreteScheduler", steps, 1.0,
                                    "single", recorded_layout(self.ctrl.cache_layout, dtype))

    def runner(self, **options: Any) -> FluxRunner:
        return FluxRunner(self.model, scheduler_config(FLUX_DIR), self.pipe.vae_scale_factor, self.device,
                          maskaware=self.ctrl, caches=self.caches, recorder=CacheRecorder(self.store), **options)

    def job(self, runner: FluxRunner, seed: int, ratio: float = 0.25, **meta: Any) -> EngineJob:
        """An edit of the template (image 9) with its own mask; ``meta`` sets its cache mode."""
        params = JobParams(prompt="a cat", steps=self.steps, guidance=30.0, seed=seed)
        prep = prepare_flux_job_tensors(self.pipe, scheduler_config(FLUX_DIR), _image(9, self.size),
                                        _mask(seed, self.size, ratio), params, self.size[1], self.size[0])
        out = EngineJob(job_id=f"f{seed}", total_steps=self.steps)
        out.state = runner.init_state(prep.tensors, {**prep.meta, "cache_mode": "full", **meta})
        return out

    def warm_meta(self, mode: str) -> dict[str, Any]:
        return {"cache_mode": mode, "cache_key": self.key.to_dict()}
