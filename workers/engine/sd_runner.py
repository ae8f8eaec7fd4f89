"""Runner for SD-family inpainting UNets: owns the model and executes one step for a whole batch.

Each job keeps its own scheduler instance, timesteps, generator, mask and prompt embeddings; one
UNet call serves every job of the batch with a per-row timestep tensor. With classifier-free
guidance a job contributes two adjacent rows (uncond, cond), as the stock pipeline orders them.
A step is transactional: new latents are committed only after every job's update succeeded, so a
failing step can be retried job by job to isolate the culprit.

Mask-aware inference (``MaskAwareUNet``): each job runs in one of three modes. ``full``: normal
compute. ``record`` (a template warm-up): normal compute, and this step's activations go to the
template's cache. ``masked`` (an edit of a warmed template): only the job's masked tokens are
computed in the transformer blocks; unmasked tokens come from the template cache for the job's own
current step. If that step's cache is not resident in host RAM yet, the job computes the step
fully instead of waiting (never a stall, never a wrong cache); the job's state counts such steps.
Jobs of all modes, templates, masks and steps share one UNet call.
"""

from __future__ import annotations

import inspect
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import UNet2DConditionModel

from workers.engine.job import EngineJob
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import TemplateCacheKey
from workers.maskaware.tokens import TokenMasks
from workers.maskaware.unet import MaskAwareUNet, RowGroup
from workers.models.loader import make_scheduler

log = logging.getLogger(__name__)


@dataclass
class SDJobState:
    latents: torch.Tensor
    mask: torch.Tensor
    masked_image_latents: torch.Tensor
    prompt_embeds: torch.Tensor
    do_cfg: bool
    guidance: float
    scheduler: Any
    timesteps: torch.Tensor
    generator: torch.Generator
    mode: str = "full"  # full | record | masked
    cache_key: TemplateCacheKey | None = None
    token_masks: TokenMasks | None = None
    masked_steps: int = 0
    fallback_steps: int = 0
    commit: Future | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return 2 if self.do_cfg else 1


class SDRunner:
    """Executes denoising steps of SD inpainting jobs on one device."""

    def __init__(self, unet: UNet2DConditionModel, scheduler_config: dict[str, Any], device: str = "cpu",
                 *, maskaware: MaskAwareUNet | None = None, caches: StepCacheProvider | None = None,
                 recorder: CacheRecorder | None = None, dilation: int = 0, prefetch_steps: int = 4) -> None:
        if unet.config.in_channels != 9:
            raise ValueError(f"an inpainting UNet has 9 input channels, this one has {unet.config.in_channels}")
        self.unet = unet
        self.scheduler_config = scheduler_config
        self.device = torch.device(device)
        self.maskaware = maskaware
        self.caches = caches
        self.recorder = recorder
        self.dilation = dilation
        self.prefetch_steps = prefetch_steps

    def init_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> SDJobState:
        """Build a job's state from its prepared tensors (validated against the model)."""
        latents = tensors["latents"].to(self.device, torch.float32)
        expected = self.unet.config.in_channels - 2 * latents.shape[1] - 1
        if expected != 0:
            raise ValueError(f"latent channels {latents.shape[1]} do not fit the UNet's {self.unet.config.in_channels} inputs")
        scheduler = make_scheduler(self.scheduler_config)
        steps_total = int(meta["t_start"]) + int(meta["num_steps"])
        scheduler.set_timesteps(steps_total, device=self.device)
        t_start = int(meta["t_start"]) * scheduler.order
        timesteps = scheduler.timesteps[t_start:]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(t_start)
        generator = torch.Generator("cpu")
        generator.set_state(tensors["generator_state"])
        do_cfg = bool(meta["do_cfg"])
        embeds = tensors["prompt_embeds"].to(self.device, torch.float32)
        if embeds.shape[0] != (2 if do_cfg else 1):
            raise ValueError("prompt embeddings do not match the guidance layout")
        state = SDJobState(
            latents=latents,
            mask=tensors["mask"].to(self.device, torch.float32),
            masked_image_latents=tensors["masked_image_latents"].to(self.device, torch.float32),
            prompt_embeds=embeds,
            do_cfg=do_cfg,
            guidance=float(meta["guidance"]),
            scheduler=scheduler,
            timesteps=timesteps,
            generator=generator,
        )
        self._init_cache_mode(state, tensors, meta)
        return state

    def _init_cache_mode(self, st: SDJobState, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
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
        if key.layout != self.maskaware.cache_layout:
            raise ValueError(f"cache layout {key.layout} does not match the worker's {self.maskaware.cache_layout}")
        if key.steps != len(st.timesteps) + int(meta["t_start"]) and key.steps != len(st.timesteps):
            raise ValueError("cache key steps do not match the job")
        st.mode, st.cache_key = mode, key
        if mode == "masked":
            latent_hw = (st.latents.shape[-2], st.latents.shape[-1])
            st.token_masks = self.maskaware.token_masks(tensors["pixel_mask"].bool(), latent_hw, self.dilation)
            self.caches.prefetch(key, range(self.prefetch_steps))  # type: ignore[union-attr]

    def prefetch(self, job: EngineJob) -> None:
        """Start loading the next steps' caches of a (waiting or running) masked job."""
        st: SDJobState = job.state
        if st.mode == "masked" and self.caches is not None and st.cache_key is not None:
            self.caches.prefetch(st.cache_key, range(job.steps_done, job.steps_done + self.prefetch_steps))

    def _group(self, job: EngineJob) -> RowGroup:
        st: SDJobState = job.state
        if st.mode == "record":
            return RowGroup(st.rows, "record")
        if st.mode == "masked":
            assert self.caches is not None and st.cache_key is not None
            cache = self.caches.ready(st.cache_key, job.steps_done)
            if cache is not None:
                return RowGroup(st.rows, "masked", token_mask=st.token_masks, cache=cache)
            st.extra["fallback_pending"] = True
        return RowGroup(st.rows, "full")

    def _model_input(self, job: EngineJob) -> tuple[torch.Tensor, torch.Tensor]:
        st: SDJobState = job.state
        t = st.timesteps[job.steps_done]
        x = torch.cat([st.latents] * 2) if st.do_cfg else st.latents
        x = st.scheduler.scale_model_input(x, t)
        x = torch.cat([x, st.mask, st.masked_image_latents], dim=1)
        return x, t.reshape(1).expand(st.rows)

    @torch.no_grad()
    def step(self, batch: list[EngineJob]) -> None:
        """One denoising step for every job of ``batch`` in a single UNet call."""
        if not batch:
            return
        inputs, times, embeds = [], [], []
        for job in batch:
            x, t = self._model_input(job)
            inputs.append(x)
            times.append(t)
            embeds.append(job.state.prompt_embeds)
        seq = {e.shape[1] for e in embeds}
        if len(seq) != 1:
            raise ValueError(f"prompt embeddings of different lengths in one batch: {sorted(seq)}")
        args = (torch.cat(inputs), torch.cat(times))
        kwargs = {"encoder_hidden_states": torch.cat(embeds), "return_dict": False}
        recorded: list[dict[str, torch.Tensor] | None] = []
        if self.maskaware is not None:
            groups = [self._group(job) for job in batch]
            with self.maskaware.batch(groups) as ctx:
                noise = self.unet(*args, **kwargs)[0]
            recorded = list(ctx.recorded)
        else:
            noise = self.unet(*args, **kwargs)[0]
        updates: list[tuple[SDJobState, torch.Tensor]] = []
        snapshots = [(job.state, dict(job.state.scheduler.__dict__), job.state.generator.get_state())
                     for job in batch]
        try:
            self._advance(batch, noise, updates)
        except Exception:
            # Schedulers such as Euler count steps internally: roll back so a retry is exact.
            for st, sched_dict, gen_state in snapshots:
                st.scheduler.__dict__.update(sched_dict)
                st.generator.set_state(gen_state)
            raise
        for st, new_latents in updates:
            st.latents = new_latents
        for i, job in enumerate(batch):
            st = job.state
            if st.mode == "masked":
                if st.extra.pop("fallback_pending", False):
                    st.fallback_steps += 1
                else:
                    st.masked_steps += 1
                self.prefetch(job)
            elif st.mode == "record" and recorded and recorded[i] is not None:
                assert self.recorder is not None and st.cache_key is not None
                step_index = int(job.steps_done)
                self.recorder.put(st.cache_key, step_index, recorded[i])  # type: ignore[arg-type]
                if step_index + 1 == len(st.timesteps):
                    st.commit = self.recorder.commit(st.cache_key)

    def _advance(self, batch: list[EngineJob], noise: torch.Tensor,
                 updates: list[tuple[SDJobState, torch.Tensor]]) -> None:
        row = 0
        for job in batch:
            st: SDJobState = job.state
            pred = noise[row:row + st.rows]
            row += st.rows
            if st.do_cfg:
                uncond, cond = pred.chunk(2)
                pred = uncond + st.guidance * (cond - uncond)
            t = st.timesteps[job.steps_done]
            kwargs = _step_kwargs(st.scheduler, st.generator)
            new_latents = st.scheduler.step(pred, t, st.latents, **kwargs, return_dict=False)[0]
            if not torch.isfinite(new_latents).all():
                raise FloatingPointError(f"job {job.job_id}: non-finite latents at step {job.steps_done}")
            updates.append((st, new_latents))

    def result(self, job: EngineJob) -> dict[str, Any]:
        st: SDJobState = job.state
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
