"""What every model family's runner shares: per-job cache modes, transactional steps, results.

A runner owns a denoiser and executes ONE denoising step for a whole batch of jobs. Each job runs
in one of three modes. ``full``: normal compute. ``record`` (a template warm-up): normal compute,
and this step's activations go to the template's cache. ``masked`` (an edit of a warmed template):
only the job's masked tokens are computed in the transformer blocks; unmasked tokens come from
the template cache for the job's own current step. If that step's cache is not resident in host
RAM yet, the job computes the step fully instead of waiting (never a stall, never a wrong cache);
the job's state counts such steps.

A step is transactional: new latents are committed only after every job's update succeeded, and
scheduler/generator state is rolled back on failure, so the engine can retry job by job to
isolate a failing job exactly.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.engine.job import EngineJob
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import TemplateCacheKey

log = logging.getLogger(__name__)


@dataclass
class JobState:
    """Per-job denoising state common to all families (subclasses add model inputs)."""

    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    generator: torch.Generator
    mode: str = "full"  # full | record | masked
    cache_key: TemplateCacheKey | None = None
    token_masks: Any = None
    masked_steps: int = 0
    fallback_steps: int = 0
    commit: Future | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return 1


class BaseRunner(ABC):
    """Cache-mode bookkeeping and the transactional step; subclasses run the model."""

    def __init__(self, maskaware: Any = None, caches: StepCacheProvider | None = None,
                 recorder: CacheRecorder | None = None, dilation: int = 0, prefetch_steps: int = 4) -> None:
        self.maskaware = maskaware
        self.caches = caches
        self.recorder = recorder
        self.dilation = dilation
        self.prefetch_steps = prefetch_steps

    # -- family-specific -------------------------------------------------------------------------
    @abstractmethod
    def init_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> JobState: ...

    @abstractmethod
    def _forward(self, batch: list[EngineJob], groups: list[Any] | None) -> tuple[torch.Tensor, list[Any]]:
        """One denoiser call for the batch; returns (model output rows, recorded caches)."""

    @abstractmethod
    def _guided(self, job: EngineJob, rows: torch.Tensor) -> torch.Tensor:
        """The model output of one job from its rows (classifier-free guidance, if any)."""

    @abstractmethod
    def _row_group(self, rows: int, mode: str, token_mask: Any = None, cache: Any = None) -> Any: ...

    @abstractmethod
    def _token_masks(self, st: JobState, tensors: dict[str, torch.Tensor]) -> Any: ...

    # -- cache modes ---------------------------------------------------------------------------------
    def _init_cache_mode(self, st: JobState, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        mode = str(meta.get("cache_mode", "full"))
        if mode == "full":
            return
        if mode not in ("record", "masked"):
            raise ValueError(f"unknown cache mode {mode!r}")
        if self.maskaware is None or (mode == "masked" and self.caches is None) or \
                (mode == "record" and self.recorder is None):
            log.info("mask-aware inference is off on this worker: %s job runs full compute", mode)
            st.extra["cache_note"] = "mask-aware off on worker"
            return
        key = TemplateCacheKey.from_dict(dict(meta["cache_key"]))  # type: ignore[arg-type]
        layout = getattr(self.maskaware, "cache_layout", key.layout)
        if key.layout != layout:
            raise ValueError(f"cache layout {key.layout} does not match the worker's {layout}")
        if key.steps not in (len(st.timesteps) + int(meta["t_start"]), len(st.timesteps)):
            raise ValueError("cache key steps do not match the job")
        st.mode, st.cache_key = mode, key
        if mode == "masked":
            st.token_masks = self._token_masks(st, tensors)
            self.caches.prefetch(key, range(self.prefetch_steps))  # type: ignore[union-attr]

    def prefetch(self, job: EngineJob) -> None:
        """Start loading the next steps' caches of a (waiting or running) masked job."""
        st: JobState = job.state
        if st.mode == "masked" and self.caches is not None and st.cache_key is not None:
            self.caches.prefetch(st.cache_key, range(job.steps_done, job.steps_done + self.prefetch_steps))

    def _group(self, job: EngineJob) -> Any:
        st: JobState = job.state
        if st.mode == "record":
            return self._row_group(st.rows, "record")
        if st.mode == "masked":
            assert self.caches is not None and st.cache_key is not None
            cache = self.caches.ready(st.cache_key, job.steps_done)
            if cache is not None:
                return self._row_group(st.rows, "masked", st.token_masks, cache)
            st.extra["fallback_pending"] = True
        return self._row_group(st.rows, "full")

    # -- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, batch: list[EngineJob]) -> None:
        """One denoising step for every job of ``batch`` in a single denoiser call."""
        if not batch:
            return
        for job in batch:
            job.state.extra.pop("fallback_pending", None)
        groups = [self._group(job) for job in batch] if self.maskaware is not None else None
        output, recorded = self._forward(batch, groups)
        updates: list[tuple[JobState, torch.Tensor]] = []
        snapshots = [(job.state, dict(job.state.scheduler.__dict__), job.state.generator.get_state())
                     for job in batch]
        try:
            row = 0
            for job in batch:
                st: JobState = job.state
                pred = self._guided(job, output[row:row + st.rows])
                row += st.rows
                t = st.timesteps[job.steps_done]
                new = st.scheduler.step(pred, t, st.latents, **_step_kwargs(st.scheduler, st.generator),
                                        return_dict=False)[0]
                if not torch.isfinite(new).all():
                    raise FloatingPointError(f"job {job.job_id}: non-finite latents at step {job.steps_done}")
                updates.append((st, new))
        except Exception:
            # Schedulers such as Euler count steps internally: roll back so a retry is exact.
            for st, sched_dict, gen_state in snapshots:
                st.scheduler.__dict__.update(sched_dict)
                st.generator.set_state(gen_state)
            raise
        for st, new in updates:
            st.latents = new
        self._after_step(batch, recorded)

    def _after_step(self, batch: list[EngineJob], recorded: list[Any]) -> None:
        for i, job in enumerate(batch):
            st: JobState = job.state
            if st.mode == "masked":
                if st.extra.pop("fallback_pending", False):
                    st.fallback_steps += 1
                else:
                    st.masked_steps += 1
                self.prefetch(job)
            elif st.mode == "record" and recorded and recorded[i] is not None:
                assert self.recorder is not None and st.cache_key is not None
                step_index = int(job.steps_done)
                self.recorder.put(st.cache_key, step_index, recorded[i])
                if step_index + 1 == len(st.timesteps):
                    st.commit = self.recorder.commit(st.cache_key)

    def masked_tokens(self, st: JobState) -> tuple[int, ...]:
        """Tokens the job computes per step at each level (all of them unless masked)."""
        masks = st.token_masks
        if masks is None:
            return (self._full_tokens(st),)
        if hasattr(masks, "levels"):
            return tuple(int(level.sum()) for level in masks.levels)
        return (int(masks.sum()),)

    def _full_tokens(self, st: JobState) -> int:
        shape = st.latents.shape
        return int(shape[-2] * shape[-1]) if st.latents.dim() == 4 else int(shape[1])

    def result(self, job: EngineJob) -> dict[str, Any]:
        st: JobState = job.state
        return {"latents": st.latents, "commit": st.commit, "mode": st.mode,
                "masked_steps": st.masked_steps, "fallback_steps": st.fallback_steps,
                "note": st.extra.get("cache_note", "")}


def _step_kwargs(scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
    """eta/generator as ``prepare_extra_step_kwargs`` passes them (eta = 0, the pipeline default)."""
    params = set(inspect.signature(scheduler.step).parameters)
    kwargs: dict[str, Any] = {}
    if "eta" in params:
        kwargs["eta"] = 0.0
    if "generator" in params:
        kwargs["generator"] = generator
    return kwargs
