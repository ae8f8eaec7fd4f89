"""Mask-aware ResNets of a UNet: a masked job's ResNet convolutions computed only around its masked tokens.

Why: with only the transformer blocks mask-aware, a UNet step keeps every convolution on the whole
map. Counted at true size (``python -m ops.bench.gpu_step --parts flops``), convolutions are 55% of
an SD 1.5 step's FLOPs at 512 px and 24% of SDXL's at 1024 px, so at mask ratio 0.2 no SDXL step
can be more than 2.39x faster than full compute, however well the GPU runs it. Computing the
ResNets around the mask raises that bound to 3.08x (SD 1.5: from 1.52x to 1.98x).

What a masked group computes in a ``ResnetBlock2D`` at a level with masked tokens ``M`` (the
level's token mask, the one its transformer blocks use), ``M'`` being ``M`` grown by ``GROW``:

- the output at ``M'``; elsewhere the group's cache holds the template's output (``<path>.r``),
  as the transformer blocks take unmasked tokens' K/V from it;
- ``conv2`` at ``M'`` reads ``conv1``'s output at ``M'`` grown by one token (``R``), and ``conv1``
  at ``R`` reads the block's input at ``R`` grown by one more: the input is a whole map (the
  previous ResNet or transformer wrote the template's values around its fresh tokens), so
  ``norm1`` normalises it whole, as the original does;
- ``norm2`` normalises with the template's statistics of ``conv1``'s output (``<path>.n2``: mean
  and 1/std per channel and row, recorded with the cache), since that output exists only at ``R``;
  a cache recorded from the same inputs therefore reproduces full compute to float rounding.

A 3x3 convolution at ``P`` positions is one gather of its inputs' 9 neighbours (a zero column where
a neighbour is off the map, as zero padding) and one GEMM with the weight viewed ``[Cout, Cin*9]``:
channel-first ``[C, P]`` columns of every masked row of the call at once, so a batch adds no
GEMMs per job. What a call computes at every level (``ResnetPlan``: which rows compute fully,
which take the masked path, their gathers) is built on the host once per batch composition, its
gathers copied to the device at once and read there without a synchronisation; a graph-captured
step takes them as an input, their column counts rounded up to token buckets (``bucketed``), so a
job of another mask of the same buckets replays the graph. Rows of groups that compute fully
(``full`` and ``record`` groups, a level whose mask is full or covers more than ``DENSE_SHARE`` of
the map once grown) take the original forward; a group with no masked token at the level takes its
cached output as it is. Cached outputs of jobs staged next to each other in one buffer are read as
one slab, and where every row of the call is such a job the slab itself is the output, written in
place (a staged cache is the step's private copy).

Supported: ``ResnetBlock2D`` without an up/down sampler of its own, ``time_embedding_norm``
"default", dropout off (inference). Steps whose jobs keep their own arithmetic (per-job adapter
terms, batch invariance: ``adapters.layout``) run the original forward.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.resnet import ResnetBlock2D

from app.storage.hostcache import to_device
from workers.adapters import layout
from workers.maskaware.buckets import token_bucket
from workers.maskaware.tokens import dilate, row_index

_RESNET_HOOK = "stencil_maskaware_resnet"
UNIT = "resnets"  # the ResNets' tensors as one group of a cache provider's loads (not a plan unit)
# conv1's region over the map above which a level's ResNets compute the whole map: there the
# gathers' traffic and the halo outweigh the GEMMs saved (on the CPU benchmark,
# docs/bench/maskaware_resnets.md, the masked path at mask ratio 0.5 was slower than whole-map ResNets).
DENSE_SHARE = 0.5
# Tokens by which a ResNet's computed region exceeds the level's masked tokens: with none, tokens at
# the mask's edge read the template's values all around and `fast` edits on the spring trace lost
# about 0.012 SSIM against whole-map ResNets; with one, 0.004 (docs/bench/fidelity_resnets.md).
GROW = 1
INDEX_MEMO = 256  # batch compositions x levels whose gathers are kept (a few MB of indices at most)
_NEIGHBOURS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]  # a 3x3 kernel's taps, weight order


def supported(module: ResnetBlock2D) -> bool:
    """Whether the masked path reproduces ``module``'s forward (see the module doc)."""
    return (module.upsample is None and module.downsample is None and module.time_embedding_norm == "default"
            and module.conv1.kernel_size == (3, 3) and module.conv2.kernel_size == (3, 3)
            and module.conv1.padding == (1, 1) and module.conv2.padding == (1, 1)
            and module.conv1.stride == (1, 1) and module.conv2.stride == (1, 1)
            and module.conv1.dilation == (1, 1) and module.conv2.dilation == (1, 1)
            and module.conv1.groups == 1 and module.conv2.groups == 1 and module.time_emb_proj is not None
            and module.norm2.affine
            and (module.conv_shortcut is None or module.conv_shortcut.kernel_size == (1, 1)))


@dataclass(frozen=True)
class MaskedRows:
    """One masked group's rows in a call: ``local``: its first row among the call's masked rows."""

    start: int
    rows: int
    local: int
    mask: torch.Tensor  # [H, W] bool, the level's token mask


@dataclass(frozen=True)
class ResnetIndex:
    """Columns of one level's masked rows (channel-first ``[C, rows * H * W]`` maps, local rows)."""

    gather1: torch.Tensor  # [9 * P1]: conv1's inputs at R, tap-major; rows*N = the zero column
    rows1: torch.Tensor  # [P1]: local row of each conv1 output column
    gather2: torch.Tensor  # [9 * P2]: conv2's inputs at M, tap-major: 0 = the zero column, j + 1 = conv1's column j
    out_rows: torch.Tensor  # [P2]: batch row of each output column
    out_pos: torch.Tensor  # [P2]: token of each output column
    local_rows: torch.Tensor  # [P2]: local row of each output column
    p1: int
    p2: int


def build_index(groups: Sequence[MaskedRows], hw: tuple[int, int], device: torch.device,
                grow: int = 0, bucketed: bool = False) -> ResnetIndex:
    """The gathers of ``groups`` (host work, once per batch composition; one copy to the device);
    each group computes its mask grown by ``grow`` tokens. ``bucketed``: the column counts rounded
    up to token buckets (``buckets.token_bucket``), the pads repeating the last column (the same
    values computed again and written to the same place), so that graph-captured steps of other
    masks of the same buckets share shapes."""
    parts, p1, p2 = _host_index(groups, hw, grow, bucketed)
    return ResnetIndex(*to_device(torch.cat(parts), device).split([t.numel() for t in parts]), p1=p1, p2=p2)


def _host_index(groups: Sequence[MaskedRows], hw: tuple[int, int], grow: int,
                bucketed: bool) -> tuple[list[torch.Tensor], int, int]:
    h, w = hw
    n = h * w
    total_local = sum(g.rows for g in groups)
    zero1 = total_local * n
    g1: list[torch.Tensor] = []
    rows1: list[torch.Tensor] = []
    g2: list[torch.Tensor] = []
    out_rows: list[torch.Tensor] = []
    out_pos: list[torch.Tensor] = []
    local_rows: list[torch.Tensor] = []
    p1 = 0
    for grp in groups:
        m = dilate(grp.mask.reshape(h, w).bool().cpu(), grow)
        r = dilate(m, 1)
        pos2 = m.reshape(-1).nonzero().reshape(-1)
        pos1 = r.reshape(-1).nonzero().reshape(-1)
        ys1, xs1 = pos1 // w, pos1 % w
        ys2, xs2 = pos2 // w, pos2 % w
        local_of = torch.full((n,), -1, dtype=torch.long)
        local_of[pos1] = torch.arange(pos1.numel())
        taps1, taps2 = [], []
        for dy, dx in _NEIGHBOURS:
            y, x = ys1 + dy, xs1 + dx
            valid = (y >= 0) & (y < h) & (x >= 0) & (x < w)
            taps1.append(torch.where(valid, y.clamp(0, h - 1) * w + x.clamp(0, w - 1), -1))
            y, x = ys2 + dy, xs2 + dx
            valid = (y >= 0) & (y < h) & (x >= 0) & (x < w)
            taps2.append(torch.where(valid, local_of[y.clamp(0, h - 1) * w + x.clamp(0, w - 1)], -1))
        t1, t2 = torch.stack(taps1), torch.stack(taps2)  # [9, |R|], [9, |M|]
        for k in range(grp.rows):
            row = grp.local + k
            g1.append(torch.where(t1 >= 0, row * n + t1, zero1))
            rows1.append(torch.full((pos1.numel(),), row, dtype=torch.long))
            g2.append(torch.where(t2 >= 0, p1 + t2 + 1, 0))  # conv1's columns follow the zero column
            out_rows.append(torch.full((pos2.numel(),), grp.start + k, dtype=torch.long))
            out_pos.append(pos2)
            local_rows.append(torch.full((pos2.numel(),), row, dtype=torch.long))
            p1 += pos1.numel()
    gather1, r1 = torch.cat(g1, dim=1), torch.cat(rows1)
    gather2 = torch.cat(g2, dim=1)
    o_rows, o_pos, l_rows = torch.cat(out_rows), torch.cat(out_pos), torch.cat(local_rows)
    p2 = int(o_rows.numel())
    if bucketed:
        b1, b2 = token_bucket(p1, total_local * n), token_bucket(p2, total_local * n)
        gather1, r1 = _repeat_last(gather1, b1), _repeat_last(r1, b1)
        gather2, o_rows, o_pos, l_rows = (_repeat_last(t, b2) for t in (gather2, o_rows, o_pos, l_rows))
        p1, p2 = b1, b2
    return [gather1.reshape(-1), r1, gather2.reshape(-1), o_rows, o_pos, l_rows], p1, p2


def _repeat_last(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` (columns on its last axis) padded to ``length`` columns with copies of its last one."""
    pad = length - t.shape[-1]
    return t if pad <= 0 else torch.cat([t, t[..., -1:].expand(*t.shape[:-1], pad)], dim=-1)


def stats(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``GroupNorm`` statistics of ``x`` [B, C, H, W] per row and channel: [B, 2, C] float32 (mean,
    1/std), what ``norm2`` of a masked step uses (the module doc)."""
    b, c = x.shape[:2]
    var, mean = torch.var_mean(x.float().reshape(b, groups, -1), dim=2, correction=0)
    rstd = (var + eps).rsqrt()
    return torch.stack([mean, rstd], dim=1).repeat_interleave(c // groups, dim=2)


@dataclass(frozen=True)
class Constants:
    """What a masked forward reads of a module's parameters, prepared once rather than every call
    (each a kernel on a GPU): ``norm2``'s affine in float32, where the statistics are combined,
    and ``conv2``'s bias with the shortcut's added (both outputs are summed into the block's)."""

    norm2_weight: torch.Tensor
    norm2_bias: torch.Tensor
    out_bias: torch.Tensor | None  # [Cout, 1]
    versions: tuple[int, ...]  # the parameters' versions it was made from


def _parameters(module: ResnetBlock2D) -> list[torch.Tensor]:
    sc = module.conv_shortcut
    return [p for p in (module.norm2.weight, module.norm2.bias, module.conv2.bias, sc and sc.bias)
            if p is not None]


def constants(module: ResnetBlock2D, known: Constants | None = None) -> Constants:
    """``module``'s ``Constants``: ``known`` when its parameters have not changed since; changed in
    place (e.g. a fused adapter), ``known``'s tensors updated in place, so that a captured CUDA graph
    reading them sees the change rather than freed memory; moved or cast, made anew."""
    versions = tuple(v for p in _parameters(module) for v in (p._version, p.data_ptr()))
    if known is not None and known.versions == versions:
        return known
    with torch.no_grad():
        biases = [b for b in (module.conv2.bias, module.conv_shortcut and module.conv_shortcut.bias)
                  if b is not None]
        out_bias = None if not biases else (biases[0] if len(biases) == 1 else biases[0] + biases[1])[:, None]
        fresh = Constants(module.norm2.weight.float(), module.norm2.bias.float(),
                          None if out_bias is None else out_bias.contiguous(), versions)
        if known is None or known.norm2_weight.device != fresh.norm2_weight.device or (
                (known.out_bias is None) != (fresh.out_bias is None)):
            return fresh
        for old, new in ((known.norm2_weight, fresh.norm2_weight), (known.norm2_bias, fresh.norm2_bias),
                         (known.out_bias, fresh.out_bias)):
            if old is not None and new is not None and old.data_ptr() != new.data_ptr():
                old.copy_(new)
        return dataclasses.replace(known, versions=versions)


def masked_forward(module: ResnetBlock2D, x: torch.Tensor, temb: torch.Tensor, index: ResnetIndex,
                   norm2_stats: torch.Tensor, const: Constants | None = None,
                   temb_act: torch.Tensor | None = None) -> torch.Tensor:
    """Fresh outputs at the masked tokens, ``[Cout, P2]``: ``x`` [Bm, C, H, W] and ``temb`` [Bm, T]
    are the call's masked rows, ``norm2_stats`` their template statistics [Bm, 2, Cout] (as cached),
    ``const`` the module's ``constants`` (made here when not given), ``temb_act`` the activated
    ``temb`` where the caller has it (every ResNet of a call activates the same embedding)."""
    const = constants(module) if const is None else const
    if temb_act is None:
        temb_act = temb if module.skip_time_act else module.nonlinearity(temb)
    bm, c, h, w = x.shape
    n = h * w
    cout = module.conv1.out_channels
    # One buffer for both convolutions' inputs, channel-first, sharing one zero column (the padding):
    # silu(norm1(x)) in its columns before it, conv2's input (norm2's output) in those after it.
    buf = x.new_empty(max(c, cout), bm * n + 1 + index.p1)
    buf[:, bm * n].zero_()
    a = buf[:c, :bm * n + 1]
    torch.ops.aten.silu.out(module.norm1(x), out=a[:, :-1].view(c, bm, h, w).transpose(0, 1))
    g1 = a.index_select(1, index.gather1).view(c * 9, index.p1)
    h1 = torch.addmm(module.conv1.bias[:, None], module.conv1.weight.reshape(cout, c * 9), g1) \
        if module.conv1.bias is not None else module.conv1.weight.reshape(cout, c * 9) @ g1
    t = module.time_emb_proj(temb_act)  # [Bm, Cout]
    # norm2(h1 + t) = h1 * scale + shift per row and channel: scale = rstd * weight and shift =
    # bias - mean * scale + t * scale, computed in float32 (16-bit operands promoted, not copied)
    # and written in the model's dtype
    affine = x.new_empty(2, bm, cout)
    torch.mul(norm2_stats[:, 1], const.norm2_weight, out=affine[0])
    base = torch.addcmul(const.norm2_bias, norm2_stats[:, 0], affine[0], value=-1)
    torch.addcmul(base, t, affine[0], out=affine[1])
    affine = affine.transpose(1, 2).index_select(2, index.rows1)  # [2, Cout, P1]
    hp = buf[:cout, bm * n:]  # the zero column, then conv1's columns
    torch.ops.aten.silu.out(torch.addcmul(affine[1], h1, affine[0]), out=hp[:, 1:])
    g2 = hp.index_select(1, index.gather2).view(cout * 9, index.p2)
    conv2 = module.conv2
    w2 = conv2.weight.reshape(conv2.out_channels, cout * 9)
    h2 = w2 @ g2 if const.out_bias is None else torch.addmm(const.out_bias, w2, g2)  # both biases
    skip = x.view(bm, c, n).transpose(1, 2)[index.local_rows, index.out_pos].t()  # [C, P2]
    if module.conv_shortcut is not None:
        out = torch.addmm(h2, module.conv_shortcut.weight.reshape(-1, c), skip)
    else:
        out = h2.add_(skip)
    if module.output_scale_factor != 1.0:
        out = out.div_(module.output_scale_factor)
    return out


@dataclass(frozen=True)
class LevelPlan:
    """One level's ResNets in a call: rows computed fully (and, among them, what record groups
    keep: group, position, rows), masked groups (group, first row, rows) and their gathers, and
    groups without a masked token there (group, first row, rows), which take their cached output."""

    full: tuple[int, ...]
    record: tuple[tuple[int, int, int], ...]
    masked: tuple[tuple[int, int, int], ...]
    empty: tuple[tuple[int, int, int], ...]
    index: ResnetIndex | None

    @functools.cached_property
    def masked_rows(self) -> tuple[int, ...]:
        return tuple(s for _g, start, rows in self.masked for s in range(start, start + rows))

    @functools.cached_property
    def cached(self) -> list[tuple[int, int, int]]:
        """Groups whose output starts as their cached one (masked and empty), in row order."""
        return sorted(self.empty + self.masked, key=lambda m: m[1])

    @property
    def structure(self) -> tuple[Any, ...]:
        sizes = (0, 0) if self.index is None else (self.index.p1, self.index.p2)
        return self.full, self.record, self.masked, self.empty, sizes


@dataclass(frozen=True)
class ResnetPlan:
    """Every level's ``LevelPlan`` of a call (by map size); ``data``: the levels' gathers in one
    device tensor (what a graph-captured call takes as an input, ``over`` rebuilding the plan on
    another tensor of its shape); ``structure``: what fixes the call's shapes and control flow."""

    levels: dict[tuple[int, int], LevelPlan]
    data: torch.Tensor | None = None

    @property
    def structure(self) -> tuple[Any, ...]:
        return tuple((hw, lv.structure) for hw, lv in sorted(self.levels.items()))

    def over(self, data: torch.Tensor) -> "ResnetPlan":
        """The same plan reading its gathers from ``data``: one tensor of every level's gathers in
        level order (``self.data``, or a graph's static copy of it)."""
        levels, offset = {}, 0
        for hw, lv in self.levels.items():
            index = None
            if lv.index is not None:
                sizes = [t.numel() for t in _gathers(lv.index)]
                index = ResnetIndex(*data[offset:offset + sum(sizes)].split(sizes), p1=lv.index.p1, p2=lv.index.p2)
                offset += sum(sizes)
            levels[hw] = dataclasses.replace(lv, index=index)
        return ResnetPlan(levels, data)

    @classmethod
    def build(cls, groups: Sequence[Any], device: torch.device, forced: frozenset[int], own_arithmetic: bool,
              bucketed: bool) -> "ResnetPlan":
        starts = [0]
        for grp in groups[:-1]:
            starts.append(starts[-1] + grp.rows)
        shapes = {tuple(lvl.shape) for grp in groups if grp.mode == "masked" for lvl in grp.token_mask.levels}
        levels: dict[tuple[int, int], LevelPlan] = {}
        for hw in sorted(shapes):
            n = hw[0] * hw[1]
            full: list[int] = []
            record: list[tuple[int, int, int]] = []
            masked: list[tuple[int, MaskedRows]] = []
            empty: list[tuple[int, int, int]] = []
            local = 0
            for g, (grp, s) in enumerate(zip(groups, starts)):
                if grp.mode == "masked" and not own_arithmetic and g not in forced:
                    tm = grp.token_mask
                    m = tm.masked(n)
                    if m == 0:
                        empty.append((g, s, grp.rows))
                        continue
                    if m < n and tm.grown(n, GROW + 1) <= DENSE_SHARE * n:  # else the masked path does not pay
                        masked.append((g, MaskedRows(s, grp.rows, local, tm.levels[tm.level_for_tokens(n)])))
                        local += grp.rows
                        continue
                if grp.mode == "record":
                    record.append((g, len(full), grp.rows))
                full.extend(range(s, s + grp.rows))
            if not masked and not empty:
                continue  # the original forward for every row
            index = None
            if masked:  # on the host for now: every level's gathers go to the device in one copy, below
                parts, p1, p2 = _host_index([mr for _g, mr in masked], hw, GROW, bucketed)
                index = ResnetIndex(*parts, p1=p1, p2=p2)
            levels[hw] = LevelPlan(tuple(full), tuple(record), tuple((g, mr.start, mr.rows) for g, mr in masked),
                                   tuple(empty), index)
        host = [t for lv in levels.values() if lv.index is not None for t in _gathers(lv.index)]
        return cls(levels).over(to_device(torch.cat(host), device)) if host else cls(levels)


@functools.lru_cache(maxsize=4096)
def _span(rows: tuple[int, ...]) -> slice | None:
    """``rows`` (not empty) as a slice where they follow each other (a view: no kernel), else None."""
    return slice(rows[0], rows[0] + len(rows)) if rows == tuple(range(rows[0], rows[0] + len(rows))) else None


def _select(t: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """Batch rows ``rows`` of ``t``: a view where they follow each other, else one gather."""
    span = _span(rows)
    return t[span] if span is not None else t.index_select(0, row_index(rows, t.device))


def _gathers(index: ResnetIndex) -> list[torch.Tensor]:
    """An index's tensors in field order (how ``ResnetPlan.data`` lays them out)."""
    return [getattr(index, f.name) for f in fields(ResnetIndex) if f.name not in ("p1", "p2")]


class _ResnetHook(ModelHook):
    def __init__(self, owner: "MaskedResnets", name: str) -> None:
        super().__init__()
        self.owner = owner
        self.name = name

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.owner.forward(self.name, module, self.fn_ref.original_forward, args, kwargs)


class MaskedResnets:
    """Hooks on a UNet's supported ``ResnetBlock2D`` modules, driven by a mask-aware controller's
    batch context (``workers/maskaware/unet.py``: ``context()`` returns it, or None outside one)."""

    def __init__(self, unet: torch.nn.Module, context: Callable[[], Any]) -> None:
        self.context = context
        self.modules: dict[str, ResnetBlock2D] = {
            name: mod for name, mod in unet.named_modules() if isinstance(mod, ResnetBlock2D) and supported(mod)}
        self._tls = threading.local()
        # Column counts in token buckets in every call (``plan``): where steps are graph-captured,
        # so that eager steps compute what replayed ones do (set by the runner).
        self.bucketed = False
        self._indices: OrderedDict[Any, tuple[ResnetPlan, list[Any]]] = OrderedDict()
        self._constants: dict[str, Constants] = {}
        self._handles = []
        for name, mod in self.modules.items():
            HookRegistry.check_if_exists_or_initialize(mod).register_hook(_ResnetHook(self, name), _RESNET_HOOK)
            self._handles.append(mod.norm2.register_forward_pre_hook(self._norm2_pre))

    def tensor_names(self) -> list[str]:
        return [f"{name}.{kind}" for name in self.modules for kind in ("r", "n2")]

    def tensor_shapes(self, level_hw: Callable[[str], tuple[int, int]]) -> dict[str, tuple[int, ...]]:
        """Per-row shapes of the cached tensors (``level_hw``: a ResNet's map size from its path)."""
        out: dict[str, tuple[int, ...]] = {}
        for name, mod in self.modules.items():
            h, w = level_hw(name)
            out[f"{name}.r"] = (mod.conv2.out_channels, h, w)
            out[f"{name}.n2"] = (2, mod.conv1.out_channels)
        return out

    def remove(self) -> None:
        for mod in self.modules.values():
            mod._diffusers_hook.remove_hook(_RESNET_HOOK, recurse=False)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _norm2_pre(self, module: torch.nn.Module, args: tuple) -> None:
        capture = getattr(self._tls, "capture", None)
        if capture is not None:
            capture["n2"] = stats(args[0], module.num_groups, module.eps)

    def plan(self, groups: Sequence[Any], device: torch.device, forced: frozenset[int] = frozenset(),
             own_arithmetic: bool = False, bucketed: bool = False) -> "ResnetPlan":
        """How a call of ``groups`` computes its ResNets at every level (memoized per composition):
        ``forced``: masked groups computing them fully (their tensors not resident); ``own_arithmetic``:
        every row fully (``adapters.layout``); ``bucketed``: column counts in token buckets (a
        graph-captured call, ``workers/engine/graph_calls``)."""
        key = (str(device), forced, own_arithmetic, bucketed,
               tuple((g.mode, g.rows, id(g.token_mask)) for g in groups))
        entry = self._indices.get(key)
        if entry is not None:
            self._indices.move_to_end(key)
            return entry[0]
        built = ResnetPlan.build(groups, device, forced, own_arithmetic, bucketed)
        # The entry keeps the masks it was built from alive, so their ids in the key stay theirs.
        self._indices[key] = (built, [g.token_mask for g in groups])
        while len(self._indices) > INDEX_MEMO:
            self._indices.popitem(last=False)
        return built

    def forward(self, name: str, module: ResnetBlock2D, original: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        ctx = self.context()
        x = args[0] if args else kwargs["input_tensor"]
        temb = args[1] if len(args) > 1 else kwargs.get("temb")
        if ctx is None or temb is None:
            return original(*args, **kwargs)
        b, _c, h, w = x.shape
        if ctx.resnet_plan is None:
            ctx.resnet_plan = self.plan(ctx.groups, x.device, ctx.forced_full(UNIT), layout.wanted(), self.bucketed)
        level = ctx.resnet_plan.levels.get((h, w))
        if level is None:  # every row computes fully: no masked group at this level
            record = [(g, s, grp.rows) for g, (grp, s) in enumerate(zip(ctx.groups, ctx.starts))
                      if grp.mode == "record"]
            return self._full(name, original, x, temb, ctx, record)
        c2 = module.conv2.out_channels
        cached = self._runs(ctx, level.cached, name, "r", (c2, h, w))
        if not level.full and len(cached) == 1 and cached[0][1] == b and getattr(cached[0][3], "writable", False):
            out = cached[0][2]  # every row's cache in one private staged slab: the output, written in place
        else:
            out = x.new_empty(b, c2, h, w)
            for start, rows, t, _cache in cached:
                out[start:start + rows] = t
        if level.full:
            y = self._full(name, original, _select(x, level.full), _select(temb, level.full), ctx, level.record)
            span = _span(level.full)
            if span is None:
                out.index_copy_(0, row_index(level.full, x.device), y)
            else:
                out[span] = y
        if level.masked:
            self._masked(name, module, x, temb, ctx, level, out)
        return out

    def _full(self, name: str, original: Any, x: torch.Tensor, temb: torch.Tensor, ctx: Any,
              record: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """The original forward of the fully computed rows; record groups (group, position among
        these rows, rows) keep its output and ``norm2``'s statistics."""
        if record:
            self._tls.capture = {}
        try:
            y = original(x, temb)
            cap = getattr(self._tls, "capture", None)
        finally:
            self._tls.capture = None
        for g, pos, r in record:
            rec = ctx.recorded[g]
            rec[f"{name}.r"] = y[pos:pos + r].detach().clone()
            rec[f"{name}.n2"] = cap["n2"][pos:pos + r].clone()
        return y

    def _masked(self, name: str, module: ResnetBlock2D, x: torch.Tensor, temb: torch.Tensor, ctx: Any,
                level: "LevelPlan", out: torch.Tensor) -> None:
        b, _c, h, w = x.shape
        c2 = module.conv2.out_channels
        norm_stats = [t for _s, _r, t, _c in self._runs(ctx, level.masked, name, "n2",
                                                         (2, module.conv1.out_channels))]
        xm, tm = _select(x, level.masked_rows), _select(temb, level.masked_rows)
        st = norm_stats[0] if len(norm_stats) == 1 else torch.cat(norm_stats)
        assert level.index is not None
        const = self._constants[name] = constants(module, self._constants.get(name))
        act = self._activated(module, temb, level.masked_rows, tm)
        fresh = masked_forward(module, xm, tm, level.index, st, const, act)
        out.view(b, c2, h * w).transpose(1, 2).index_put_((level.index.out_rows, level.index.out_pos), fresh.t())

    def _activated(self, module: ResnetBlock2D, temb: torch.Tensor, rows: tuple[int, ...],
                   selected: torch.Tensor) -> torch.Tensor:
        """The activated time embedding of a call's masked rows, computed by the first ResNet of
        the call that needs it and reused by the others (one kernel each, otherwise). The memo holds
        ``temb`` itself, so a later call's embedding is never mistaken for it."""
        if module.skip_time_act:
            return selected
        key = (rows, type(module.nonlinearity))
        memo = getattr(self._tls, "activated", None)
        if memo is None or memo[0] is not temb or memo[1] != key:
            memo = self._tls.activated = (temb, key, module.nonlinearity(selected))
        return memo[2]

    def _runs(self, ctx: Any, groups: Sequence[tuple[int, int, int]], name: str, kind: str,
              shape: tuple[int, ...]) -> list[tuple[int, int, torch.Tensor, Any]]:
        """The cached ``kind`` tensors of ``groups`` (group, first row, rows; in row order) as
        (first row, rows, tensor, cache) runs: groups whose rows follow each other and whose caches
        are adjacent in one staged buffer read as one slab (``staging.StagedCache.slab``), so a
        batch of jobs costs one copy, not one per job."""
        runs: list[tuple[int, int, torch.Tensor, Any]] = []
        prev = None
        for g, start, rows in groups:
            cache = ctx.groups[g].cache
            t = self._cached(ctx, g, name, kind, (rows, *shape))
            follows = bool(runs) and runs[-1][0] + runs[-1][1] == start
            if follows and hasattr(prev, "adjacent") and prev.adjacent(cache):
                first, total, _t, head = runs[-1]
                runs[-1] = (first, total + rows, head.slab(f"{name}.{kind}", total + rows), head)
            else:
                runs.append((start, rows, t, cache))
            prev = cache
        return runs

    @staticmethod
    def _cached(ctx: Any, g: int, name: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        cache = ctx.groups[g].cache
        key = f"{name}.{kind}"
        if cache is None or key not in cache:
            raise KeyError(f"group {g}: cache lacks {key!r} (recorded without mask-aware ResNets?)")
        t = cache[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"group {g}: cached {key} has shape {tuple(t.shape)}, need {shape}")
        return t


__all__ = ["UNIT", "Constants", "LevelPlan", "MaskedResnets", "MaskedRows", "ResnetIndex", "ResnetPlan", "build_index",
           "constants", "masked_forward", "stats", "supported"]
