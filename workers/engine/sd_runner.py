"""Runner for SD-family inpainting UNets (SD 1.x/2.x and SDXL 9-channel UNets).

Each job keeps its own scheduler instance, timesteps, generator, mask and prompt embeddings; one
UNet call serves every job of the batch with a per-row timestep tensor. With classifier-free
guidance a job contributes two adjacent rows (uncond, cond), as the stock pipeline orders them.
Jobs with ControlNets get their residuals in the same call (``workers/controlnets/step.py``),
computed before the UNet or concurrently with its down path. Cache modes and the transactional
step are in ``runner_base``.

SDXL (a UNet with ``addition_embed_type="text_time"``): every job also brings its pooled text
embeddings and its time ids (original size, crop, target size or aesthetic score, computed by the
CPU task as ``StableDiffusionXLInpaintPipeline`` does), one per row, passed as
``added_cond_kwargs`` in the same row order as the latents.

Precision: every job tensor is computed in the UNet's dtype (``STENCIL_DTYPE``), as the stock
pipeline loaded with that ``torch_dtype`` does; the scheduler step and the guidance run in it too.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from diffusers import UNet2DConditionModel

from app.storage.hostcache import to_device
from workers.adapters import layout
from workers.compiled import Compiled
from workers.controlnets.step import Concurrent, JobControl, Use, residuals
from workers.engine.cache_codec import rows_equal
from workers.engine.graph_calls import graphable, unet_call
from workers.engine.graphs import step_graphs
from workers.engine.job import EngineJob
from workers.engine.runner_base import BaseRunner, JobState, job_rows
from workers.maskaware.lockstep import Lockstep
from workers.maskaware.unet import MaskAwareUNet, RowGroup
from workers.models.loader import make_scheduler

log = logging.getLogger(__name__)


# How a step with several image sizes makes its UNet calls (``mixed_size_calls``); the service takes
# ``auto``, ops/bench/mixed_sizes.py and ops/bench/mixing_cost.py take every value as an option.
MIXED_SIZE_CALLS = ("auto", "lockstep", "sequential")


def mixed_size_calls(mode: str, device: torch.device) -> str:
    """How a step runs its per-size UNet calls: ``lockstep`` packs
    every call's transformer-block tokens into one pass (fewer, larger kernels: what a GPU wants),
    ``sequential`` runs the calls one after the other on the engine's thread (no thread hand-offs at
    every block: cheaper where a batch costs the sum of its jobs, as on CPU; docs/bench/mixing_cost.md).
    ``auto``: lockstep on CUDA, sequential elsewhere."""
    if mode not in MIXED_SIZE_CALLS:
        raise ValueError(f"mixed-size calls must be one of {MIXED_SIZE_CALLS}, got {mode!r}")
    if mode == "auto":
        return "lockstep" if device.type == "cuda" else "sequential"
    return mode


def _rows_of(batch: list[EngineJob], idx: list[int]) -> Any:
    """The row layout of the jobs ``idx`` of ``batch`` alone (one size's call of a mixed step)."""
    return layout.row_groups(g for i in idx for g in [i] * batch[i].state.rows)


@dataclass
class SDJobState(JobState):
    mask: torch.Tensor | None = None
    masked_image_latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    add_text_embeds: torch.Tensor | None = None  # SDXL: pooled text embeddings, one row per UNet row
    add_time_ids: torch.Tensor | None = None  # SDXL: micro-conditioning ids, one row per UNet row
    do_cfg: bool = True
    guidance: float = 7.5
    controls: tuple[JobControl, ...] = ()

    @cached_property
    def mask_input(self) -> torch.Tensor:
        """The UNet's extra channels (mask, masked image latents): constant for the job, so
        concatenated once, not at every step."""
        return torch.cat([self.mask, self.masked_image_latents], dim=1)  # type: ignore[list-item]

    @property
    def rows(self) -> int:
        return 2 if self.do_cfg else 1


class SDRunner(BaseRunner):
    """Executes denoising steps of SD inpainting jobs on one device."""

    writable_caches = True  # MaskAwareUNet writes a step's fresh tokens into its staged cache

    def __init__(self, unet: UNet2DConditionModel, scheduler_config: dict[str, Any], device: str = "cpu",
                 *, maskaware: MaskAwareUNet | None = None, controlnets: Any = None,
                 controlnet_parallel: bool = False, compile: str = "off", mixed_sizes: str = "auto",
                 graphs: bool | None = None, **cache_options: Any) -> None:
        if unet.config.in_channels != 9:
            raise ValueError(f"an inpainting UNet has 9 input channels, this one has {unet.config.in_channels}")
        super().__init__(maskaware, **cache_options)
        self.unet = unet
        # STENCIL_COMPILE: the full forward compiled (steps without mask-aware work; workers/compiled.py)
        self.forward = Compiled(unet, "UNet forward", compile)
        self.scheduler_config = scheduler_config
        self.device = torch.device(device)
        self.dtype = unet.dtype
        self._init_invariance(unet, unet.dtype)
        self.text_time = unet.config.addition_embed_type == "text_time"  # SDXL's added conditioning
        if unet.config.addition_embed_type not in (None, "text_time"):
            raise ValueError(f"unsupported UNet addition_embed_type {unet.config.addition_embed_type!r}")
        self.controlnets = controlnets  # workers.controlnets.bank.ControlNetBank
        self.concurrent = Concurrent(unet) if controlnets is not None and controlnet_parallel else None
        self._pool: ThreadPoolExecutor | None = None  # threads of lockstep calls (mixed sizes)
        self.mixed_sizes = mixed_size_calls(mixed_sizes, self.device)
        # Steps replayed as CUDA graphs (``workers/engine/graphs.py``): on CUDA unless turned off.
        self.graphs = step_graphs(self.device, graphs, compile)
        resnets = getattr(maskaware, "resnets", None)
        if resnets is not None and self.graphs is not None:
            resnets.bucketed = True  # eager steps then compute what graph-replayed ones do

    def init_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> SDJobState:
        """Build a job's state from its prepared tensors (validated against the model)."""
        latents = to_device(tensors["latents"], self.device).to(self.dtype)
        if self.unet.config.in_channels != 2 * latents.shape[1] + 1:
            raise ValueError(f"latent channels {latents.shape[1]} do not fit the UNet's "
                             f"{self.unet.config.in_channels} inputs")
        # The schedule stays on the host (the scheduler's scalars are read there, never from the
        # device, ``workers/engine/stepper.py``); the model reads its timesteps from the device.
        scheduler = make_scheduler(self.scheduler_config)
        scheduler.set_timesteps(int(meta["t_start"]) + int(meta["num_steps"]), device="cpu")
        t_start = int(meta["t_start"]) * scheduler.order
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(t_start)
        generator = torch.Generator("cpu")
        generator.set_state(tensors["generator_state"])
        timesteps = scheduler.timesteps[t_start:]
        do_cfg = bool(meta["do_cfg"])
        rows = 2 if do_cfg else 1
        embeds = to_device(tensors["prompt_embeds"], self.device).to(self.dtype)
        if embeds.shape[0] != rows:
            raise ValueError("prompt embeddings do not match the guidance layout")
        added = self._added_cond(tensors, rows)
        state = SDJobState(
            latents=latents, scheduler=scheduler, timesteps=timesteps, generator=generator,
            model_times=to_device(timesteps, self.device),
            mask=to_device(tensors["mask"], self.device).to(self.dtype),
            masked_image_latents=to_device(tensors["masked_image_latents"], self.device).to(self.dtype),
            prompt_embeds=embeds, add_text_embeds=added[0], add_time_ids=added[1], do_cfg=do_cfg,
            guidance=float(meta["guidance"]),
            controls=self._controls(tensors, meta, 2 if do_cfg else 1),
        )
        self._init_cache_mode(state, tensors, meta)
        self._init_adapters(state, meta)
        return state

    def _added_cond(self, tensors: dict[str, torch.Tensor], rows: int) -> tuple[torch.Tensor | None, ...]:
        """SDXL's (pooled text embeddings, time ids) of a job, validated against the UNet; (None, None)
        for UNets without added conditioning."""
        has = "add_text_embeds" in tensors and "add_time_ids" in tensors
        if not self.text_time:
            if has:
                raise ValueError("the job was prepared for an SDXL UNet; this worker serves another model")
            return None, None
        if not has:
            raise ValueError("this worker serves an SDXL UNet: the job lacks its pooled text embeddings and time ids")
        text = to_device(tensors["add_text_embeds"], self.device).to(self.dtype)
        ids = to_device(tensors["add_time_ids"], self.device).to(self.dtype)
        want = self.unet.add_embedding.linear_1.in_features
        got = self.unet.config.addition_time_embed_dim * ids.shape[-1] + text.shape[-1]
        if text.shape[0] != rows or ids.shape[0] != rows or got != want:
            raise ValueError(f"SDXL added conditioning does not fit the UNet: rows {text.shape[0]}/{ids.shape[0]} "
                             f"(want {rows}), embedding width {got} (want {want})")
        return text, ids

    def _controls(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], rows: int) -> tuple[JobControl, ...]:
        specs = meta.get("controls") or ()
        if specs and self.controlnets is None:
            raise ValueError("this worker serves no ControlNets")
        if specs and self.text_time:
            raise ValueError("ControlNets are served for SD 1.x/2.x UNets only, not SDXL")
        out = []
        for i, (controlnet_id, scale, start, end) in enumerate(specs):
            image = to_device(tensors[f"control{i}"], self.device).to(self.dtype)
            if image.shape[0] != rows:
                raise ValueError(f"control image {i} has {image.shape[0]} rows, the job {rows}")
            out.append(JobControl(str(controlnet_id), image, float(scale), float(start), float(end)))
        if out:
            self.controlnets.prefetch({c.controlnet_id for c in out}, count=False)
        return tuple(out)

    def ready(self, job: EngineJob) -> bool:
        """Adapters (``BaseRunner.ready``) and ControlNets resident before a job is admitted."""
        st: SDJobState = job.state
        if st.controls:
            ids = {c.controlnet_id for c in st.controls}
            why = self.controlnets.failure(ids)
            if why:
                raise RuntimeError(why)
            if not self.controlnets.ready(ids):
                self.controlnets.prefetch(ids, count=False)
                return False
            if "controlnets" not in st.extra:  # held from admission to the end: never evicted mid-job
                st.extra["controlnets"] = {i: self.controlnets.get(i) for i in ids}
        return super().ready(job)

    def _control_kwargs(self, batch: list[EngineJob], sample: torch.Tensor, times: torch.Tensor,
                        embeds: torch.Tensor) -> dict[str, Any]:
        """The UNet's residual arguments for this step (empty when no job's ControlNet is on)."""
        uses, row = [], 0
        for job in batch:
            st: SDJobState = job.state
            for k, c in enumerate(st.controls):
                factor = c.factor(job.steps_done, len(st.timesteps))
                if factor != 0.0:
                    uses.append(Use(k, c.controlnet_id, row, st.rows, c.image, factor))
            row += st.rows
        if not uses:
            return {}
        models = {i: m for job in batch for i, m in job.state.extra.get("controlnets", {}).items()}

        def compute() -> tuple[list[torch.Tensor], torch.Tensor]:
            return residuals(models.__getitem__, sample, times, embeds, uses)

        if self.concurrent is not None:
            return self.concurrent.submit(compute)
        down, mid = compute()
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}

    def _token_masks(self, st: JobState, tensors: dict[str, torch.Tensor]) -> Any:
        latent_hw = (st.latents.shape[-2], st.latents.shape[-1])
        masks = self.maskaware.token_masks(tensors["pixel_mask"].bool(), latent_hw, self.dilation)
        return masks.with_buckets() if self.bucket_tokens else masks

    def _row_group(self, rows: int, mode: str, token_mask: Any = None, cache: Any = None) -> RowGroup:
        return RowGroup(rows, mode, token_mask=token_mask, cache=cache)  # type: ignore[arg-type]

    def _forward(self, batch: list[EngineJob], groups: list[Any] | None) -> tuple[Any, list[Any]]:
        """One UNet call for the batch; jobs of different latent sizes: one call per size (exact,
        nothing padded or cropped), run in lockstep so that the transformer blocks still pack every
        job's tokens (``workers/maskaware/lockstep.py``) or one after the other (``mixed_sizes``)."""
        shapes: dict[tuple[int, ...], list[int]] = {}
        for i, job in enumerate(batch):
            shapes.setdefault(tuple(job.state.latents.shape[-2:]), []).append(i)
        if len(shapes) == 1:
            out, recorded = self._call(batch, groups)
            return out, recorded
        parts = list(shapes.values())
        if groups is None:  # no mask-aware hooks: one call per size (batched within each size)
            results = []
            for idx in parts:
                out, recorded = self._call([batch[i] for i in idx], None)
                results.append((self._owned(out), recorded))
        else:
            for gid, grp in enumerate(groups):  # each job's key in its call's layouts: its batch index
                grp.gid = gid
            if self.mixed_sizes == "lockstep":
                results = self._lockstep_calls(batch, groups, parts)
            else:  # one size after the other on this thread: no thread hand-offs
                rows = layout.current()
                results = []
                for idx in parts:
                    with layout.use(_rows_of(batch, idx) if rows else None):
                        out, recorded = self._call([batch[i] for i in idx], [groups[i] for i in idx])
                    results.append((self._owned(out), recorded))
        self.last_ctx = None  # per-unit timings of one size's call (lockstep: with waits): not the step's
        per_job: dict[int, tuple[torch.Tensor, Any]] = {}
        for idx, (out, recorded) in zip(parts, results):
            row = 0
            for k, i in enumerate(idx):
                rows = batch[i].state.rows
                per_job[i] = (out[row:row + rows], recorded[k] if recorded else None)
                row += rows
        # Rows of different sizes do not stack: one output per job, in batch order.
        return [per_job[i][0] for i in range(len(batch))], [per_job[i][1] for i in range(len(batch))]

    def _lockstep_calls(self, batch: list[EngineJob], groups: list[Any], parts: list[list[int]]) -> list[Any]:
        """One call per size (``parts``: batch indices), each on a lockstep thread that carries the
        step's layout flags and its own jobs' rows."""
        wanted, invariant, rows = layout.wanted(), layout.invariant(), layout.current()

        def call(idx: list[int]):  # type: ignore[no-untyped-def]
            def run():  # type: ignore[no-untyped-def]
                layout.set_wanted(wanted)  # thread-local: the step's flags, on this thread too
                layout.set_invariant(invariant)
                try:
                    with layout.use(_rows_of(batch, idx) if rows else None):
                        return self._call([batch[i] for i in idx], [groups[i] for i in idx], lockstep=True)
                finally:
                    layout.set_wanted(False)
                    layout.set_invariant(False)
            return run

        return Lockstep(self._lockstep_pool()).run([call(idx) for idx in parts])

    def _lockstep_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="stencil-lockstep")
        return self._pool

    def _call(self, batch: list[EngineJob], groups: list[Any] | None,
              lockstep: bool = False) -> tuple[torch.Tensor, list[Any]]:
        """One UNet call over jobs of one latent size."""
        latents, masks, times, embeds, add_text, add_ids = [], [], [], [], [], []
        for job in batch:
            st: SDJobState = job.state
            if st.stepper.scales_input:
                x = torch.cat([st.latents] * 2) if st.do_cfg else st.latents
                latents.append(st.stepper.scale_input(x, job.steps_done))
            else:  # the latents go into the batch's one concatenation as they are, once per row
                latents += [st.latents] * st.rows
            masks.append(st.mask_input)
            times.append(st.model_times[job.steps_done].reshape(1).expand(st.rows))  # type: ignore[index]
            embeds.append(st.prompt_embeds)
            if self.text_time:
                add_text.append(st.add_text_embeds)
                add_ids.append(st.add_time_ids)
        if len({e.shape[1] for e in embeds}) != 1:
            raise ValueError("prompt embeddings of different lengths in one batch")
        sample, t_rows, text = torch.cat(latents), torch.cat(times), torch.cat(embeds)
        kwargs: dict[str, Any] = {"encoder_hidden_states": text, "return_dict": False}
        if self.text_time:
            kwargs["added_cond_kwargs"] = {"text_embeds": torch.cat(add_text), "time_ids": torch.cat(add_ids)}
        kwargs.update(self._control_kwargs(batch, sample, t_rows, text))
        args = (torch.cat([sample, torch.cat(masks)], dim=1), t_rows)
        if self.graphs is not None and not lockstep and self._graphable(groups, kwargs):
            out, recorded = unet_call(self.graphs, self.unet, self.maskaware, args, kwargs, groups, self.device,
                                      horizon=min(job.total_steps - job.steps_done for job in batch))
            if self.graphs.last == "eager":  # the call ran eagerly: its tensors are its own
                return out, recorded
            # the graph's buffers: a refresh's activations outlive the step (its anchor, the cache)
            return out, [None if r is None else {k: v.clone() for k, v in r.items()} for r in recorded]
        try:
            # ControlNets computed concurrently with the down path hook the UNet's forward: eager
            forward = self.forward if self.concurrent is None else self.unet
            if groups is None:
                return forward(*args, **kwargs)[0], []
            if self.forward.active and self.concurrent is None and not lockstep and not layout.wanted() \
                    and all(g.mode == "full" for g in groups):
                # every job computes fully: the hooks would only pass through; the compiled forward
                return self.forward(*args, **kwargs)[0], [None] * len(groups)
            with self.maskaware.batch(groups) as ctx:
                out = self.unet(*args, **kwargs)[0]
        except Exception:
            if self.concurrent is not None:
                self.concurrent.abandon()
            raise
        if not lockstep:
            self.last_ctx = ctx  # per-unit timings for the plan's cost model
        return out, list(ctx.recorded)

    def _graphable(self, groups: list[Any] | None, kwargs: dict[str, Any]) -> bool:
        """Whether this call may replay a CUDA graph (``graph_calls.graphable``), and nothing per
        step lives outside tensors: no ControlNet residuals, no per-job adapter terms."""
        return (not layout.wanted() and "down_block_additional_residuals" not in kwargs
                and not self.weights_swapped() and graphable(groups, record=True))

    def _rows_alike(self, st: JobState) -> bool:
        """CFG rows get bit-equal inputs when the prompt's and the negative prompt's conditioning
        are bit-equal (template warm-ups: both ""): latents, mask and timestep are shared."""
        if not isinstance(st, SDJobState) or not st.do_cfg:
            return False
        per_row = [st.prompt_embeds, st.add_text_embeds, st.add_time_ids, *(c.image for c in st.controls)]
        return all(rows_equal(t) for t in per_row if t is not None)

    def _guided_batch(self, batch: list[EngineJob], output: Any) -> list[torch.Tensor]:
        """``uncond + guidance * (cond - uncond)`` per CFG job, as the stock pipeline computes it,
        in three multi-tensor launches for the whole batch instead of three per job (the same
        operations on the same operands: bit-equal)."""
        preds = list(job_rows(batch, output))
        cfg = [i for i, job in enumerate(batch) if job.state.do_cfg]
        if cfg:
            unconds, conds = zip(*(preds[i].chunk(2) for i in cfg))
            diffs = torch._foreach_sub(conds, unconds)
            # out of place: the in-place list form rounds a scalar to bfloat16 first on the CPU
            scaled = torch._foreach_mul(diffs, [batch[i].state.guidance for i in cfg])
            for i, pred in zip(cfg, torch._foreach_add(unconds, scaled)):
                preds[i] = pred
        return preds
