"""Mask-aware computation for diffusers' ``FluxTransformer2DModel`` (Flux / Flux Fill), batched.

Why: an inpainting edit changes a small part of the image, yet a Flux step costs the same for
every token. Here only the edited (masked) image tokens and the text tokens run the token-wise
work -- norms, adaptive-norm modulation, Q/K/V/out projections, MLPs, the final norm and
projection; unmasked tokens enter attention only as keys/values, read from a per-template cache
recorded by a normal run (DESIGN 2).

API::

    ctrl = MaskAwareFlux(transformer)             # kv_format="roped"; installs hooks; no effect outside a batch
    ctrl.block_names -> list[str]                 # "transformer_blocks.3", "single_transformer_blocks.7"
    m = ctrl.token_mask(pixel_mask, dilation=0)   # bool [N] packed-token mask (see flux_tokens)
    groups = [RowGroup(1, "record"),              # consecutive rows, in batch order
              RowGroup(1, "masked", token_mask=m, cache=step_cache),
              RowGroup(1, "full")]
    with ctrl.batch(groups) as ctx:               # exactly ONE transformer call = one denoising step
        out = transformer(hidden_states=x, encoder_hidden_states=e, pooled_projections=p,
                          timestep=t_rows, img_ids=img_ids, txt_ids=txt_ids, guidance=g_rows).sample
    ctx.recorded[0] -> dict[str, Tensor]          # this step's cache for group 0 (record groups, else None)
    ctrl.cache_nbytes(image_tokens, rows=1, steps=1, dtype=None) -> int
    ctrl.remove()                                 # uninstall: the model is stock again

- ``RowGroup(rows, mode, token_mask=None, cache=None)``: ``mode`` is ``"full"`` (normal compute),
  ``"record"`` (normal compute + capture) or ``"masked"``. A Flux job is one row (no CFG batch).
- Step cache (``ctx.recorded[g]``, and what a masked group passes back as ``cache`` for the step it
  is at): tensors ``[rows, N, C]`` (a masked group may pass ``[1, N, C]`` for all its rows):
  ``"<block>.k_roped"`` (``kv_format="roped"``, the default: after qk-norm and RoPE) or
  ``"<block>.k"`` (``kv_format="raw"``: K after ``to_k``, before qk-norm and RoPE, as DESIGN 2
  first asked), ``"<block>.v"``
  (after ``to_v``), for every block, C = inner_dim; plus ``"output"`` (C = out_channels): the model
  output at the image tokens. A masked row's unmasked tokens get the cached output, so its
  unmasked latents follow the template's trajectory; without ``"output"`` they get 0 and the
  final inpaint blend must restore them.
- Size per template: ``steps * rows * (blocks * 2 * N * inner_dim + N * out_channels) * itemsize``
  (``flux_cache_nbytes``); e.g. Flux.1 (57 blocks, inner 3072) at 1024x1024 (N=4096), 28 steps,
  bf16: 28 * 57 * 2 * 4096 * 3072 * 2 B = 80 GB -- why the store tiers it and prefetches per block.

Semantics
- Every row has its own timestep and guidance (pass ``[B]`` tensors), mask, step cache and
  template. Rows of one call share N and the text length T (the stock forward takes one dense
  ``[B, N, C]`` input and one ``img_ids``).
- Token-wise layers run once over the ragged pack of all rows' selected image tokens (text as a
  dense ``[rows, T, D]`` block in double blocks; the single blocks keep text and image as one
  ``[rows*T + M, D]`` pack, built once and updated in place). Adaptive-norm modulation and gated
  residuals are applied per row segment in place (one fused pass, no gathered ``[M, D]`` tensors).
  Attention runs per row (SDPA), in the stock forward's shape: queries = its text + selected
  image tokens; keys/values = its text + every token of the job in its own order, i.e. the
  cache's tensors with the fresh selected tokens written in (in place when the cache is staged
  for the job, ``workers/engine/staging.py``, else into a copy: a shared cache is only read).
  RoPE is applied at each token's ORIGINAL position (cos/sin for the text and each row's selected
  positions are computed once per call), as one complex multiply. Raw cached K get qk-norm +
  RoPE over every key; ``roped`` cached K are used as they are, only the fresh ones rotated.
- Ratio 1 (or a full/record group) is full compute; ratio 0 skips the row (its text tokens only
  matter through masked image tokens) and returns the cached output.
- Masked-token outputs equal full compute (to float rounding) when the cache was recorded from the
  same inputs; with a real template's cache they are the paper's approximation.
- Temporal reuse (``turbo``, ``RowGroup.reuse``): a masked row may take some patches of its computed
  tokens from its last step, block by block (``flux_reuse.py``).
- Not supported inside a batch (raises): ControlNet residuals, ``joint_attention_kwargs``
  (IP-Adapter), rows of different resolution or text length in one call.

Design notes
- Attention processors cannot restrict the norms and MLPs (they live outside the processor), so
  ``diffusers.hooks`` ``ModelHook``s replace the forward of each block and of ``x_embedder``,
  ``context_embedder``, ``norm_out``, ``proj_out``; a hook on the model builds the per-call plan.
  Between blocks the stock loop carries zero-stride placeholders; the packed state lives in the
  plan. No model file is forked: the block math calls the blocks' own submodules in stock order.
- Per-job state is the explicit per-call plan, not hook state keyed by a global cache context (the
  pitfall of naive batching, DESIGN 7).
- ``kv_format="roped"`` (the default) caches K after qk-norm + RoPE (same bytes; the cache is keyed
  by model and resolution anyway), so no cached key is normed and rotated again at every block and
  job: that was the main fixed cost at small ratios (docs/bench/maskaware_flux.md), and ``raw`` adds
  to each block of a masked step the norm and rotation of every key. ``raw`` (DESIGN 2's layout)
  stays available for comparison. ``cache_layout`` names it in the cache key.
- RoPE in float32 is one complex multiply (Flux rotates (even, odd) channel pairs), one pass instead
  of diffusers' five; in half precision it is diffusers' arithmetic (it must round as the stock
  forward does) on [S, H, hd] with tables shaped once per call (``_rope``). One row's pack is
  computed with the stock forward's expressions (modulation, gated residuals, the single blocks'
  concatenation of attention output and MLP activations for proj_out); docs/bench/maskaware_flux.md
  reports the packed path's speed against the stock forward.
  Masked-token outputs match full compute to ~1e-6 (float summation order), not bit for bit.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

from app.storage.hostcache import to_device
from workers.adapters import layout
from workers.adapters.patcher import install as install_row_aware
from workers.compiled import Compiled
from workers.fused_projections import fuse, project, unfuse
from workers.maskaware.buckets import bucket_range, padded
from workers.maskaware.flux_reuse import reuse_block
from workers.maskaware.flux_tokens import pixel_to_token_mask
from workers.maskaware.tokens import row_index

log = logging.getLogger(__name__)

HOOK_NAME = "stencil_maskaware_flux"
OUTPUT_KEY = "output"
Mode = Literal["full", "record", "masked"]
KVFormat = Literal["raw", "roped"]
K_SUFFIX: dict[str, str] = {"raw": "k", "roped": "k_roped"}
StepCache = Mapping[str, torch.Tensor]


@dataclass
class FluxTokens:
    """A job's packed-token mask and the indices every step reads, built once (at admission, by
    ``MaskAwareFlux.prepared``): a step then reads counts as Python ints and indices already on the
    device, so building its plan never synchronises with the device."""

    mask: torch.Tensor  # bool [N] on the host
    m: int  # computed tokens
    sel: torch.Tensor | None  # sorted positions of the computed tokens (None: every token)
    unsel: torch.Tensor | None  # sorted positions taken from the cache
    masked: int = 0  # masked tokens among the ``m`` (the rest: bucket padding, repeating the last)

    @classmethod
    def build(cls, mask: torch.Tensor, device: torch.device | str, bucketed: bool = False) -> "FluxTokens":
        """``bucketed``: the computed tokens padded to their token bucket, the cached ones to the
        bucket's widest complement (``workers/maskaware/buckets.py``), so every mask of a bucket
        has the same shapes (graph-captured steps serve them all)."""
        host = mask.detach().to("cpu").flatten().bool()
        n, m = host.numel(), int(host.sum())
        lowest = m
        if bucketed:
            lowest, m = bucket_range(m, n)
        masked = int(host.sum())
        if m == n:
            return cls(host, n, None, None, n)
        sel, unsel = host.nonzero().flatten(), (~host).nonzero().flatten()
        if bucketed and sel.numel():
            sel, unsel = padded(sel, m), padded(unsel, n - lowest)
        return cls(host, m, to_device(sel, device), to_device(unsel, device), masked)

    def numel(self) -> int:
        return self.mask.numel()

    def counts(self) -> tuple[int]:
        return (self.m,)


@dataclass(frozen=True)
class RowGroup:
    """Consecutive batch rows belonging to one job (Flux: one row, no CFG batch)."""

    rows: int = 1
    mode: Mode = "full"
    token_mask: "torch.Tensor | FluxTokens | None" = None  # bool [N], or prepared (``MaskAwareFlux.prepared``)
    cache: StepCache | None = None
    # Jobs of different sizes in one call: where this job's tokens (in its own packing order) sit
    # in the call's union token grid; the other grid positions are padding, never computed or
    # attended to. None: the job fills the grid (its own order is the grid's).
    positions: torch.Tensor | None = None
    reuse: Any = None  # masked mode: ``reuse.TemporalReuse`` of the job (patches taken from its last step)


@dataclass
class BatchContext:
    """What one batched transformer call produced besides its output."""

    groups: tuple[RowGroup, ...]
    recorded: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    image_tokens_computed: int = 0
    image_tokens_total: int = 0
    calls: int = 0


def block_names(model: FluxTransformer2DModel) -> list[str]:
    """Blocks by module path, in execution order."""
    return ([f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))]
            + [f"single_transformer_blocks.{i}" for i in range(len(model.single_transformer_blocks))])


def flux_cache_nbytes(model: FluxTransformer2DModel, image_tokens: int, steps: int,
                      dtype: torch.dtype = torch.float32, include_output: bool = True) -> int:
    """Bytes of one template's cache: steps x blocks x 2 (K, V) x N x inner_dim x itemsize (+ output)."""
    n_blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    per_step = n_blocks * 2 * image_tokens * model.inner_dim
    if include_output:
        per_step += image_tokens * model.out_channels
    itemsize = torch.empty((), dtype=dtype).element_size()
    return steps * per_step * itemsize


# ---------------------------------------------------------------------------------------------
# Per-call plan: which tokens each row computes, and the packed state flowing through the blocks.
# ---------------------------------------------------------------------------------------------


@dataclass
class _Row:
    row: int                      # batch row
    group: int
    sel: torch.Tensor | None      # sorted positions of computed image tokens; None = all N
    m: int                        # number of computed image tokens
    cache: StepCache | None
    record: bool
    crow: int = 0                 # row index inside its group (cache tensors are [rows or 1, N, C])
    off: int = 0                  # offset of this row's tokens in the packed image state
    active: int = -1              # index among rows that compute anything
    unsel: torch.Tensor | None = None   # sorted positions taken from the cache (sel is not None)
    unsel_cache: torch.Tensor | None = None  # the same tokens' indices in the cache (its own order)
    own: int = 0                  # tokens of this job (N unless placed on a larger grid)
    sel_own: torch.Tensor | None = None  # the computed tokens' indices in the job's own order
    pos_own: torch.Tensor | None = None  # grid positions of all the job's tokens (None: the call's grid)
    reuse: Any = None  # the job's ``reuse.TemporalReuse`` (``flux_reuse``)
    real: int = 0  # masked tokens among the ``m`` (the rest: bucket padding)
    rot_key: Any = None  # RoPE cache key of the row's queries (None: its computed tokens)

    @property
    def fresh(self) -> bool:
        """Every token of the job is computed (full and record rows, ratio 1): no cache is read."""
        return self.m == self.own


@dataclass
class _Rot:
    """RoPE at one set of token positions: cos/sin [S, 1, hd] (broadcast over the heads of an
    [S, H, hd] tensor, shaped once per call rather than at every rotation); ``freqs`` complex64
    [S, 1, hd/2] (the same rotation as one complex multiply) or None when cos/sin are not pairwise
    repeated."""

    cos: torch.Tensor
    sin: torch.Tensor
    freqs: torch.Tensor | None


class _Plan:
    """Indices and state for one batched forward; built by the model hook, consumed by the others."""

    def __init__(self, ctx: BatchContext, batch: int, n_tokens: int, device: torch.device,
                 names: list[str], kv_format: KVFormat, dtype: torch.dtype = torch.float32) -> None:
        self.ctx, self.B, self.N, self.device, self.names = ctx, batch, n_tokens, device, names
        # Half precision: attention sees each job's keys in its own token order, as the stock forward
        # does (float32 sums in another order round differently in bf16 and drift over the steps).
        self.half = dtype != torch.float32
        self.kv_format = kv_format
        self.k_key = K_SUFFIX[kv_format]
        self.rows: list[_Row] = []
        self.img: torch.Tensor | None = None          # [M, D] packed image tokens
        self.txt: torch.Tensor | None = None          # [Ba, T, D] text tokens of active rows
        self.T = 0
        self.tok: torch.Tensor | None = None          # [Ba*T + M, D] text + image pack (single blocks)
        self._rot_src: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rot_all: torch.Tensor | None = None
        self._rots: dict[tuple[Any, ...], _Rot] = {}
        self._moved: dict[int, torch.Tensor] = {}
        self._layouts: dict[str, layout.Layout] = {}
        self._rec: list[dict[str, list[torch.Tensor]] | None] = [
            {} if g.mode == "record" else None for g in ctx.groups]
        self._build()

    def _build(self) -> None:
        r = 0
        for gi, g in enumerate(self.ctx.groups):
            sel, unsel, unsel_cache, cache = None, None, None, None
            pos = None if g.positions is None else to_device(g.positions, self.device)
            own = self.N if pos is None else int(pos.numel())
            sel_own, real, reuse = None, 0, None
            if g.mode == "masked":
                tok = g.token_mask if isinstance(g.token_mask, FluxTokens) else FluxTokens.build(g.token_mask,
                                                                                                 self.device)
                if tok.numel() != own:
                    raise ValueError(f"group {gi}: token mask has {tok.numel()} tokens, the job has {own}")
                if tok.sel is not None:
                    sel_own, unsel_cache, real = tok.sel, tok.unsel, tok.masked
                    reuse = g.reuse if tok.m > 0 else None
                    sel = sel_own if pos is None else pos[sel_own]
                    unsel = unsel_cache if pos is None else pos[unsel_cache]
                    cache = g.cache
                    if tok.m > 0:
                        self._check_cache(gi, g.rows, cache, own)
            if sel is None and pos is not None and own != self.N:  # all its tokens, on a larger grid
                sel = pos
                unsel = unsel_cache = pos[:0]
            for crow in range(g.rows):
                m = self.N if sel is None else int(sel.numel())
                self.rows.append(_Row(r, gi, sel, m, cache, g.mode == "record", crow, unsel=unsel,
                                      unsel_cache=unsel_cache, own=own, sel_own=sel_own,
                                      pos_own=pos if pos is not None and own != self.N else None,
                                      reuse=reuse, real=real))
                r += 1
        off, a = 0, 0
        for row in self.rows:
            row.off = off
            off += row.m
            if row.m > 0:
                row.active = a
                a += 1
        self.active = [row for row in self.rows if row.m > 0]
        self.img_segs = [(row.active, row.off, row.off + row.m) for row in self.active]
        self.M = off
        self.all_active = len(self.active) == self.B
        self.active_idx = row_index(tuple(row.row for row in self.active), self.device)
        pos = [torch.arange(self.N, device=self.device) if row.sel is None else row.sel for row in self.active]
        if pos:
            self.img_pos = torch.cat(pos)
            self.img_flat = torch.cat([p + row.row * self.N for p, row in zip(pos, self.active)])
        else:
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            self.img_pos, self.img_flat = empty, empty
        self.identity = self.all_active and all(row.sel is None for row in self.rows)
        self.reusing = any(row.reuse is not None for row in self.active)
        self.unit_reuse: dict[int, Any] = {}  # batch row -> this block's ``reuse.UnitReuse`` (``flux_reuse``)
        self.ctx.image_tokens_computed = self.M
        self.ctx.image_tokens_total = self.B * self.N

    def _check_cache(self, gi: int, rows: int, cache: StepCache | None, own: int) -> None:
        if cache is None:
            raise ValueError(f"group {gi}: a partial mask needs the template's step cache")
        for name in self.names:
            for suffix in (self.k_key, "v"):
                key = f"{name}.{suffix}"
                if key not in cache:
                    raise KeyError(f"group {gi}: step cache lacks {key} (controller kv_format={self.kv_format!r})")
                t = cache[key]
                if t.ndim != 3 or t.shape[0] not in (1, rows) or t.shape[1] != own:
                    raise ValueError(f"group {gi}: cache {key} has shape {tuple(t.shape)}, "
                                     f"want [{rows} or 1, N={own}, D]")

    # --- helpers used by the block math ----------------------------------------------------

    def cached(self, row: _Row, key: str, like: torch.Tensor) -> torch.Tensor:
        """The row's [N, C] slice of a cache tensor on the compute device/dtype; a tensor shared by
        several rows or jobs is converted once per call (dedupe), never copied per row."""
        t = row.cache[key]
        if t.device != like.device or t.dtype != like.dtype:
            if id(t) not in self._moved:
                self._moved[id(t)] = t.to(device=like.device, dtype=like.dtype)
            t = self._moved[id(t)]
        return t[row.crow if t.shape[0] > 1 else 0]

    def rot(self, rope: tuple[torch.Tensor, torch.Tensor], key: tuple[Any, ...],
            pos: torch.Tensor | slice | Callable[[], torch.Tensor]) -> _Rot:
        """RoPE at rope rows ``pos`` (text first, so image token i is row T + i; a callable is asked
        only the first time), computed once per call and position set."""
        if self._rot_src is not rope:
            cos, sin = rope
            pairs = _pairwise(cos, sin)
            self._rot_all = (torch.complex(cos[:, 0::2].float(), sin[:, 0::2].float())[:, None, :]
                             if pairs else None)
            self._rot_src, self._rots = rope, {}
        r = self._rots.get(key)
        if r is None:
            if callable(pos):
                pos = pos()
            if isinstance(pos, torch.Tensor):
                pos = pos.to(rope[0].device)
            freqs = None if self._rot_all is None else self._rot_all[pos]
            r = self._rots[key] = _Rot(rope[0][pos][:, None], rope[1][pos][:, None], freqs)
        return r

    def row_rot(self, rope: tuple[torch.Tensor, torch.Tensor], row: _Row) -> _Rot:
        """RoPE at the row's queries: its text, then its computed tokens at their grid positions."""
        if row.sel is None:
            return self.rot(rope, ("all",), slice(0, self.T + self.N))
        return self.rot(rope, row.rot_key or ("sel", row.row),
                        lambda: self._text_then(row.sel))  # type: ignore[arg-type]

    def own_rot(self, rope: tuple[torch.Tensor, torch.Tensor], row: _Row) -> _Rot:
        """RoPE at the row's keys: its text, then every token of the job at its grid position."""
        if row.pos_own is None:
            return self.rot(rope, ("all",), slice(0, self.T + self.N))
        return self.rot(rope, ("own", row.row), lambda: self._text_then(row.pos_own))  # type: ignore[arg-type]

    def _text_then(self, image_pos: torch.Tensor) -> torch.Tensor:
        """RoPE table rows of the text, then of image tokens at ``image_pos``."""
        return torch.cat([torch.arange(self.T, device=image_pos.device), image_pos + self.T])

    def staged(self, row: _Row, key: str, like: torch.Tensor) -> torch.Tensor:
        """The row's [N, C] slice of a cache tensor, to write the step's fresh tokens into: in place
        in a staged cache (private to the job, ``workers/engine/staging.py``), else in a copy (the
        cache is read-only)."""
        t = row.cache[key]  # type: ignore[index]
        shared = t.shape[0] == 1 and self.ctx.groups[row.group].rows > 1
        t = t[row.crow if t.shape[0] > 1 else 0]
        if (getattr(row.cache, "writable", False) and not shared and t.device == like.device
                and t.dtype == like.dtype):
            return t
        return t.to(device=like.device, dtype=like.dtype, copy=True)

    def single(self) -> _Row | None:
        """The one active row, if the call computes for exactly one (then whole-pack tensors are that
        row's and per-segment work is a plain expression, as in the stock forward)."""
        return self.active[0] if len(self.active) == 1 else None

    def modulate_(self, y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, base: int = 0) -> torch.Tensor:
        """In place: ``y * (1 + scale) + shift`` with each row's own modulation, per packed image segment
        (starting at ``base``); one fused pass, no gathered [M, D] modulation tensors."""
        s1 = 1 + scale
        if base == 0 and self.single() is not None:  # the whole pack is one row's: the stock expression
            return _muladd(y, s1[self.active[0].active], shift[self.active[0].active])
        for a, lo, hi in self.img_segs:
            seg = y[base + lo:base + hi]
            _muladd_into(seg, seg, s1[a], shift[a])
        return y

    def gated_add_(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, base: int = 0) -> torch.Tensor:
        """``x + gate * y`` per packed image segment (starting at ``base``), in place into ``x``; one
        row's whole pack: a new tensor (the stock expression)."""
        if base == 0 and self.single() is not None:
            return _muladd(y, gate[self.active[0].active], x)
        for a, lo, hi in self.img_segs:
            _muladd_into(x[base + lo:base + hi], y[base + lo:base + hi], gate[a], x[base + lo:base + hi])
        return x

    def record(self, name: str, suffix: str, t: torch.Tensor) -> None:
        """Keep an image-token tensor of record rows (each a full, ordered segment of the pack)."""
        for row in self.active:
            if row.record:
                seg = t[row.off:row.off + row.m].detach().flatten(1).clone()  # don't pin the whole pack
                self._rec[row.group].setdefault(f"{name}.{suffix}", []).append(seg)

    def record_row(self, row: _Row, name: str, suffix: str, t: torch.Tensor) -> None:
        """Keep one record row's full, ordered image-token tensor [N, ...]."""
        if row.record:
            self._rec[row.group].setdefault(f"{name}.{suffix}", []).append(t.detach().flatten(1).clone())

    def recorded(self) -> list[dict[str, torch.Tensor] | None]:
        """Per group: name -> [rows, N, C] (fresh tensors, owned by the caller)."""
        def join(parts: list[torch.Tensor]) -> torch.Tensor:
            return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)
        return [None if rec is None else {k: join(v) for k, v in rec.items()} for rec in self._rec]

    def rows_modulation(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.all_active else t[self.active_idx]

    def lay(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """The adapter row layout of what the block math feeds to modules (``workers/adapters/layout``):
        ``rows`` = one row per active batch row ([Ba, ...]: modulation, text), ``img`` = the packed
        image tokens, ``tok`` = the single blocks' pack (each active row's text, then the image tokens).
        A no-op unless some job of the step has adapter terms."""
        if not layout.wanted():
            return contextlib.nullcontext()
        lay = self._layouts.get(kind)
        if lay is None:  # built when first needed: "tok" needs the text length, known after the embedders
            act = self.active
            if kind == "rows":
                lay = layout.rows((row.group, 1) for row in act)
            elif kind == "img":
                lay = layout.flat((row.group, row.m) for row in act)
            else:
                lay = layout.flat([(row.group, self.T) for row in act] + [(row.group, row.m) for row in act])
            self._layouts[kind] = lay
        return layout.use(lay)


# ---------------------------------------------------------------------------------------------
# Block math on the packed state (same submodules and op order as the stock forwards).
# ---------------------------------------------------------------------------------------------


_PAIRWISE: dict[tuple[Any, ...], bool] = {}


def _pairwise(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether RoPE's cos/sin repeat each value over an (even, odd) channel pair (Flux's do): then
    the rotation is one complex multiply. Decided once per table shape: the model builds the same
    tables from the same ids at every call, and comparing them each time would read the device."""
    key = (tuple(cos.shape), cos.dtype, str(cos.device))
    if cos.device.type == "meta":  # shape-only runs (operator counts): FluxPosEmbed's own layout
        return True
    if key not in _PAIRWISE:
        _PAIRWISE[key] = bool(cos.shape[-1] % 2 == 0 and torch.equal(cos[:, 0::2], cos[:, 1::2])
                              and torch.equal(sin[:, 0::2], sin[:, 1::2]))
    return _PAIRWISE[key]


def _muladd_into(out: torch.Tensor, t: torch.Tensor, s: torch.Tensor, add: torch.Tensor) -> None:
    """``out = t * s + add`` (``out`` may alias ``t`` or ``add``). float32: one fused pass (addcmul,
    within float32 rounding of the stock forward). Half precision: the stock forward's two ops, each
    rounded to the dtype, so that the mask-aware path reproduces the stock pipeline in bf16/fp16
    (a fused multiply-add rounds once and drifts by several 1/255 over a denoising loop)."""
    if out.dtype == torch.float32:
        if out.data_ptr() == add.data_ptr() and out.shape == add.shape:
            out.addcmul_(t, s)
        else:
            torch.addcmul(add, t, s, out=out)
        return
    out.copy_(t * s + add)


def _muladd(t: torch.Tensor, s: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """``t * s + add`` as a new tensor, rounded as ``_muladd_into`` rounds it."""
    if t.dtype == torch.float32:
        return torch.addcmul(add, t, s)
    return t * s + add


def _qkv(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(x).chunk(3, dim=-1)
    q, k, v = project((attn.to_q, attn.to_k, attn.to_v), x)
    return q, k, v


def _added_qkv(attn: Any, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False) and hasattr(attn, "to_added_qkv"):
        return attn.to_added_qkv(c).chunk(3, dim=-1)
    q, k, v = project((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), c)
    return q, k, v


def _single_projections(block: FluxSingleTransformerBlock, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A single block's Q, K, V and MLP input projection of ``h`` (one GEMM where they are fused)."""
    attn = block.attn
    if getattr(attn, "fused_projections", False):
        return (*attn.to_qkv(h).chunk(3, dim=-1), block.proj_mlp(h))
    return project((attn.to_q, attn.to_k, attn.to_v, block.proj_mlp), h)


def fuse_projections(model: torch.nn.Module) -> None:
    """Each block's projections of one input made views of one weight (``workers/fused_projections``)."""
    for blk in model.transformer_blocks:
        fuse((blk.attn.to_q, blk.attn.to_k, blk.attn.to_v))
        fuse((blk.attn.add_q_proj, blk.attn.add_k_proj, blk.attn.add_v_proj))
    for blk in model.single_transformer_blocks:
        fuse((blk.attn.to_q, blk.attn.to_k, blk.attn.to_v, blk.proj_mlp))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Flux RoPE (``apply_rotary_emb``, real tables, (even, odd) pairs) on x [S, H, hd] with
    cos/sin [S, 1, hd]: the same operations in the same order, so it rounds as the stock forward does
    in half precision, without the batch axis that diffusers' function takes and gives back (four
    operators fewer per call, two calls per block; ``tests/test_flux_rope.py``)."""
    if x.numel() == 0:
        return x
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _rotate(x: torch.Tensor, rot: _Rot) -> torch.Tensor:
    """``_rope(x)`` at ``rot``'s positions ([S, H, hd]). float32: Flux's RoPE rotates (even, odd)
    channel pairs, i.e. it is a complex multiply, one pass instead of diffusers' five; half
    precision: diffusers' own computation, so that results round as the stock forward's do."""
    if x.shape[0] == 0:
        return x
    if rot.freqs is None or x.dtype != torch.float32:
        return _rope(x, rot.cos, rot.sin)
    if x.stride(-1) != 1 or x.stride(-2) % 2:
        x = x.contiguous()
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot.freqs).flatten(-2)


def _attend(plan: _Plan, attn: Any, name: str, rope: tuple[torch.Tensor, torch.Tensor],
            q: torch.Tensor, k: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor,
            tq: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor,
            joint: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Joint attention per active row, as the stock forward computes it: queries are the row's text
    and computed tokens, keys and values its text and every token of the job in the job's own
    order; returns each row's output [T + m, H, hd] (its text, then its computed tokens).

    q, k: [M, H, hd] qk-normed image tokens (no RoPE yet), ``k_raw``: [M, H*hd] before the norm,
    v: [M, H, hd]; tq, tk, tv: [Ba, T, H, hd] (tq, tk normed); ``joint``: the one active row's
    queries and keys as [T + m, H, hd] (a single block's pack is that row's [text; image]), used
    as they are instead of concatenating their text and image parts again. A row that computes
    only some tokens writes its fresh keys and values into its cache's tensors (``_Plan.staged``:
    in place when the cache is staged for it) and attends over them: ``roped`` caches hold keys
    after qk-norm and RoPE, so only the fresh ones are rotated; ``raw`` ones get the norm and RoPE
    over every key, as in the stock forward.
    """
    T = plan.T
    heads, hd = q.shape[1], q.shape[2]
    backend = getattr(attn.processor, "_attention_backend", None)
    outs = []
    for row in plan.active:
        a, seg = row.active, slice(row.off, row.off + row.m)
        rot = plan.row_rot(rope, row)
        # ``joint``: no slicing of the parts at all (each slice is an operator the host issues)
        query = _rotate(torch.cat([tq[a], q[seg]]) if joint is None else joint[0], rot)
        if row.fresh:
            key = _rotate(torch.cat([tk[a], k[seg]]) if joint is None else joint[1], rot)
            value = torch.cat([tv[a], v[seg]])
            if plan.kv_format == "roped":
                plan.record_row(row, name, K_SUFFIX["roped"], key[T:])
        else:
            unit = plan.unit_reuse.get(row.row)  # temporal reuse: reused tokens from the recent offset
            if plan.kv_format == "roped":
                fresh = _rotate(torch.cat([tk[a], k[seg]]) if joint is None else joint[1], rot)
                cached = _write_fresh(plan.staged(row, f"{name}.{plan.k_key}", k_raw), row, unit, plan.k_key,
                                      fresh[T:].flatten(1))
                key = torch.cat([fresh[:T], cached.unflatten(-1, (heads, hd))])
            else:
                cached = _write_fresh(plan.staged(row, f"{name}.{plan.k_key}", k_raw), row, unit, plan.k_key,
                                      k_raw[seg])
                key = _rotate(torch.cat([tk[a], attn.norm_k(cached.unflatten(-1, (heads, hd)))]),
                              plan.own_rot(rope, row))
            values = _write_fresh(plan.staged(row, f"{name}.v", k_raw), row, unit, "v", v[seg].flatten(1))
            value = torch.cat([tv[a], values.unflatten(-1, (heads, hd))])
        outs.append(dispatch_attention_fn(query[None], key[None], value[None], backend=backend)[0])
    return outs


def _write_fresh(cached: torch.Tensor, row: _Row, unit: Any, kind: str, fresh: torch.Tensor) -> torch.Tensor:
    """The row's fresh tokens [m, C] written into its cache tensor [N, C] (with temporal reuse, the
    reused ones too: ``reuse.UnitReuse.merge``)."""
    if unit is not None:
        return unit.merge(kind, False, cached[None], fresh[None])[0]
    return cached.index_copy_(0, row.sel_own, fresh)  # type: ignore[arg-type]


def _call_module(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class FluxKernels:
    """The packed blocks' feed-forwards (the bulk of their token-wise work) compiled under
    ``STENCIL_COMPILE`` (workers/compiled.py); eager while per-row adapter layouts are in use."""

    def __init__(self, mode: str = "off") -> None:
        self.ff = Compiled(_call_module, "packed Flux feed-forward", mode, own_graphs=False)  # called per block

    def pick(self) -> "FluxKernels":
        return _EAGER_FLUX if layout.wanted() else self


def double_block_forward(block: FluxTransformerBlock, name: str, plan: _Plan, temb: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor], kernels: FluxKernels | None = None) -> None:
    """``FluxTransformerBlock.forward`` on the packed state (updates ``plan.img`` / ``plan.txt``)."""
    kern = (kernels or _EAGER_FLUX).pick()
    x, c = plan.img, plan.txt
    temb = plan.rows_modulation(temb)
    with plan.lay("rows"):
        emb = block.norm1.linear(block.norm1.silu(temb))
        cn, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(c, emb=temb)
        tq, tk, tv = _added_qkv(block.attn, cn)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    xn = plan.modulate_(block.norm1.norm(x), scale_msa, shift_msa)

    attn = block.attn
    hd = attn.head_dim
    with plan.lay("img"):
        q, k, v = _qkv(attn, xn)
    if plan.kv_format == "raw":
        plan.record(name, "k", k)
    plan.record(name, "v", v)
    outs = _attend(plan, attn, name, rope,
                   attn.norm_q(q.unflatten(-1, (-1, hd))), attn.norm_k(k.unflatten(-1, (-1, hd))), k,
                   v.unflatten(-1, (-1, hd)), attn.norm_added_q(tq.unflatten(-1, (-1, hd))),
                   attn.norm_added_k(tk.unflatten(-1, (-1, hd))), tv.unflatten(-1, (-1, hd)))
    T = plan.T
    if len(outs) == 1:  # one row: its output is [text; image] as the stock forward's
        joint = outs[0].flatten(1)
        txt_attn, img_attn = joint[:T][None], joint[T:]
    else:
        txt_attn = torch.stack([o[:T] for o in outs]).flatten(2)
        img_attn = torch.cat([o[T:] for o in outs]).flatten(1)

    with plan.lay("img"):
        attn_out = attn.to_out[1](attn.to_out[0](img_attn))
        x = plan.gated_add_(x, gate_msa, attn_out)              # x is this call's own pack: in place is safe
        xn = plan.modulate_(block.norm2(x), scale_mlp, shift_mlp)
        x = plan.gated_add_(x, gate_mlp, kern.ff(block.ff, xn))

    with plan.lay("rows"):
        ctx_out = attn.to_add_out(txt_attn)
        c = c + c_gate_msa.unsqueeze(1) * ctx_out
        cn = block.norm2_context(c) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        c = c + c_gate_mlp.unsqueeze(1) * kern.ff(block.ff_context, cn)
    if c.dtype == torch.float16:
        c = c.clip(-65504, 65504)
    plan.img, plan.txt = x, c


def single_block_forward(block: FluxSingleTransformerBlock, name: str, plan: _Plan, temb: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor], kernels: FluxKernels | None = None) -> None:
    """``FluxSingleTransformerBlock.forward`` on the packed state: text and image tokens share weights,
    so they run as one token pack ``plan.tok`` (text rows first, then the ragged image tokens), built
    once at the first single block; one row's pack is its [text; image] tokens, computed by the
    stock forward's expressions."""
    ba, T, D = plan.txt.shape
    nt = ba * T
    if plan.tok is None:
        plan.tok = torch.cat([plan.txt.reshape(nt, D), plan.img])
    tok = plan.tok
    temb = plan.rows_modulation(temb)
    with plan.lay("rows"):
        emb = block.norm.linear(block.norm.silu(temb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    h = block.norm.norm(tok)
    one = plan.single()
    if one is not None:  # one row: its text and image tokens share the modulation (the stock expression)
        h = _muladd(h, (1 + scale_msa)[one.active], shift_msa[one.active])
    else:
        if T:
            ht = h[:nt].view(ba, T, D)
            _muladd_into(ht, ht, (1 + scale_msa)[:, None], shift_msa[:, None])
        plan.modulate_(h, scale_msa, shift_msa, base=nt)

    attn = block.attn
    hd = attn.head_dim
    with plan.lay("tok"):
        q, k, v, mlp_in = _single_projections(block, h)
        mlp = block.act_mlp(mlp_in)
    if plan.kv_format == "raw":
        plan.record(name, "k", k[nt:])
    plan.record(name, "v", v[nt:])
    qn = attn.norm_q(q.unflatten(-1, (-1, hd)))
    kn = attn.norm_k(k.unflatten(-1, (-1, hd)))
    vh = v.unflatten(-1, (-1, hd))
    heads = qn.shape[1]
    outs = _attend(plan, attn, name, rope, qn[nt:], kn[nt:], k[nt:], vh[nt:],
                   qn[:nt].view(ba, T, heads, hd), kn[:nt].view(ba, T, heads, hd), vh[:nt].reshape(ba, T, heads, hd),
                   joint=None if one is None else (qn, kn))
    if len(outs) == 1:  # one row: [text; image], the pack's order
        attention = outs[0].flatten(1)
    else:  # the pack's order: every row's text, then every row's image tokens
        attention = torch.cat([torch.stack([o[:T] for o in outs]).flatten(0, 1),
                               torch.cat([o[T:] for o in outs])]).flatten(1)

    with plan.lay("tok"):
        y = (kernels or _EAGER_FLUX).pick().ff(block.proj_out, torch.cat([attention, mlp], dim=1))
    if one is not None:
        tok = _muladd(y, gate_msa[one.active], tok)
    else:
        if T:
            tt = tok[:nt].view(ba, T, D)
            _muladd_into(tt, y[:nt].view(ba, T, D), gate_msa[:, None], tt)
        plan.gated_add_(tok, gate_msa, y, base=nt)
    if tok.dtype == torch.float16:
        tok = tok.clamp_(-65504, 65504)
    plan.tok = tok
    plan.txt = tok[:nt].view(ba, T, D)
    plan.img = tok[nt:]


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------


_EAGER_FLUX = FluxKernels("off")


class _Hook(ModelHook):
    """Base: defer to the stock forward unless a batch plan is active."""

    def __init__(self, ctrl: MaskAwareFlux) -> None:
        super().__init__()
        self.ctrl = ctrl


class _ModelHook(_Hook):
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = self.ctrl._ctx
        if ctx is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        bound = self.ctrl._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        p = bound.arguments
        for key in ("controlnet_block_samples", "controlnet_single_block_samples"):
            if p.get(key) is not None:
                raise NotImplementedError(f"mask-aware Flux does not support {key}")
        if p.get("joint_attention_kwargs"):
            raise NotImplementedError("mask-aware Flux does not support joint_attention_kwargs (IP-Adapter)")
        if ctx.calls:
            raise RuntimeError("one transformer call per batch context (a batch is one denoising step)")
        hs = p["hidden_states"]
        rows = sum(g.rows for g in ctx.groups)
        if hs.shape[0] != rows:
            raise ValueError(f"batch has {hs.shape[0]} rows, the row groups declare {rows}")
        ctx.calls += 1
        self.ctrl._plan = _Plan(ctx, hs.shape[0], hs.shape[1], hs.device, self.ctrl.names, self.ctrl.kv_format,
                                hs.dtype)
        try:
            out = self.fn_ref.original_forward(*args, **kwargs)
            ctx.recorded = self.ctrl._plan.recorded()
        finally:
            self.ctrl._plan = None
        return out


class _XEmbedHook(_Hook):
    def new_forward(self, module: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        plan = self.ctrl._plan
        if plan is None:
            return self.fn_ref.original_forward(hidden_states)
        B, N, C = hidden_states.shape
        flat = hidden_states.reshape(B * N, C)
        with plan.lay("img"):
            plan.img = self.fn_ref.original_forward(flat if plan.identity else flat.index_select(0, plan.img_flat))
        return plan.img.new_zeros(()).expand(B, N, module.out_features)


class _ContextEmbedHook(_Hook):
    def new_forward(self, module: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        plan = self.ctrl._plan
        if plan is None:
            return self.fn_ref.original_forward(hidden_states)
        B, T, _ = hidden_states.shape
        plan.T = T
        rows = hidden_states if plan.all_active else hidden_states[plan.active_idx]
        with plan.lay("rows"):
            plan.txt = self.fn_ref.original_forward(rows)
        return plan.txt.new_zeros(()).expand(B, T, module.out_features)


class _BlockHook(_Hook):
    def __init__(self, ctrl: MaskAwareFlux, name: str, double: bool) -> None:
        super().__init__(ctrl)
        self.name, self.double = name, double

    def new_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                    joint_attention_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.ctrl._plan
        if plan is None:
            return self.fn_ref.original_forward(hidden_states, encoder_hidden_states, temb,
                                                image_rotary_emb, joint_attention_kwargs)
        if plan.active:
            fn = double_block_forward if self.double else single_block_forward
            if plan.reusing:
                reuse_block(fn, module, self.name, plan, temb, image_rotary_emb, self.ctrl.kernels)
            else:
                fn(module, self.name, plan, temb, image_rotary_emb, self.ctrl.kernels)
        return encoder_hidden_states, hidden_states


class _NormOutHook(_Hook):
    def new_forward(self, module: torch.nn.Module, x: torch.Tensor,
                    conditioning_embedding: torch.Tensor) -> torch.Tensor:
        plan = self.ctrl._plan
        if plan is None:
            return self.fn_ref.original_forward(x, conditioning_embedding)
        if plan.active:
            cond = plan.rows_modulation(conditioning_embedding)
            with plan.lay("rows"):
                emb = module.linear(module.silu(cond).to(plan.img.dtype))
            scale, shift = torch.chunk(emb, 2, dim=1)
            plan.img = plan.modulate_(module.norm(plan.img), scale, shift)
        return x


class _ProjOutHook(_Hook):
    def new_forward(self, module: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        plan = self.ctrl._plan
        if plan is None:
            return self.fn_ref.original_forward(hidden_states)
        with plan.lay("img"):
            y = self.fn_ref.original_forward(plan.img)               # [M, out]
        one = plan.single()
        if plan.identity:
            out = y.view(plan.B, plan.N, -1)
        elif (one is not None and plan.B == 1 and not one.fresh and one.own == plan.N and one.cache is not None
              and OUTPUT_KEY in one.cache):  # the fresh tokens into the cached output (staged: in place)
            out = plan.staged(one, OUTPUT_KEY, y)
            out.index_copy_(0, one.sel_own, y)  # type: ignore[arg-type]
            out = out.view(1, plan.N, -1)
        else:
            out = y.new_zeros(plan.B, plan.N, module.out_features)
            for row in plan.rows:
                if row.unsel is not None and row.unsel.numel() and row.cache is not None and OUTPUT_KEY in row.cache:
                    cached = plan.cached(row, OUTPUT_KEY, y)  # copied into a fresh buffer
                    if row.own == plan.N:
                        out[row.row] = cached
                    else:  # on a larger grid: the job's tokens at their places
                        out[row.row].index_copy_(0, row.unsel, cached.index_select(0, row.unsel_cache))
            out.view(plan.B * plan.N, -1).index_copy_(0, plan.img_flat, y)
        for row in plan.rows:
            if row.record:
                mine = out[row.row] if row.own == plan.N else out[row.row].index_select(0, row.sel)
                plan._rec[row.group].setdefault(OUTPUT_KEY, []).append(mine.detach().clone())
        return out


# ---------------------------------------------------------------------------------------------
# Controller
# ---------------------------------------------------------------------------------------------


class MaskAwareFlux:
    """Installs the mask-aware hooks on a ``FluxTransformer2DModel``; see the module docstring."""

    def __init__(self, transformer: FluxTransformer2DModel, kv_format: KVFormat = "roped",
                 compile: str = "off") -> None:
        if kv_format not in K_SUFFIX:
            raise ValueError(f"kv_format must be one of {sorted(K_SUFFIX)}")
        self.model = transformer
        self.kernels = FluxKernels(compile)  # STENCIL_COMPILE
        self.kv_format = kv_format
        self.names = block_names(transformer)
        self._ctx: BatchContext | None = None
        self._plan: _Plan | None = None
        self._signature = inspect.signature(type(transformer).forward)
        self._signature = self._signature.replace(parameters=list(self._signature.parameters.values())[1:])
        self._modules: list[torch.nn.Module] = []
        for blk in transformer.transformer_blocks:
            if getattr(blk.norm1, "emb", None) is not None:
                raise NotImplementedError("AdaLayerNormZero with its own embedding is not a Flux block")
        install_row_aware(transformer)  # adapter terms, job-by-job GEMMs: before any hook captures a forward
        fuse_projections(transformer)
        self._install()

    @property
    def block_names(self) -> list[str]:
        return list(self.names)

    @property
    def cache_layout(self) -> str:
        """Goes into the template cache key: caches of the two K formats are not interchangeable."""
        return f"flux-kv-{self.kv_format}"

    temporal_reuse = True  # masked rows may reuse patches of their last step (``flux_reuse``)
    reuse_family = "flux"  # which trained reuse rule decides (``reuse_rule``)

    @property
    def reuse_units(self) -> list[str]:
        """Temporal reuse decides per block, in execution order."""
        return list(self.names)

    def token_mask(self, pixel_mask: torch.Tensor, dilation: int = 0) -> torch.Tensor:
        """Pixel mask at the job's H x W -> bool [N] packed-token mask (OR-pooled, optional dilation)."""
        return pixel_to_token_mask(pixel_mask, dilate=dilation)

    @staticmethod
    def prepared(token_mask: torch.Tensor, device: torch.device | str, bucketed: bool = False) -> FluxTokens:
        """A job's token mask with its indices on ``device``, built once for all its steps
        (``bucketed``: shapes rounded up to token buckets, ``FluxTokens.build``)."""
        return FluxTokens.build(token_mask, device, bucketed)

    def cache_nbytes(self, image_tokens: int, rows: int = 1, steps: int = 1,
                     dtype: torch.dtype | None = None) -> int:
        """Bytes of ``steps`` step caches for ``rows`` rows at ``image_tokens`` tokens."""
        dtype = dtype or self.model.dtype
        return rows * flux_cache_nbytes(self.model, image_tokens, steps, dtype)

    def _register(self, module: torch.nn.Module, hook: ModelHook) -> None:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        self._modules.append(module)

    def _install(self) -> None:
        m = self.model
        self._register(m.x_embedder, _XEmbedHook(self))
        self._register(m.context_embedder, _ContextEmbedHook(self))
        for i, blk in enumerate(m.transformer_blocks):
            self._register(blk, _BlockHook(self, f"transformer_blocks.{i}", double=True))
        for i, blk in enumerate(m.single_transformer_blocks):
            self._register(blk, _BlockHook(self, f"single_transformer_blocks.{i}", double=False))
        self._register(m.norm_out, _NormOutHook(self))
        self._register(m.proj_out, _ProjOutHook(self))
        self._register(m, _ModelHook(self))
        HookRegistry.check_if_exists_or_initialize(m).invalidate_child_registries_cache()
        log.debug("mask-aware Flux hooks installed on %d blocks", len(self.names))

    def remove(self) -> None:
        """Uninstall every hook this controller added (the model is stock again)."""
        for module in reversed(self._modules):
            module._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
        self._modules.clear()
        HookRegistry.check_if_exists_or_initialize(self.model).invalidate_child_registries_cache()
        unfuse(self.model)

    @contextlib.contextmanager
    def batch(self, groups: Sequence[RowGroup]) -> Iterator[BatchContext]:
        """Make the next transformer call a mixed record/masked/full batch described by ``groups``."""
        if self._ctx is not None:
            raise RuntimeError("a mask-aware batch is already active on this transformer")
        for gi, g in enumerate(groups):
            if g.mode not in ("full", "record", "masked"):
                raise ValueError(f"group {gi}: unknown mode {g.mode!r}")
            if g.rows < 1:
                raise ValueError(f"group {gi}: rows must be >= 1")
            if g.mode == "masked" and g.token_mask is None:
                raise ValueError(f"group {gi}: masked groups need a token_mask")
        self._ctx = BatchContext(groups=tuple(groups), recorded=[None] * len(groups))
        try:
            yield self._ctx
        finally:
            self._ctx = None
