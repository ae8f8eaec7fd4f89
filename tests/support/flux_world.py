"""The trained Flux Fill in process for engine-level tests: a provider and recorder over a local
store, the mask-aware controller, runners on demand and edit jobs of one template."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from app.jobs import JobParams
from app.storage.local import LocalStore
from tests.test_lora_engine import FLUX_DIR, _flux_pipe
from tests.test_mixed_sizes import _image, _mask
from workers.engine.flux_runner import FluxRunner
from workers.engine.job import EngineJob
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.flux_inputs import prepare_flux_job_tensors
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.maskaware.flux import MaskAwareFlux
from workers.models.loader import scheduler_config


class FluxWorld:
    def __init__(self, tmp_path: Path, steps: int = 4, size: tuple[int, int] = (96, 96)) -> None:
        self.steps, self.size = steps, size
        self.pipe = _flux_pipe()
        self.model = copy.deepcopy(self.pipe.transformer).eval()
        self.store = ActivationStore(LocalStore(tmp_path))
        self.caches = StepCacheProvider(self.store, 1 << 30)
        self.ctrl = MaskAwareFlux(self.model)
        self.key = TemplateCacheKey("m", "t", size[1], size[0], "FlowMatchEulerDiscreteScheduler", steps, 1.0,
                                    "single", self.ctrl.cache_layout)

    def runner(self, **options: Any) -> FluxRunner:
        return FluxRunner(self.model, scheduler_config(FLUX_DIR), self.pipe.vae_scale_factor, maskaware=self.ctrl,
                          caches=self.caches, recorder=CacheRecorder(self.store), **options)

    def job(self, runner: FluxRunner, seed: int, **meta: Any) -> EngineJob:
        """An edit of the template (image 9) with its own blob mask; ``meta`` sets its cache mode."""
        params = JobParams(prompt="a cat", steps=self.steps, guidance=30.0, seed=seed)
        prep = prepare_flux_job_tensors(self.pipe, scheduler_config(FLUX_DIR), _image(9, self.size),
                                        _mask(seed, self.size, 0.25), params, self.size[1], self.size[0])
        out = EngineJob(job_id=f"f{seed}", total_steps=self.steps)
        out.state = runner.init_state(prep.tensors, {**prep.meta, "cache_mode": "full", **meta})
        return out

    def warm_meta(self, mode: str) -> dict[str, Any]:
        return {"cache_mode": mode, "cache_key": self.key.to_dict()}
