"""Mask-aware computation for SD-family ``UNet2DConditionModel`` (SD1.x/2.x, SDXL-style).

One ``MaskAwareUNet`` installs a diffusers ``ModelHook`` on every ``BasicTransformerBlock`` (and,
when K/V are cached, a capture hook on each block's ``attn1.to_k`` / ``attn1.to_v``). No model file
is forked; ResNets, convs, GroupNorm, ``proj_in``/``proj_out`` run unchanged on the full map.

API::

    ctrl = MaskAwareUNet(unet, kv_source="cache")      # installs hooks once; ctrl.remove() undoes
    ctrl.block_names -> list[str]                      # module paths, unique on SDXL-style nets
    tm = ctrl.token_masks(pixel_or_latent_mask, latent_hw, dilation=0) -> TokenMasks
    groups = [RowGroup(2, "record"),                   # rows are consecutive, in batch order
              RowGroup(2, "masked", token_mask=tm, cache=step_cache),
              RowGroup(1, "full")]
    with ctrl.batch(groups) as ctx:                    # exactly one UNet call per context
        eps = unet(sample, t_per_row, encoder_hidden_states).sample
    ctx.recorded[0] -> dict[str, Tensor]               # this step's cache for group 0 ([rows, N, C])
    ctrl.cache_nbytes(latent_height, latent_width, rows, steps=1, dtype=None) -> int

Without an active ``batch`` context the hooks pass straight through to the original forward.
One thread (the engine's) drives a controller; ``batch`` is not re-entrant.

Per group of rows (one job: 1 row, or 2 adjacent rows ``(uncond, cond)`` with CFG):
- ``full``: normal compute. ``record``: normal compute, and capture what ``masked`` needs.
- ``masked``: only the group's masked tokens enter every token-wise layer of each block (norm1,
  Q/K/V, attention output, norm2, cross-attention, norm3, feed-forward); masked tokens of all masked
  groups are packed into one ``[P, C]`` tensor for those layers (ragged batch), and attention runs
  per group with SDPA (queries: its masked tokens; keys: all N tokens of its own rows). Unmasked
  tokens take their values from the group's read-only cache: the cached tensor is copied and the
  fresh rows are scattered into the copy. A group whose level mask is full is routed through the
  original forward (ratio 1 == full compute, bit for bit); an empty level mask computes nothing.
  Jobs staged into one buffer go batch-wide (``batched.py``): one gather, one scatter per cached
  tensor, attention per run of close counts, or, where the device has a variable-length attention
  kernel (``ragged``: CUDA), one call per block for every row (``varlen.py``).

Cache layout (the design choice; DESIGN.md section 6 measured both):
- ``kv_source="cache"`` (default, layout ``"kv+y"``): per block, self-attention K and V of all
  tokens (outputs of ``to_k``/``to_v``), plus the block output Y for the *last* block of each
  ``Transformer2DModel`` (the only block output a full-map op, ``proj_out``, reads). Inner blocks
  never need unmasked tokens' hidden states, because their K/V come from the cache.
- ``kv_source="recompute"`` (layout ``"y"``): per block only Y; a masked block runs norm1 +
  ``to_k``/``to_v`` on all tokens of its rows (inputs: fresh ``proj_in`` output, or the previous
  block's output completed from its cached Y) and everything else on masked tokens only.
  A third (SD1.x, one block per transformer) to under half (SDXL) of the bytes, but about 1.5x
  the transformer-block time at r = 0.05 and 1.2x at r = 0.2 (docs/bench/maskaware_unet.md).
  Default ``"cache"`` follows the measurements (DESIGN.md section 6 and ours); pick
  ``"recompute"`` where cache bytes (host-RAM LRU capacity, load bandwidth) are the bottleneck.

Cache size per template (bytes), ``dtype`` bytes ``s``, ``rows`` = 2 with CFG:
    steps * rows * s * sum_over_blocks( n_tensors(block) * N_level(block) * C(block) )
with ``n_tensors`` = 2 + [block is last in its transformer] for ``"kv+y"`` and 1 for ``"y"``;
``N_level`` = tokens at the block's level (latent halved with ceil per down level), ``C`` = width.
Tensor names: ``"<block path>.k"``, ``"<block path>.v"``, ``"<block path>.y"``. Stored with a cache
codec (``STENCIL_CACHE_DTYPE``, ``workers/engine/cache_codec.py``): ``s`` = 4 (float32), 2 (float16,
bfloat16); int8: K/V take ``N + 4`` bytes per channel per row (values + a float32 scale), Y 2 bytes
per value (``cache_nbytes(..., codec=...)``). Shared CFG rows (``cache_codec.share_rows``): a tensor
whose rows are bit-equal is stored with one row, so a template warm-up (prompt "" and negative
prompt "": every tensor shared) takes ``rows`` = 1 in the formula (``cache_nbytes(...,
shared=tensor_names())``).

Units (the granularity of the load/compute plan, ``workers/engine/plan.py``): one unit per
``Transformer2DModel`` (module path, e.g. ``"down_blocks.1.attentions.0"``), holding the tensors of
all its blocks. Why not per ``BasicTransformerBlock``: with the ``"kv+y"`` layout an inner block's
output is not cached, so a block computing all tokens after a masked block would read garbage at
unmasked tokens; a whole transformer computing fully reads only ``proj_in`` of the full map and
writes every token of its ``proj_out`` input, so downstream units get correct inputs either way.
On SD1.x/2.x a unit is exactly one block. A masked group computes every block of the units in
``RowGroup.full_units`` on all its tokens (its cache for those units is never read, so it need
not be loaded). If the group's cache has ``acquire_unit(unit) -> bool`` (a cache being loaded
block by block, ``workers/engine/template_cache.py``), it is asked once per unit, when the unit's
first block runs; False means "not resident (in time)": the unit computes fully for that group.
Each ``batch`` context measures the seconds and computed token rows of every unit
(``ctx.unit_seconds``, ``ctx.unit_tokens``): the engine's online cost model for the plan. On CUDA
they are CUDA events, turned into seconds after the step (``ctx.resolve_timings()``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from workers.adapters import layout
from workers.adapters.patcher import install as install_row_aware
from workers.compiled import BlockKernels
from workers.fused_projections import fuse, unfuse
from workers.maskaware import varlen
from workers.maskaware.batched import BatchIndex, IndexMemo, LevelIndex, Member
from workers.maskaware.lockstep import Lockstep
from workers.maskaware.resnets import UNIT as RESNETS_UNIT
from workers.maskaware.resnets import MaskedResnets
from workers.maskaware.reuse import UnitReuse
from workers.maskaware.tokens import TokenMasks, build_token_masks, row_index

log = logging.getLogger(__name__)

Mode = Literal["full", "record", "masked"]
KVSource = Literal["cache", "recompute"]
ResnetMode = Literal["full", "masked"]
_BLOCK_HOOK = "stencil_maskaware_block"
_CAPTURE_HOOK = "stencil_maskaware_capture"
_SUPPORTED_PROCESSORS = (AttnProcessor2_0, AttnProcessor)


@dataclass
class RowGroup:
    """Consecutive batch rows of one job, and how to compute them this step."""

    rows: int
    mode: Mode = "full"
    token_mask: TokenMasks | None = None
    cache: Mapping[str, torch.Tensor] | None = None  # read-only, this group's current step
    full_units: frozenset[str] = frozenset()  # masked mode: these units compute every token
    gid: int = -1  # the job's group index in the whole step (several calls in lockstep); -1: its index here
    reuse: Any = None  # masked mode: ``reuse.TemporalReuse`` of the job (patches taken from its last step)


@dataclass
class _BlockInfo:
    name: str
    module: BasicTransformerBlock
    level: int
    needs_y: bool  # a full-map consumer reads this block's unmasked outputs
    signature: inspect.Signature
    unit: str = ""  # path of the Transformer2DModel holding the block (the plan's granularity)


@dataclass
class _MaskedGroup:
    g: int
    start: int
    rows: int
    idx: torch.Tensor | None  # None where the call's batch index serves the level
    m: int


@dataclass
class _Plan:
    """How one block call at a given token count splits the batch."""

    full_rows: torch.Tensor | None  # None: every row takes the original forward
    full_groups: list[tuple[int, int]]  # (group, rows) of the full sub-batch, in order (adapter row layout)
    record: list[tuple[int, int, int]]  # (group, position in the full sub-batch, rows)
    masked: list[_MaskedGroup]
    empty: list[tuple[int, int, int]]  # (group, start, rows) with no masked token at this level
    batched: LevelIndex | None = None  # the masked groups' batch-wide indices (``batched.py``)


@dataclass
class BatchContext:
    """State of one UNet call: the row groups, per-level plans and what record groups captured."""

    groups: list[RowGroup]
    starts: list[int]
    total_rows: int
    recorded: list[dict[str, torch.Tensor] | None]
    _plans: dict[tuple[int, str, frozenset[int]], _Plan] = field(default_factory=dict)
    unit_full: dict[tuple[int, str], bool] = field(default_factory=dict)  # (group, unit) -> full?
    unit_seconds: dict[str, float] = field(default_factory=dict)  # measured, per unit
    unit_tokens: dict[str, int] = field(default_factory=dict)  # token rows computed, per unit
    unit_wait: dict[str, float] = field(default_factory=dict)  # of unit_seconds: waiting for loads
    unit_gap: dict[str, float] = field(default_factory=dict)  # other compute before each unit
    carry: dict[str, "_Carry"] = field(default_factory=dict)  # unit -> packed tokens between its blocks
    device_timed: bool = False  # timestamps are CUDA events, turned into seconds by ``resolve_timings``
    index: BatchIndex | None = None  # batch-wide token indices of every level (``batched.py``)
    extents: dict = field(default_factory=dict)  # ragged levels' int32 query extents (``varlen.py``)
    resnet_plan: Any = None  # how mask-aware ResNets compute this call (``resnets.ResnetPlan``), built at first use
    _unit_t0: dict[str, Any] = field(default_factory=dict)
    _last_end: Any = None
    _spans: list[tuple[dict[str, float], str, Any, Any]] = field(default_factory=list)  # pending (CUDA)

    def stamp(self) -> Any:
        """Now: host seconds, or a CUDA event recorded on the current stream (no synchronisation)."""
        if not self.device_timed:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add_span(self, into: dict[str, float], unit: str, start: Any, end: Any) -> None:
        if self.device_timed:
            self._spans.append((into, unit, start, end))
        else:
            into[unit] = into.get(unit, 0.0) + end - start

    def resolve_timings(self) -> None:
        """Device-timed spans into ``unit_seconds`` / ``unit_gap``: call once the step's work has
        completed (the engine's one read per step), never inside it."""
        for into, unit, start, end in self._spans:
            into[unit] = into.get(unit, 0.0) + start.elapsed_time(end) / 1e3
        self._spans.clear()

    def forced_full(self, unit: str) -> frozenset[int]:
        """Masked groups computing every token of ``unit`` (plan choice or cache not resident)."""
        out = []
        for g, grp in enumerate(self.groups):
            if grp.mode != "masked":
                continue
            key = (g, unit)
            if key not in self.unit_full:
                full = unit in grp.full_units
                if not full:
                    acquire = getattr(grp.cache, "acquire_unit", None)
                    if acquire is not None:
                        t0 = time.perf_counter()
                        full = not acquire(unit)
                        self.unit_wait[unit] = self.unit_wait.get(unit, 0.0) + time.perf_counter() - t0
                self.unit_full[key] = full
            if self.unit_full[key]:
                out.append(g)
        return frozenset(out)

    def plan(self, n: int, device: torch.device, forced: frozenset[int] = frozenset()) -> _Plan:
        key = (n, str(device), forced)
        if key not in self._plans:
            self._plans[key] = self._make_plan(n, device, forced)
        return self._plans[key]

    def _make_plan(self, n: int, device: torch.device, forced: frozenset[int]) -> _Plan:
        full: list[int] = []
        full_groups: list[tuple[int, int]] = []
        record: list[tuple[int, int, int]] = []
        masked: list[_MaskedGroup] = []
        empty: list[tuple[int, int, int]] = []
        level = self.index.levels.get((n, forced)) if self.index is not None else None
        padded_m = iter(m for _g, _s, _r, m in level.members) if level is not None else None
        for g, (grp, s) in enumerate(zip(self.groups, self.starts)):
            if grp.mode == "masked" and g not in forced:
                assert grp.token_mask is not None
                m = grp.token_mask.count(n)
                if m == 0:
                    empty.append((g, s, grp.rows))
                    continue
                if m < n:
                    if padded_m is not None:  # the batch index's count: padded to its run
                        masked.append(_MaskedGroup(g, s, grp.rows, None, next(padded_m)))
                    else:
                        masked.append(_MaskedGroup(g, s, grp.rows, grp.token_mask.indices(n, device), m))
                    continue
            if grp.mode == "record":
                record.append((g, len(full), grp.rows))
            full.extend(range(s, s + grp.rows))
            full_groups.append((g, grp.rows))
        all_full = len(full) == self.total_rows
        rows = None if all_full else row_index(tuple(full), device)
        if level is not None and [mg.g for mg in masked] != [g for g, *_ in level.members]:
            raise RuntimeError(f"batch index of level {n} does not match the call's masked groups")
        return _Plan(rows, full_groups, record, masked, empty, level)

    def computed_tokens(self, plan: _Plan, n: int) -> int:
        """Token rows that enter the token-wise layers of a block under ``plan``."""
        full_rows = self.total_rows if plan.full_rows is None else int(plan.full_rows.numel())
        return full_rows * n + sum(mg.rows * mg.m for mg in plan.masked)


class _BlockHook(ModelHook):
    """Routes a ``BasicTransformerBlock`` call through the controller (house style: FBC hooks)."""

    def __init__(self, ctrl: "MaskAwareUNet", info: _BlockInfo) -> None:
        super().__init__()
        self.ctrl = ctrl
        self.info = info

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.ctrl._block_forward(self.info, self.fn_ref.original_forward, args, kwargs)


class _CaptureHook(ModelHook):
    """Keeps the output of ``attn1.to_k``/``to_v`` while the controller records a block."""

    def __init__(self, ctrl: "MaskAwareUNet", slot: str) -> None:
        super().__init__()
        self.ctrl = ctrl
        self.slot = slot

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        if self.ctrl._capture is not None:
            self.ctrl._capture[self.slot] = output
        return output


def _check_attention(name: str, attn: Attention, cross: bool) -> None:
    """Masked path re-implements AttnProcessor2_0's math: refuse anything it would not match."""
    problems = []
    if type(attn.processor) not in _SUPPORTED_PROCESSORS:  # subclasses may change the math
        problems.append(f"processor {type(attn.processor).__name__}")
    for attr in ("spatial_norm", "group_norm", "norm_q", "norm_k"):
        if getattr(attn, attr, None) is not None:
            problems.append(attr)
    if cross and attn.norm_cross is not None:
        problems.append("norm_cross")
    if attn.residual_connection or getattr(attn, "fused_projections", False):
        problems.append("residual_connection/fused_projections")
    head_dim = attn.to_k.out_features // attn.heads
    if not math.isclose(attn.scale, head_dim**-0.5):
        problems.append("non-default scale")
    if problems:
        raise ValueError(f"{name}: unsupported attention config for mask-aware compute: {problems}")


def _check_block(name: str, blk: BasicTransformerBlock) -> None:
    if blk.norm_type != "layer_norm" or blk.pos_embed is not None or blk.only_cross_attention \
            or blk.double_self_attention or hasattr(blk, "fuser"):
        raise ValueError(f"{name}: only plain layer_norm SD/SDXL transformer blocks are supported")
    _check_attention(f"{name}.attn1", blk.attn1, cross=False)
    if blk.attn2 is not None:
        _check_attention(f"{name}.attn2", blk.attn2, cross=True)


def _unet_level(name: str, n_down: int, n_up: int) -> int:
    """Resolution level of a block from its module path (0 = latent size)."""
    parts = name.split(".")
    if parts[0] == "down_blocks":
        return int(parts[1])
    if parts[0] == "up_blocks":
        return n_up - 1 - int(parts[1])
    if parts[0] == "mid_block":
        return n_down - 1
    raise ValueError(f"cannot place block {name} on a UNet level")


def _execution_key(name: str) -> tuple[int, ...]:
    """Sort key of a block path in UNet execution order: down blocks, mid block, up blocks."""
    parts = name.split(".")
    stage = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}.get(parts[0], 3)
    return (stage, *(int(p) for p in parts[1:] if p.isdigit()))


def _unit_of(block_name: str) -> str:
    """The ``Transformer2DModel`` path of a block path (the block itself if it has none)."""
    head, sep, _ = block_name.rpartition(".transformer_blocks.")
    return head if sep else block_name


def _level_hw(latent_hw: tuple[int, int], level: int) -> tuple[int, int]:
    h, w = latent_hw
    for _ in range(level):
        h, w = (h + 1) // 2, (w + 1) // 2
    return h, w


def _slice_rows(obj: Any, rows: torch.Tensor, batch: int) -> Any:
    """Take batch rows of every per-row tensor in a (nested) argument."""
    if isinstance(obj, torch.Tensor) and obj.ndim > 0 and obj.shape[0] == batch:
        return obj.index_select(0, rows)
    if isinstance(obj, dict):
        return {k: _slice_rows(v, rows, batch) for k, v in obj.items()}
    return obj


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, heads: int) -> torch.Tensor:
    """Attention of one group: q [rows*M, Ci], k/v [rows, L, Ci] -> [rows*M, Ci]."""
    ci = k.shape[-1]
    hd = ci // heads
    qh = q.view(rows, -1, heads, hd).transpose(1, 2)
    kh = k.view(rows, -1, heads, hd).transpose(1, 2)
    vh = v.view(rows, -1, heads, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=None, dropout_p=0.0, is_causal=False)
    return o.transpose(1, 2).reshape(-1, ci).to(q.dtype)


class MaskAwareUNet:
    """Installs mask-aware hooks on a ``UNet2DConditionModel``; see the module docstring."""

    def __init__(self, unet: torch.nn.Module, kv_source: KVSource = "cache", compile: str = "off",
                 resnets: ResnetMode = "full") -> None:
        if kv_source not in ("cache", "recompute"):
            raise ValueError(f"kv_source must be 'cache' or 'recompute', got {kv_source!r}")
        if resnets not in ("full", "masked"):
            raise ValueError(f"resnets must be 'full' or 'masked', got {resnets!r}")
        self.unet = unet
        self.kv_source: KVSource = kv_source
        # Row-aware Linear/Conv2d (adapter terms, job-by-job GEMMs) before any hook captures a forward.
        install_row_aware(unet)
        # STENCIL_COMPILE: the packed path's token-wise layers compiled (workers/compiled.py); eager
        # while per-row adapter layouts are in use (their Python bookkeeping is not graph material).
        self.kernels = self.block_kernels(compile)
        self._tls = threading.local()  # one batch context per thread: calls in lockstep run on threads
        cfg = unet.config
        self.num_levels = len(cfg.down_block_types)
        self.pool_threshold = 0.0  # coarse levels' token pooling: 0 = OR (tokens.py), else coverage share
        n_up = len(cfg.up_block_types)
        last_in_transformer: set[int] = set()
        for mod in unet.modules():
            if isinstance(mod, Transformer2DModel) and len(mod.transformer_blocks):
                last_in_transformer.add(id(mod.transformer_blocks[-1]))
        self._blocks: list[_BlockInfo] = []
        for name, mod in unet.named_modules():
            if not isinstance(mod, BasicTransformerBlock):
                continue
            _check_block(name, mod)
            needs_y = kv_source == "recompute" or id(mod) in last_in_transformer
            info = _BlockInfo(name, mod, _unet_level(name, self.num_levels, n_up), needs_y,
                              inspect.signature(mod.forward), _unit_of(name))
            self._blocks.append(info)
        if not self._blocks:
            raise ValueError("model has no BasicTransformerBlock: nothing to make mask-aware")
        # Execution order (down, mid, up), not registration order (diffusers registers the
        # mid block last): the plan and the loader walk blocks in the order the UNet runs them.
        self._blocks.sort(key=lambda b: _execution_key(b.name))
        self._units: dict[str, list[_BlockInfo]] = {}
        for info in self._blocks:
            self._units.setdefault(info.unit, []).append(info)
        # Unit timings for the plan's cost model: host clocks on the CPU, CUDA events on a GPU
        # (read after the step completes: ``BatchContext.resolve_timings``).
        self._device_timed = next(unet.parameters()).device.type == "cuda"
        self.timing = True  # off while a call is captured into a CUDA graph (``workers/engine/graphs.py``)
        self._index_memo = IndexMemo()
        # Ragged levels (``batched.py``): one variable-length attention call per slab, so a graph's
        # shapes do not name each job's token count. None: where the device has the kernel (CUDA).
        self.ragged: bool | None = None
        self._timers: list[Any] = [unet.register_forward_pre_hook(self._model_pre)]
        modules = dict(unet.named_modules())
        for unit in self._units:
            if unit in modules:
                mod = modules[unit]
                self._timers.append(mod.register_forward_pre_hook(self._unit_pre(unit)))
                self._timers.append(mod.register_forward_hook(self._unit_post(unit)))
        for info in self._blocks:
            HookRegistry.check_if_exists_or_initialize(info.module).register_hook(
                _BlockHook(self, info), _BLOCK_HOOK)
            if kv_source == "cache":
                for slot in ("k", "v"):
                    lin = getattr(info.module.attn1, f"to_{slot}")
                    HookRegistry.check_if_exists_or_initialize(lin).register_hook(
                        _CaptureHook(self, slot), _CAPTURE_HOOK)
        # A block's projections of one input made views of one weight (``workers/fused_projections``):
        # the packed path runs them as one GEMM, the stock forward reads the same memory.
        for info in self._blocks:
            a1, a2 = info.module.attn1, info.module.attn2
            fuse((a1.to_q, a1.to_k, a1.to_v))
            if a2 is not None:
                fuse((a2.to_k, a2.to_v))
        # ResNets computed at masked tokens too (``resnets.py``): their outputs join the cache.
        self.resnets = MaskedResnets(unet, lambda: self._ctx) if resnets == "masked" else None
        log.info("mask-aware hooks on %d transformer blocks (kv_source=%s, resnets=%s)", len(self._blocks),
                 kv_source, resnets)

    @property
    def _ctx(self) -> BatchContext | None:
        return getattr(self._tls, "ctx", None)

    @_ctx.setter
    def _ctx(self, value: BatchContext | None) -> None:
        self._tls.ctx = value

    @property
    def _capture(self) -> dict[str, torch.Tensor] | None:
        return getattr(self._tls, "capture", None)

    @_capture.setter
    def _capture(self, value: dict[str, torch.Tensor] | None) -> None:
        self._tls.capture = value

    # --- public API ---------------------------------------------------------------------------

    @property
    def block_names(self) -> list[str]:
        return [b.name for b in self._blocks]

    @property
    def units(self) -> list[str]:
        """Plan units (``Transformer2DModel`` paths) in execution order; see the module doc."""
        return list(self._units)

    def loaded_units(self) -> dict[str, list[str]]:
        """What a cache provider loads, by name: each plan unit's tensors, and with mask-aware
        ResNets their tensors as one more group (``resnets.UNIT``: loaded with the step, never
        planned; a group whose copy is not resident computes its ResNets fully)."""
        out = {u: self.unit_tensor_names(u) for u in self.units}
        if self.resnets is not None:
            out[RESNETS_UNIT] = self.resnets.tensor_names()
        return out

    def unit_tensor_names(self, unit: str) -> list[str]:
        """Names of the cached tensors a unit reads (a subset of ``tensor_names``)."""
        prefix = tuple(f"{b.name}." for b in self._units[unit])
        return [n for n in self.tensor_names() if n.startswith(prefix)]

    def unit_level(self, unit: str) -> int:
        return self._units[unit][0].level

    def unit_nbytes(self, unit: str, latent_hw: tuple[int, int], rows: int,
                    dtype: torch.dtype | None = None, codec: str = "", shared: Collection[str] = ()) -> int:
        """Bytes of one unit's cached tensors for one step of ``rows`` rows (``codec``: as stored
        with that cache codec, ``workers/engine/cache_codec.py``; ``shared``: names stored with
        one row, their rows being bit-equal, ``cache_codec.share_rows``)."""
        if codec:
            return self._codec_nbytes(self._units[unit], latent_hw, rows, codec, shared)
        return self._dtype_nbytes(self._units[unit], latent_hw, rows, dtype, shared)

    def _tensor_shapes(self, blocks: list[_BlockInfo],
                       latent_hw: tuple[int, int]) -> Iterator[tuple[str, int, int]]:
        """(name, tokens, channels) per row of each cached tensor of ``blocks``."""
        for b in blocks:
            h, w = _level_hw(latent_hw, b.level)
            if self.kv_source == "cache":
                c_kv = b.module.attn1.to_k.out_features
                yield f"{b.name}.k", h * w, c_kv
                yield f"{b.name}.v", h * w, c_kv
            if b.needs_y:
                yield f"{b.name}.y", h * w, b.module.norm1.normalized_shape[0]

    def _dtype_nbytes(self, blocks: list[_BlockInfo], latent_hw: tuple[int, int], rows: int,
                      dtype: torch.dtype | None, shared: Collection[str]) -> int:
        if dtype is None:
            dtype = next(self.unet.parameters()).dtype
        elem = torch.empty((), dtype=dtype).element_size()
        return sum((1 if name in shared else rows) * elem * n * c
                   for name, n, c in self._tensor_shapes(blocks, latent_hw))

    def unit_tokens(self, unit: str, latent_hw: tuple[int, int]) -> int:
        """Tokens per row at the unit's level."""
        h, w = _level_hw(latent_hw, self.unit_level(unit))
        return h * w

    @property
    def cache_layout(self) -> str:
        """Goes into the template cache key: caches of the two layouts are not interchangeable."""
        return ("kv+y" if self.kv_source == "cache" else "y") + ("+r" if self.resnets is not None else "")

    @property
    def temporal_reuse(self) -> bool:
        """Whether masked groups may reuse patches of their last step (``reuse.py``): reused tokens
        take K/V from the cache, so only the ``"kv+y"`` layout."""
        return self.kv_source == "cache"

    reuse_family = "sd"  # which trained reuse rule decides (``reuse_rule``)

    @property
    def reuse_units(self) -> list[str]:
        """Temporal reuse decides per plan unit, in execution order."""
        return self.units

    def tensor_names(self) -> list[str]:
        """Names a recorded step holds, in block order."""
        names = []
        for b in self._blocks:
            if self.kv_source == "cache":
                names += [f"{b.name}.k", f"{b.name}.v"]
            if b.needs_y:
                names.append(f"{b.name}.y")
        return names + (self.resnets.tensor_names() if self.resnets is not None else [])

    def token_masks(self, mask: torch.Tensor, latent_hw: tuple[int, int], dilation: int = 0) -> TokenMasks:
        """Per-level token masks for this UNet's depth (pixel or latent-size input mask);
        ``pool_threshold``: how coarse levels are pooled (``workers/maskaware/tokens.py``)."""
        return build_token_masks(mask, latent_hw, self.num_levels, dilation, self.pool_threshold)

    def _codec_nbytes(self, blocks: list[_BlockInfo], latent_hw: tuple[int, int], rows: int, codec: str,
                      shared: Collection[str] = ()) -> int:
        from workers.engine.cache_codec import stored_nbytes

        return sum(stored_nbytes((rows, n, c), name, codec, shared=name in shared)
                   for name, n, c in self._tensor_shapes(blocks, latent_hw))

    def cache_nbytes(self, latent_height: int, latent_width: int, rows: int, steps: int = 1,
                     dtype: torch.dtype | None = None, codec: str = "", shared: Collection[str] = ()) -> int:
        """Bytes of a template cache: ``steps`` steps of ``rows`` rows (formula in module doc;
        ``codec``: as stored with that cache codec; ``shared``: names stored with one row, e.g.
        ``tensor_names()`` for a template warm-up whose CFG rows are bit-equal)."""
        hw = (latent_height, latent_width)
        if codec:
            blocks = self._codec_nbytes(self._blocks, hw, rows, codec, shared)
        else:
            blocks = self._dtype_nbytes(self._blocks, hw, rows, dtype, shared)
        return steps * (blocks + self._resnet_nbytes(hw, rows, dtype, codec, shared))

    def _resnet_nbytes(self, latent_hw: tuple[int, int], rows: int, dtype: torch.dtype | None, codec: str = "",
                       shared: Collection[str] = ()) -> int:
        """Bytes of the mask-aware ResNets' tensors of one step (outputs and ``norm2`` statistics), in
        ``dtype`` or as ``codec`` stores them."""
        if self.resnets is None:
            return 0
        from workers.engine.cache_codec import stored_nbytes

        n_up = len(self.unet.config.up_block_types)
        shapes = self.resnets.tensor_shapes(lambda name: _level_hw(latent_hw, _unet_level(name, self.num_levels, n_up)))
        if codec:
            return sum(stored_nbytes((rows, *shape), name, codec, shared=name in shared)
                       for name, shape in shapes.items())
        elem = torch.empty((), dtype=dtype or next(self.unet.parameters()).dtype).element_size()
        return sum((1 if name in shared else rows) * math.prod(shape) * elem for name, shape in shapes.items())

    @contextlib.contextmanager
    def batch(self, groups: list[RowGroup], index: BatchIndex | None = None,
              build_index: bool = True, resnet_plan: Any = None) -> Iterator[BatchContext]:
        """Activate a row-group layout for one UNet call. ``index``: its batch index (``batched.py``),
        built here when omitted and ``build_index``; a captured step passes the one it takes as an
        input, or none (nothing may be built and copied to the device while a graph is captured),
        and likewise its mask-aware ResNets' plan (``resnet_plan``, ``resnets.py``)."""
        if self._ctx is not None:
            raise RuntimeError("a mask-aware batch is already active")
        self._validate(groups)
        starts, s = [], 0
        for grp in groups:
            starts.append(s)
            s += grp.rows
        recorded = [{} if g.mode == "record" else None for g in groups]
        if index is None and build_index and Lockstep.current() is None:
            index = self.batch_index(groups, next(self.unet.parameters()).device)
        self._ctx = BatchContext(groups, starts, s, recorded, device_timed=self._device_timed, index=index,
                                 resnet_plan=resnet_plan)
        try:
            yield self._ctx
        finally:
            self._ctx = None
            self._capture = None

    def ragged_on(self, device: torch.device | str) -> bool:
        """Whether batch indices on ``device`` are ragged (``self.ragged``, else where the device has
        a variable-length attention kernel); never with K/V recomputed (no batch index)."""
        if self.kv_source != "cache":
            return False
        return varlen.device_kernel(torch.device(device)) if self.ragged is None else self.ragged

    def batch_index(self, groups: list[RowGroup], device: torch.device,
                    targets: Mapping[Any, int] | None = None) -> BatchIndex | None:
        """The batch-wide token indices of every level for ``groups`` (``batched.py``), or None
        where a masked group takes the per-group path: K/V recomputed, a cache that is not a
        writable staged buffer (read-only, loaded unit by unit), temporal reuse. Built once per
        composition: what fixes them is each masked job's mask, rows, position, staged-buffer
        adjacency and fully computed units. ``targets``: ragged levels' token totals (by level key)
        padded up to these, to take a graph captured for a larger batch (``graph_calls``)."""
        from workers.engine.staging import StagedCache

        if self.kv_source != "cache":
            return None
        masked = [(g, grp) for g, grp in enumerate(groups) if grp.mode == "masked"]
        if not masked or any(not (isinstance(grp.cache, StagedCache) and grp.cache.writable)
                             or grp.reuse is not None or grp.token_mask is None for _g, grp in masked):
            return None
        pad = not layout.wanted()
        starts = [0]
        for grp in groups[:-1]:
            starts.append(starts[-1] + grp.rows)
        buffers: dict[int, int] = {}
        parts = []
        for g, grp in enumerate(groups):
            if grp.mode != "masked":
                parts.append((grp.mode, grp.rows))
                continue
            ordinal = buffers.setdefault(id(grp.cache.flat), len(buffers))  # type: ignore[union-attr]
            parts.append(("masked", grp.rows, id(grp.token_mask), ordinal, grp.cache.row0,  # type: ignore[union-attr]
                          tuple(sorted(grp.full_units))))
        ragged = pad and self.ragged_on(device)
        if targets and not ragged:
            raise ValueError("token totals are padded to a target only in ragged batch indices")
        key = (str(device), pad, ragged, tuple(parts), frozenset((targets or {}).items()))

        def levels() -> dict[Any, tuple[int, list[Member], bool]]:
            out: dict[Any, tuple[int, list[Member], bool]] = {}
            token_levels = masked[0][1].token_mask.levels  # type: ignore[union-attr]
            for unit, blocks in self._units.items():
                if blocks[0].level >= len(token_levels):
                    continue
                n = token_levels[blocks[0].level].numel()
                forced = frozenset(g for g, grp in masked if unit in grp.full_units)
                if (n, forced) in out:
                    continue
                members, prev = [], None
                for g, grp in masked:
                    m = grp.token_mask.count(n)  # type: ignore[union-attr]
                    if g in forced or m == 0 or m >= n:
                        continue
                    adjacent = prev is not None and prev.cache.adjacent(grp.cache)
                    members.append(Member(g, starts[g], grp.rows, grp.token_mask.indices(n, "cpu"), adjacent))  # type: ignore[union-attr]
                    prev = grp
                if members:
                    out[(n, forced)] = (n, members, pad)
            return out

        return self._index_memo.get(key, levels, torch.device(device), keep=[grp.token_mask for _g, grp in masked],
                                    ragged=ragged, targets=targets)

    @staticmethod
    def block_kernels(compile: str) -> BlockKernels:
        """The packed path's computations under ``compile`` (a ``STENCIL_COMPILE`` mode), knowing
        this controller's capture hooks do nothing there."""
        return BlockKernels(compile, passive=(_CAPTURE_HOOK,))

    def remove(self) -> None:
        """Uninstall every hook this controller added."""
        for handle in self._timers:
            handle.remove()
        self._timers = []
        for info in self._blocks:
            info.module._diffusers_hook.remove_hook(_BLOCK_HOOK, recurse=False)
            if self.kv_source == "cache":
                for slot in ("k", "v"):
                    getattr(info.module.attn1, f"to_{slot}")._diffusers_hook.remove_hook(
                        _CAPTURE_HOOK, recurse=False)
        self._blocks = []
        if self.resnets is not None:
            self.resnets.remove()
            self.resnets = None
        unfuse(self.unet)

    # --- internals ----------------------------------------------------------------------------

    def _model_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._ctx is not None and self.timing:
            self._ctx._last_end = self._ctx.stamp()

    def _unit_pre(self, unit: str) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            ctx = self._ctx
            if ctx is not None and self.timing:
                now = ctx._unit_t0[unit] = ctx.stamp()
                if ctx._last_end is not None:  # ResNets, convs etc. since the previous unit
                    ctx.add_span(ctx.unit_gap, unit, ctx._last_end, now)
        return pre

    def _unit_post(self, unit: str) -> Any:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            ctx = self._ctx
            if ctx is not None and unit in ctx._unit_t0:
                now = ctx.stamp()
                ctx.add_span(ctx.unit_seconds, unit, ctx._unit_t0.pop(unit), now)
                ctx._last_end = now
        return post

    def _validate(self, groups: list[RowGroup]) -> None:
        for info in self._blocks:  # processors may have been swapped since install
            _check_block(info.name, info.module)
        for i, g in enumerate(groups):
            if g.rows < 1 or g.mode not in ("full", "record", "masked"):
                raise ValueError(f"group {i}: bad rows/mode {g.rows}/{g.mode}")
            if g.mode == "masked" and (g.token_mask is None or g.cache is None):
                raise ValueError(f"group {i}: masked mode needs token_mask and cache")

    def _block_forward(self, info: _BlockInfo, original: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        ctx = self._ctx
        if ctx is None:
            return original(*args, **kwargs)
        arguments = info.signature.bind(*args, **kwargs).arguments
        group = Lockstep.current()
        if group is not None:  # calls of one step in lockstep: this block once for all of them
            return group.meet((ctx, arguments), lambda round_: self._calls_forward(info, round_))
        h = arguments["hidden_states"]
        b, n, _ = h.shape
        if b != ctx.total_rows:
            raise ValueError(f"{info.name}: batch has {b} rows, row groups declare {ctx.total_rows}")
        plan = ctx.plan(n, h.device, ctx.forced_full(info.unit))
        if info.unit not in ctx.unit_tokens:
            ctx.unit_tokens[info.unit] = ctx.computed_tokens(plan, n)
        if not plan.masked and not plan.empty:
            return self._full_forward(info, original, arguments, plan, ctx)
        out = h  # rows no one computes pass through (inner blocks' masked rows are never read)
        if plan.full_rows is not None and plan.full_rows.numel():
            sub = {k: _slice_rows(v, plan.full_rows, b) for k, v in arguments.items()}
            with layout.use(layout.rows(plan.full_groups) if layout.wanted() else None):
                out = h.index_copy(0, plan.full_rows, self._full_forward(info, original, sub, plan, ctx))
        if info.needs_y and plan.empty:
            out = out.clone() if out is h else out
            for g, s, r in plan.empty:
                out[s:s + r] = self._cached(ctx, g, info.name, "y", (r, n, h.shape[2]))
        if not plan.masked:
            return out
        if plan.batched is not None:
            return self._batched_forward(info, h, arguments, plan, ctx, out)
        return self._masked_forward(info, h, arguments, plan, ctx, out)

    def _full_forward(self, info: _BlockInfo, original: Any, arguments: dict, plan: _Plan,
                      ctx: BatchContext) -> torch.Tensor:
        """Original forward on the full-compute rows; capture what record groups need."""
        capture_kv = bool(plan.record) and self.kv_source == "cache"
        if capture_kv:
            self._capture = {}
        try:
            y = original(**arguments)
            cap = self._capture
        finally:
            self._capture = None
        for g, pos, r in plan.record:
            rec = ctx.recorded[g]
            assert rec is not None
            if capture_kv:
                assert cap is not None and "k" in cap and "v" in cap, "to_k/to_v capture missed"
                rec[f"{info.name}.k"] = cap["k"][pos:pos + r].detach().clone()
                rec[f"{info.name}.v"] = cap["v"][pos:pos + r].detach().clone()
            if info.needs_y:
                rec[f"{info.name}.y"] = y[pos:pos + r].detach().clone()
        return y

    @staticmethod
    def _cached(ctx: BatchContext, g: int, block: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        cache = ctx.groups[g].cache
        assert cache is not None
        key = f"{block}.{kind}"
        if key not in cache:
            raise KeyError(f"group {g}: cache lacks {key!r} (other layout, model or resolution?)")
        t = cache[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"group {g}: cached {key} has shape {tuple(t.shape)}, need {shape}")
        return t

    def _with_fresh(self, sg: "_Seg", block: str, kind: str, fresh: torch.Tensor) -> torch.Tensor:
        """The group's cached ``kind`` tensor [rows, N, C] with ``fresh`` [rows, M, C] at its
        computed tokens: written in place into a staged (private, writable) cache, else into a copy
        (the cache is read-only)."""
        cached = self._cached(sg.ctx, sg.g, block, kind, (sg.rows, sg.n, fresh.shape[-1]))
        if not (getattr(sg.ctx.groups[sg.g].cache, "writable", False)
                and cached.device == fresh.device and cached.dtype == fresh.dtype):
            cached = cached.to(device=fresh.device, dtype=fresh.dtype, copy=True)
        if sg.reuse is not None:
            return sg.reuse.merge(f"{block}.{kind}", kind == "y", cached, fresh)
        return cached.index_copy_(1, sg.idx, fresh)  # type: ignore[arg-type]

    def _masked_forward(self, info: _BlockInfo, h: torch.Tensor, arguments: dict, plan: _Plan,
                        ctx: BatchContext, out: torch.Tensor) -> torch.Tensor:
        """Every token-wise layer on the packed masked tokens of one call; attention per group.

        Between the blocks of one ``Transformer2DModel`` the packed tokens flow on (``ctx.carry``):
        an inner block's output at masked tokens is read by no one but the next block (its K/V come
        from the cache), so it is neither scattered into the map nor gathered again. The last block
        writes its fresh tokens into the group's cached output (in place when the cache is staged)."""
        _check_arguments(arguments)
        ehs = arguments.get("encoder_hidden_states")
        n, c = h.shape[1], h.shape[2]
        segs = [self._seg(info, ctx, mg, h, ehs, n) for mg in plan.masked]
        if any(sg.reuse is not None for sg in segs):  # fewer tokens than the plan counted
            full_rows = ctx.total_rows if plan.full_rows is None else int(plan.full_rows.numel())
            ctx.unit_tokens[info.unit] = full_rows * n + sum(sg.rows * sg.m for sg in segs)
        carry = ctx.carry.pop(info.unit, None)
        x_in = carry.x if carry is not None and carry.ret is h and carry.plan is plan else None
        x = self._packed(info, segs, x_in)
        if not info.needs_y:
            ctx.carry[info.unit] = _Carry(out, x, plan)
            return out
        ys, off = [], 0
        for sg in segs:
            cnt = sg.rows * sg.m
            ys.append(self._with_fresh(sg, info.name, "y", x[off:off + cnt].view(sg.rows, sg.m, c)))
            off += cnt
        if out is h and not plan.empty and sum(sg.rows for sg in segs) == h.shape[0]:
            return _cat(ys)  # every row is masked: the groups' outputs, in batch order
        out = out.clone() if out is h else out
        for sg, y in zip(segs, ys):
            out[sg.start:sg.start + sg.rows] = y
        return out

    def _batched_forward(self, info: _BlockInfo, h: torch.Tensor, arguments: dict, plan: _Plan,
                         ctx: BatchContext, out: torch.Tensor) -> torch.Tensor:
        """``_masked_forward`` with the batch index (``batched.py``): one gather of every masked
        job's tokens, one scatter per cached tensor and slab, one attention call per run."""
        _check_arguments(arguments)
        level, index = plan.batched, ctx.index
        assert level is not None and index is not None
        blk = info.module
        a1, a2 = blk.attn1, blk.attn2
        n = h.shape[1]
        want = layout.wanted()
        kern = self.kernels if not want else _EAGER
        carry = ctx.carry.pop(info.unit, None)
        if carry is not None and carry.ret is h and carry.plan is plan:
            x = carry.x
        else:
            rows, tokens = index.gather(level)
            x = h[rows, tokens]  # one kernel over the (often strided) block input
        members = level.members

        def write(slab: Any, kind: str, fresh: torch.Tensor) -> torch.Tensor:
            """The slab of ``kind`` (its first job's cache checked) with ``fresh`` written in."""
            width, g = fresh.shape[-1], members[slab.first][0]
            self._cached(ctx, g, info.name, kind, (members[slab.first][2], n, width))
            target = ctx.groups[g].cache.slab(f"{info.name}.{kind}", slab.rows)  # type: ignore[union-attr]
            target.view(-1, width).index_copy_(0, index.scatter(slab), _part(fresh, slab.packed, slab.tokens))
            return target

        gids = [ctx.groups[g].gid if ctx.groups[g].gid >= 0 else g for g, *_ in members]
        packed = layout.flat((gid, rows * m) for gid, (_g, _s, rows, m) in zip(gids, members)) if want else None
        with layout.use(packed):
            # 1. self-attention: fresh K/V written into each slab, queries of a run against its rows
            q, k, v = kern.self_qkv(blk, x)
            outs = []
            for slab, runs in level.slab_runs:
                ks, vs = write(slab, "k", k), write(slab, "v", v)
                if level.ragged:  # the slab's rows in one call, their extents on the device
                    outs.append(varlen.attend(_part(q, slab.packed, slab.tokens), ks, vs, index.cu(slab),
                                              a1.heads, n, ctx.extents))
                    continue
                for run in runs:
                    outs.append(_sdpa(_part(q, run.packed, run.rows * run.m), _part(ks, run.row, run.rows),
                                      _part(vs, run.row, run.rows), run.rows, a1.heads))
            x = kern.attn_out(a1, _cat(outs), x)
            # 2. cross-attention: each run's queries against its rows' text
            if a2 is not None:
                ehs = arguments.get("encoder_hidden_states")
                if ehs is None:  # attn2 without text is self-attention over the input
                    raise NotImplementedError("attn2 without encoder_hidden_states is not supported")
                q2 = kern.cross_q(blk, x)
                with layout.use(layout.rows((gid, rows) for gid, (_g, _s, rows, _m) in zip(gids, members))
                                if want else None):
                    k2, v2 = kern.text_kv(a2, _cat([_part(ehs, s.start, s.rows) for s in level.slabs]))
                outs, text_row = [], 0
                for slab, runs in level.slab_runs:
                    if level.ragged:
                        outs.append(varlen.attend(_part(q2, slab.packed, slab.tokens), _part(k2, text_row, slab.rows),
                                                  _part(v2, text_row, slab.rows), index.cu(slab), a2.heads, n,
                                                  ctx.extents))
                        text_row += slab.rows
                        continue
                    for run in runs:
                        row = text_row + run.row
                        outs.append(_sdpa(_part(q2, run.packed, run.rows * run.m), _part(k2, row, run.rows),
                                          _part(v2, row, run.rows), run.rows, a2.heads))
                    text_row += slab.rows
                x = kern.attn_out(a2, _cat(outs), x)
            # 3. feed-forward
            x = kern.ff(blk, x)
        if not info.needs_y:
            ctx.carry[info.unit] = _Carry(out, x, plan)
            return out
        ys = [write(slab, "y", x) for slab in level.slabs]
        only = level.slabs[0]
        if out is h and not plan.empty and len(ys) == 1 and only.start == 0 and only.rows == h.shape[0]:
            return ys[0]  # every row is masked: the slab is the block's output
        out = out.clone() if out is h else out
        for slab, y in zip(level.slabs, ys):
            out[slab.start:slab.start + slab.rows] = y
        return out

    def _seg(self, info: _BlockInfo, ctx: BatchContext, mg: _MaskedGroup, h: torch.Tensor,
             ehs: torch.Tensor | None, n: int) -> "_Seg":
        """A masked group's segment: its masked tokens, or with temporal reuse the patches its job
        computes this step (``workers/maskaware/reuse.py``; needs cached K/V)."""
        grp = ctx.groups[mg.g]
        gid = grp.gid if grp.gid >= 0 else mg.g
        if grp.reuse is None or self.kv_source != "cache":
            return _Seg(gid, mg.g, ctx, h, ehs, mg.start, mg.rows, n, mg.idx, mg.m, False)
        u = grp.reuse.plan(info.unit, mg.idx, mg.m, n, grp.token_mask.masked(n))
        return _Seg(gid, mg.g, ctx, h, ehs, mg.start, mg.rows, n, u.idx, u.k, False, reuse=u)

    def _calls_forward(self, info: _BlockInfo, round_: list[tuple[int, Any]]) -> dict[int, torch.Tensor]:
        """One block for several calls in lockstep (``lockstep.py``; e.g. jobs of different image
        sizes): the token-wise layers run once over every call's tokens, attention per group.
        Full and record groups enter with all their tokens, masked ones with their masked tokens."""
        segs: list[_Seg] = []
        outs: dict[int, torch.Tensor] = {}
        for call, (ctx, arguments) in round_:
            _check_arguments(arguments)
            h = arguments["hidden_states"]
            n = h.shape[1]
            out = outs[call] = torch.empty_like(h)
            forced = ctx.forced_full(info.unit)
            computed = 0
            for g, grp in enumerate(ctx.groups):
                start, rows = ctx.starts[g], grp.rows
                idx, m = None, n
                if grp.mode == "masked" and g not in forced:
                    m = grp.token_mask.count(n)  # type: ignore[union-attr]
                    if m == 0:
                        out[start:start + rows] = (self._cached(ctx, g, info.name, "y", (rows, n, h.shape[2]))
                                                   if info.needs_y else h[start:start + rows])
                        continue
                    if m < n:
                        idx = grp.token_mask.indices(n, h.device)  # type: ignore[union-attr]
                computed += rows * m
                segs.append(_Seg(grp.gid if grp.gid >= 0 else g, g, ctx, h, arguments.get("encoder_hidden_states"),
                                 start, rows, n, idx, m, grp.mode == "record", out))
            ctx.unit_tokens.setdefault(info.unit, computed)
        if segs:
            x = self._packed(info, segs)
            off = 0
            for sg in segs:
                cnt = sg.rows * sg.m
                dst = sg.out[sg.start:sg.start + sg.rows]  # type: ignore[index]
                fresh = x[off:off + cnt].view(sg.rows, sg.m, dst.shape[2])
                if sg.idx is None:
                    dst.copy_(fresh)
                    if sg.record and info.needs_y:
                        sg.ctx.recorded[sg.g][f"{info.name}.y"] = dst.detach().clone()
                elif info.needs_y:
                    dst.copy_(self._with_fresh(sg, info.name, "y", fresh))
                else:  # inner block with cached K/V: nobody reads unmasked tokens of this output
                    dst.copy_(sg.h[sg.start:sg.start + sg.rows])
                    dst.index_copy_(1, sg.idx, fresh)
                off += cnt
        return outs

    def _packed(self, info: _BlockInfo, segs: list["_Seg"], x_in: torch.Tensor | None = None) -> torch.Tensor:
        """The block's token-wise layers once over the segments' tokens (a ragged pack; ``x_in``:
        the pack the previous block of the same transformer produced), attention per segment:
        queries are its computed tokens, keys/values all its tokens (fresh where computed, the
        cache elsewhere; with ``kv_source="recompute"`` all fresh). Returns the packed output."""
        blk = info.module
        a1, a2 = blk.attn1, blk.attn2
        c = segs[0].h.shape[2]
        ci = a1.to_k.out_features
        want = layout.wanted()
        kern = self.kernels if not want else _EAGER
        x = x_in if x_in is not None else _cat([sg.tokens() for sg in segs])
        with layout.use(layout.flat((sg.gid, sg.rows * sg.m) for sg in segs) if want else None):
            # 1. self-attention: Q from computed tokens; K/V fresh there (recompute: everywhere)
            if self.kv_source == "cache":
                q, k, v = kern.self_qkv(blk, x)
            else:
                hm = _cat([sg.h[sg.start:sg.start + sg.rows].reshape(-1, c) for sg in segs])
                with layout.use(layout.flat((sg.gid, sg.rows * sg.n) for sg in segs) if want else None):
                    n1_all = blk.norm1(hm)
                    k, v = a1.to_k(n1_all), a1.to_v(n1_all)
                parts, row0 = [], 0
                for sg in segs:
                    part = n1_all[row0:row0 + sg.rows * sg.n]
                    parts.append(part if sg.idx is None else
                                 part.view(sg.rows, sg.n, c).index_select(1, sg.idx).reshape(-1, c))
                    row0 += sg.rows * sg.n
                q = a1.to_q(_cat(parts))
            outs, off, kv0 = [], 0, 0
            for sg in segs:
                cnt, shape = sg.rows * sg.m, (sg.rows, sg.n, ci)
                if self.kv_source == "recompute":
                    size = sg.rows * sg.n
                    kf, vf = k[kv0:kv0 + size].view(shape), v[kv0:kv0 + size].view(shape)
                    kv0 += size
                elif sg.idx is None:
                    kf, vf = k[off:off + cnt].view(shape), v[off:off + cnt].view(shape)
                    if sg.record:
                        rec = sg.ctx.recorded[sg.g]
                        rec[f"{info.name}.k"], rec[f"{info.name}.v"] = kf.detach().clone(), vf.detach().clone()
                else:
                    kf = self._with_fresh(sg, info.name, "k", k[off:off + cnt].view(sg.rows, sg.m, ci))
                    vf = self._with_fresh(sg, info.name, "v", v[off:off + cnt].view(sg.rows, sg.m, ci))
                outs.append(_sdpa(q[off:off + cnt], kf, vf, sg.rows, a1.heads))
                off += cnt
            x = kern.attn_out(a1, _cat(outs), x)
            # 2. cross-attention: queries from computed tokens, K/V from each row's text
            if a2 is not None:
                if any(sg.ehs is None for sg in segs):  # attn2 without text is self-attention over the input
                    raise NotImplementedError("attn2 without encoder_hidden_states is not supported")
                q2 = kern.cross_q(blk, x)
                texts = [sg.ehs[sg.start:sg.start + sg.rows] for sg in segs]  # type: ignore[index]
                if len({t.shape[1:] for t in texts}) != 1:
                    raise NotImplementedError("text of different lengths in one packed block")
                with layout.use(layout.rows((sg.gid, sg.rows) for sg in segs) if want else None):
                    k2, v2 = kern.text_kv(a2, _cat(texts))
                outs, off, row0 = [], 0, 0
                for rows, m in _runs(segs):  # adjacent jobs of one token count: one call
                    cnt = rows * m
                    outs.append(_sdpa(q2[off:off + cnt], k2[row0:row0 + rows], v2[row0:row0 + rows], rows, a2.heads))
                    off, row0 = off + cnt, row0 + rows
                x = kern.attn_out(a2, _cat(outs), x)
            # 3. feed-forward
            return kern.ff(blk, x)


_EAGER = BlockKernels("off")


@dataclass
class _Seg:
    """Rows of one group of one call that enter a packed block: all tokens (``idx`` None) or the
    masked ones; ``gid`` names the job batch-wide (adapter row layouts); ``out``: the call's
    output buffer (calls in lockstep)."""

    gid: int
    g: int
    ctx: BatchContext
    h: torch.Tensor
    ehs: torch.Tensor | None
    start: int
    rows: int
    n: int
    idx: torch.Tensor | None
    m: int
    record: bool
    out: torch.Tensor | None = None
    reuse: UnitReuse | None = None  # temporal reuse: ``idx`` holds the patches computed this step

    def tokens(self) -> torch.Tensor:
        rows = self.h[self.start:self.start + self.rows]
        return (rows if self.idx is None else rows.index_select(1, self.idx)).reshape(-1, rows.shape[2])


@dataclass
class _Carry:
    """Packed tokens an inner block hands to the next block of its transformer (``ret``: what it
    returned, which the next block must receive as its input for the pack to be valid)."""

    ret: torch.Tensor
    x: torch.Tensor
    plan: _Plan


def _runs(segs: list["_Seg"]) -> list[tuple[int, int]]:
    """(rows, tokens per row) of each run of adjacent segments computing the same number of tokens
    per row: their packed queries are one ``[rows, m]`` block (token buckets make equal counts
    common, ``workers/maskaware/buckets.py``), so one attention call serves the run."""
    out: list[tuple[int, int]] = []
    for sg in segs:
        if out and out[-1][1] == sg.m:
            out[-1] = (out[-1][0] + sg.rows, sg.m)
        else:
            out.append((sg.rows, sg.m))
    return out


def _part(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``t``: ``t`` itself when that is all of it (no view
    operator dispatched)."""
    return t if start == 0 and length == t.shape[0] else t.narrow(0, start, length)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenation that dispatches nothing for a single tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _check_arguments(arguments: dict) -> None:
    if arguments.get("attention_mask") is not None or arguments.get("encoder_attention_mask") is not None:
        raise NotImplementedError("attention masks are not supported for masked groups")
    if arguments.get("cross_attention_kwargs"):
        raise NotImplementedError("cross_attention_kwargs are not supported for masked groups")
