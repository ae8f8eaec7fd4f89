"""One GEMM for the projections that read one input: attention's Q, K and V, cross-attention's K and
V, and in Flux's single blocks Q, K, V and the MLP's input projection.

Why: a mask-aware block computes few tokens, so on a GPU its projections are small GEMMs whose
launches cost about what their arithmetic does; three (or two, or four) become one. The fused
weight is not a copy: the modules' own parameters become views of it (``weight.data``), so the
stock forward, the fused GEMM and in-place changes (an adapter merged in place) read one set of
weights. diffusers' ``fuse_projections`` keeps both, which for an SDXL UNet is 648 M parameters
more (1.3 GB in bfloat16).

``project`` falls back to one GEMM per module, the stock path, wherever the fused one would not
compute what the modules do or would need a copy:
- a module that is not a plain ``nn.Linear`` forward (its own hooks, a PEFT layer, adapter terms
  of the step) or a step computing job by job (``workers/adapters/layout.py``);
- parameters pointed elsewhere (a merged adapter set is swapped in that way,
  ``workers/adapters/merge.py``): the fusion serves again once they come back.
Only ``fuse`` points parameters at new memory, and the mask-aware controllers call it when they are
installed: a step never does, so no captured CUDA graph can be left reading memory that a later
fusion freed. A model moved or cast after that (``to``) computes each projection on its own until
fused again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.adapters import layout
from workers.adapters.patcher import LoraLinear

_PLAIN = (torch.nn.Linear, LoraLinear)  # LoraLinear: the adapter patcher's class, stock without terms


@dataclass(frozen=True)
class Fused:
    """The modules' weights (and biases) as one tensor each, rows in module order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]  # each module's output features
    modules: tuple[weakref.ref, ...]  # the modules, in order (weak: the model owns them)
    places: tuple[int, ...]  # where each module's weight (then bias) starts in memory, as fused

    def serves(self, linears: Sequence[torch.nn.Module]) -> bool:
        """Whether ``linears`` are this fusion's modules and their parameters still its views."""
        if len(linears) != len(self.modules):
            return False
        for ref, m in zip(self.modules, linears):
            if ref() is not m:
                return False
        return _places(linears) == self.places

    def holds(self, p: torch.Tensor) -> bool:
        """Whether parameter ``p`` lies in the fused weight's or bias's memory."""
        mine = [t.untyped_storage().data_ptr() for t in (self.weight, self.bias) if t is not None]
        return p.untyped_storage().data_ptr() in mine


_ATTR = "_stencil_fused"  # where the first module of a fusion keeps it (in its ``__dict__``)


def _plain(m: torch.nn.Module, passive: Sequence[str]) -> bool:
    """Whether ``m``'s forward is ``F.linear`` of its parameters now (diffusers hooks named in
    ``passive``: the caller's own, which do nothing in its call). Read from the instance's
    ``__dict__``: a missing attribute through ``nn.Module.__getattr__`` costs microseconds."""
    own = m.__dict__
    registry = own.get("_diffusers_hook")
    hooks = registry.hooks if registry is not None else None
    if hooks:  # an instance ``forward`` is then diffusers' own (it wraps theirs around the stock one)
        if any(name not in passive for name in hooks):
            return False
    elif "forward" in own:
        return False
    return (type(m) in _PLAIN and not own["_forward_hooks"] and not own["_forward_pre_hooks"]
            and own.get("_stencil_terms") is None)


def _fusable(linears: Sequence[torch.nn.Module]) -> bool:
    first = linears[0]
    return (len(linears) > 1 and all(isinstance(m, torch.nn.Linear) for m in linears)
            and all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                    and m.weight.device == first.weight.device for m in linears)
            and len({m.bias is None for m in linears}) == 1)


@torch.no_grad()
def fuse(linears: Sequence[torch.nn.Linear]) -> Fused | None:
    """Make ``linears``' parameters views of one weight (and bias); None where they cannot be."""
    if not _fusable(linears):
        return None
    known = linears[0].__dict__.get(_ATTR)
    if known is not None and known.serves(linears):
        return known
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    row = 0
    for m in linears:
        size = m.weight.shape[0]
        m.weight.data = weight[row:row + size]
        if bias is not None:
            m.bias.data = bias[row:row + size]
        row += size
    fused = Fused(weight, bias, tuple(m.weight.shape[0] for m in linears), tuple(weakref.ref(m) for m in linears),
                  _places(linears))
    linears[0].__dict__[_ATTR] = fused
    return fused


def _places(linears: Sequence[torch.nn.Module]) -> tuple[int, ...]:
    out = []
    for m in linears:
        params = m._parameters  # not ``m.weight``: ``nn.Module.__getattr__`` is slow on a step's path
        out.append(params["weight"].data_ptr())
        if params.get("bias") is not None:
            out.append(params["bias"].data_ptr())
    return tuple(out)


def unfuse(model: torch.nn.Module) -> None:
    """Give the fused modules of ``model`` parameters of their own again (the stock layout)."""
    with torch.no_grad():
        for owner in list(model.modules()):
            fused = owner.__dict__.pop(_ATTR, None)
            for ref in fused.modules if fused is not None else ():
                m = ref()
                for p in (m.weight, m.bias) if m is not None else ():
                    if p is not None and fused.holds(p):  # a merged set's weight is left where it is
                        p.data = p.data.clone()


def current(linears: Sequence[torch.nn.Linear], passive: Sequence[str] = ()) -> Fused | None:
    """The fusion serving ``linears`` now, if any (``passive``: as ``project``'s)."""
    if layout.wanted() or not all(_plain(m, passive) for m in linears):
        return None
    known = linears[0].__dict__.get(_ATTR)
    return known if known is not None and known.serves(linears) else None


def project(linears: Sequence[torch.nn.Linear], x: torch.Tensor,
            passive: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """Each module of ``linears`` applied to ``x``: one GEMM where their fusion serves, else one
    each (``passive``: names of the caller's diffusers hooks on them that do nothing in this call)."""
    fused = current(linears, passive)
    if fused is None:
        return tuple(m(x) for m in linears)
    return fused_linear(x, fused.weight, fused.bias, fused.sizes)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One GEMM of ``x`` with a fused weight, split back into each module's output."""
    return F.linear(x, weight, bias).split(sizes, dim=-1)


__all__ = ["Fused", "current", "fuse", "fused_linear", "project", "unfuse"]
