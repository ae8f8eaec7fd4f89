"""Runner for Flux Fill transformers (``FluxTransformer2DModel``, 384 input channels).

One transformer call per step for the whole batch: packed latents concatenated with each job's
masked-image latents and mask, per-row timestep and guidance, per-row pooled and text
embeddings. Jobs of different image sizes share the call too: the stock forward takes one dense
input and one ``img_ids``, so each job's tokens are placed on the union of their token grids (its
token at (y, x) where the larger grid has (y, x): RoPE at its own positions) and the mask-aware
plan computes and attends to each job's own tokens only (``RowGroup.positions``); padding is never
computed. Cache modes and the transactional step are in ``runner_base``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from app.storage.hostcache import to_device
from workers.adapters import layout
from workers.compiled import Compiled
from workers.engine.graph_calls import flux_call, graphable
from workers.engine.graphs import step_graphs
from workers.engine.job import EngineJob
from workers.engine.runner_base import BaseRunner, JobState, job_rows
from workers.flux_inputs import flux_schedule
from workers.maskaware.flux import MaskAwareFlux, RowGroup

log = logging.getLogger(__name__)


@dataclass
class FluxJobState(JobState):
    masked_image_latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    text_ids: torch.Tensor | None = None
    image_ids: torch.Tensor | None = None
    grid: tuple[int, int] = (0, 0)  # the token grid (packed 2x2 latents), read from the host's ids once
    guidance: float = 30.0
    guidance_t: torch.Tensor | None = None  # ``guidance`` on the compute device (one row)


class FluxRunner(BaseRunner):
    def __init__(self, transformer: FluxTransformer2DModel, scheduler_config: dict[str, Any], vae_scale_factor: int,
                 device: str = "cpu", *, maskaware: MaskAwareFlux | None = None, compile: str = "off",
                 graphs: bool | None = None, **cache_options: Any) -> None:
        super().__init__(maskaware, **cache_options)
        self.transformer = transformer
        self.dtype = transformer.dtype
        self._init_invariance(transformer, transformer.dtype)
        # STENCIL_COMPILE: the full forward compiled (steps without mask-aware work; workers/compiled.py)
        self.forward = Compiled(transformer, "Flux transformer forward", compile)
        self.scheduler_config = scheduler_config
        self.vae_scale_factor = vae_scale_factor
        self.device = torch.device(device)
        # Steps replayed as CUDA graphs (``workers/engine/graphs.py``): on CUDA unless turned off.
        self.graphs = step_graphs(self.device, graphs, compile)
        self._grid_ids_memo: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    writable_caches = True  # MaskAwareFlux writes a step's fresh K/V (and output) into its staged cache

    def init_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> FluxJobState:
        if meta.get("family") != "flux":
            raise ValueError("this worker serves Flux Fill models; the job was prepared for another family")
        dtype = self.dtype  # STENCIL_DTYPE: job tensors in the model's dtype, as the stock pipeline
        latents = to_device(tensors["latents"], self.device).to(dtype)
        cond = to_device(tensors["masked_image_latents"], self.device).to(dtype)
        if latents.shape[-1] + cond.shape[-1] != self.transformer.config.in_channels:
            raise ValueError("job tensors do not fit the transformer's input channels")
        steps = int(meta["t_start"]) + int(meta["num_steps"])
        scheduler, timesteps, _t0, _s, _mu = flux_schedule(self.scheduler_config, steps, int(meta["height"]),
                                                          int(meta["width"]), self.vae_scale_factor, 1.0)
        t_start = int(meta["t_start"]) * scheduler.order
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(t_start)
        generator = torch.Generator("cpu")
        generator.set_state(tensors["generator_state"])
        state = FluxJobState(
            latents=latents, scheduler=scheduler, timesteps=scheduler.timesteps[t_start:], generator=generator,
            model_times=to_device(scheduler.timesteps[t_start:], self.device),
            guidance_t=to_device(torch.tensor([float(meta["guidance"])], dtype=torch.float32), self.device),
            masked_image_latents=cond, prompt_embeds=to_device(tensors["prompt_embeds"], self.device).to(dtype),
            pooled=to_device(tensors["pooled_prompt_embeds"], self.device).to(dtype),
            text_ids=to_device(tensors["text_ids"], self.device),
            image_ids=to_device(tensors["image_ids"], self.device),
            grid=(int(tensors["image_ids"][:, 1].max()) + 1, int(tensors["image_ids"][:, 2].max()) + 1),
            guidance=float(meta["guidance"]))
        self._init_cache_mode(state, tensors, meta)
        self._init_adapters(state, meta)
        return state

    def latent_hw(self, st: FluxJobState) -> tuple[int, int]:
        """The job's token grid (packed 2x2 latents): the size the step-time predictor sees."""
        return st.grid  # from the host's ids: reading the device's would wait for the GPU's queue

    def _token_masks(self, st: JobState, tensors: dict[str, torch.Tensor]) -> Any:
        return self.maskaware.prepared(self.maskaware.token_mask(tensors["pixel_mask"].bool(), self.dilation),
                                       self.device, self.bucket_tokens)

    def _row_group(self, rows: int, mode: str, token_mask: Any = None, cache: Any = None) -> RowGroup:
        return RowGroup(rows, mode, token_mask=token_mask, cache=cache)  # type: ignore[arg-type]

    def _forward(self, batch: list[EngineJob], groups: list[Any] | None) -> tuple[Any, list[Any]]:
        states: list[FluxJobState] = [job.state for job in batch]
        if len({s.prompt_embeds.shape[1] for s in states}) != 1:
            raise ValueError("Flux jobs with text of different lengths in one batch")
        times = torch.stack([s.model_times[job.steps_done] for s, job in zip(states, batch)])  # type: ignore[index]
        if len({s.latents.shape[1] for s in states}) == 1:
            hidden = _packed_inputs(states)
            horizon = min(job.total_steps - job.steps_done for job in batch)  # steps this batch can last
            return self._call(states, hidden, times, states[0].image_ids, groups, horizon)
        if groups is None:  # no mask-aware plan to skip padding: one call per size
            outs: list[Any] = [None] * len(batch)
            by_n: dict[int, list[int]] = {}
            for i, s in enumerate(states):
                by_n.setdefault(s.latents.shape[1], []).append(i)
            for idx in by_n.values():
                sub = [states[i] for i in idx]
                hidden = _packed_inputs(sub)
                out, _ = self._call(sub, hidden, times[idx], sub[0].image_ids, None)
                out = self._owned(out)
                for k, i in enumerate(idx):
                    outs[i] = out[k:k + 1]
            return outs, []
        grid_h, grid_w = max(s.grid[0] for s in states), max(s.grid[1] for s in states)
        positions = [(s.image_ids[:, 1] * grid_w + s.image_ids[:, 2]).long() for s in states]
        channels = states[0].latents.shape[2] + states[0].masked_image_latents.shape[2]
        hidden = torch.zeros(len(states), grid_h * grid_w, channels, dtype=states[0].latents.dtype, device=self.device)
        for k, (s, pos) in enumerate(zip(states, positions)):
            hidden[k, pos] = torch.cat((s.latents, s.masked_image_latents), dim=2)[0]
        ids = self._grid_ids(grid_h, grid_w, states[0].image_ids.dtype)
        groups = [dataclasses.replace(g, positions=pos) for g, pos in zip(groups, positions)]
        out, recorded = self._call(states, hidden, times, ids, groups)
        return [out[k:k + 1, pos] for k, pos in enumerate(positions)], recorded

    def _grid_ids(self, grid_h: int, grid_w: int, dtype: torch.dtype) -> torch.Tensor:
        """The image ids of a whole grid on the device, made once per grid (diffusers builds them on
        the host: copied every step, each copy would wait for the GPU's queue)."""
        key = (grid_h, grid_w, dtype)
        ids = self._grid_ids_memo.get(key)
        if ids is None:
            host = FluxPipeline._prepare_latent_image_ids(1, grid_h, grid_w, torch.device("cpu"), dtype)
            ids = self._grid_ids_memo[key] = to_device(host, self.device)
        return ids

    def _call(self, states: list[FluxJobState], hidden: torch.Tensor, times: torch.Tensor, img_ids: torch.Tensor,
              groups: list[Any] | None, horizon: int | None = None) -> tuple[torch.Tensor, list[Any]]:
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.cat([s.guidance_t for s in states])  # type: ignore[misc]
        kwargs = dict(hidden_states=hidden, timestep=times.to(hidden.dtype) / 1000, guidance=guidance,
                      pooled_projections=torch.cat([s.pooled for s in states]),
                      encoder_hidden_states=torch.cat([s.prompt_embeds for s in states]),
                      txt_ids=states[0].text_ids, img_ids=img_ids, return_dict=False)
        if self.graphs is not None and not layout.wanted() and not self.weights_swapped() and graphable(groups):
            out = flux_call(self.graphs, self.transformer, self.maskaware, kwargs, groups, horizon)
            return out, [None] * len(groups or ())
        if groups is None:
            return self.forward(**kwargs)[0], []
        if self.forward.active and not layout.wanted() and all(g.mode == "full" and g.positions is None
                                                               for g in groups):
            # every job computes fully over its own grid: the hooks would only pass through
            return self.forward(**kwargs)[0], [None] * len(groups)
        with self.maskaware.batch(groups) as ctx:
            out = self.transformer(**kwargs)[0]
        return out, list(ctx.recorded)

    def _guided_batch(self, batch: list[EngineJob], output: Any) -> list[torch.Tensor]:
        return job_rows(batch, output)  # Flux Fill's guidance is embedded (distilled), not classifier-free


def _packed_inputs(states: list[FluxJobState]) -> torch.Tensor:
    """The transformer's input rows, each job's latents beside its masked-image latents: three
    concatenations for the batch (the same copy as one pair per job, without a kernel per job)."""
    if len(states) == 1:
        return torch.cat((states[0].latents, states[0].masked_image_latents), dim=2)
    return torch.cat((torch.cat([s.latents for s in states]), torch.cat([s.masked_image_latents for s in states])),
                     dim=2)
