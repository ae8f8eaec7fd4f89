"""Compiled denoising steps (``STENCIL_COMPILE``): ``torch.compile`` of the full denoiser forward and
of the mask-aware controllers' per-block token-wise computations, eager when compilation fails.

``dynamic=True`` because the packed computations see a different token count almost every call
(ragged packs of masked tokens) and the full forward a different batch: one graph per module shape
instead of one per token count. Modules are arguments (dynamo inlines them and takes their
parameters as graph inputs), so same-shaped blocks share a graph and merged LoRA weights are seen.
A module with an instance ``forward`` (a diffusers hook: the mask-aware controllers' capture hooks
on K and V) is guarded by that function's identity, so each block would compile anew, and past
dynamo's recompile limit run eagerly: projections whose fusion serves (``fused_projections``) go in
as the fused weight and bias instead, one GEMM in one graph for every block of a shape.
Compilation happens at the first call of each shape; a failure (no C++ compiler, an unsupported
op) is logged once and that function runs eagerly from then on.

CUDA graphs of whole steps are ``workers/engine/graphs.py``'s (``STENCIL_CUDA_GRAPHS``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from workers.fused_projections import current, fused_linear, project

log = logging.getLogger(__name__)

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
R = TypeVar("R")


def check_mode(mode: str) -> str:
    mode = (mode or "off").strip().lower()
    if mode not in COMPILE_MODES:
        raise ValueError(f"STENCIL_COMPILE must be one of {COMPILE_MODES}, got {mode!r}")
    return mode


# The torch.compile mode of a function whose outputs feed the next compiled call before the step
# is over (the packed blocks' computations, block after block), for each STENCIL_COMPILE mode: no
# CUDA graphs of torch.compile's own there. Under them each call of a compiled function starts a
# new graph generation and frees the previous call's outputs, which the next call still reads
# (pytorch/pytorch#160281, #152887).
WITHOUT_OWN_GRAPHS = {"default": None, "reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


class Compiled(Generic[R]):
    """``fn`` through ``torch.compile(dynamic=True)`` under ``mode``, or as is with mode ``off``.
    The first failure of the compiled function logs and switches it to eager for good (eager then
    raises whatever error the inputs themselves cause). ``own_graphs=False``: never torch.compile's
    own CUDA graphs (``WITHOUT_OWN_GRAPHS``), for functions called several times within a step."""

    def __init__(self, fn: Callable[..., R], name: str, mode: str = "off", own_graphs: bool = True) -> None:
        self.fn, self.name, self.mode = fn, name, check_mode(mode)
        self.failed = False
        self._compiled: Callable[..., R] | None = None
        if self.mode != "off":
            own = None if self.mode == "default" else self.mode
            self._compiled = torch.compile(fn, dynamic=True, mode=own if own_graphs else WITHOUT_OWN_GRAPHS[self.mode])

    @property
    def active(self) -> bool:
        return self._compiled is not None and not self.failed

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if self._compiled is None or self.failed:
            return self.fn(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as exc:  # compilation (or a compiled kernel) failed: eager from now on
            self.failed = True
            log.warning("torch.compile of %s failed (%s: %s); running it eagerly", self.name,
                        type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
            return self.fn(*args, **kwargs)


# -- the token-wise pieces of a BasicTransformerBlock on a packed token matrix [M, C] ---------------
# Same submodules and op order as diffusers' BasicTransformerBlock.forward (norm_type layer_norm).


def attn_out_residual(attn: Any, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = attn.to_out[1](attn.to_out[0](o))
    if attn.rescale_output_factor != 1.0:  # dividing by 1 changes no bit: a kernel per call saved
        y = y / attn.rescale_output_factor
    return y + x


def cross_q(blk: Any, x: torch.Tensor) -> torch.Tensor:
    return blk.attn2.to_q(blk.norm2(x))


def ff_residual(blk: Any, x: torch.Tensor) -> torch.Tensor:
    return blk.ff(blk.norm3(x)) + x


def self_qkv_fused(blk: Any, x: torch.Tensor, passive: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """Self-attention's Q, K and V of ``norm1(x)``, one GEMM where the fusion serves
    (``workers/fused_projections.py``)."""
    a1 = blk.attn1
    return project((a1.to_q, a1.to_k, a1.to_v), blk.norm1(x), passive)


def text_kv_fused(attn: Any, src: torch.Tensor, passive: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """Cross-attention's K and V of the text, one GEMM where the fusion serves."""
    return project((attn.to_k, attn.to_v), src, passive)


def norm_then_fused(norm: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return fused_linear(norm(x), weight, bias, sizes)


class CompiledProjections:
    """A block's projections of one input under ``torch.compile``: the fused weight as a graph
    input where the modules' fusion serves (one graph for all blocks of a shape, whatever hooks
    the modules carry). Where it does not (an adapter's terms, a merged set's own weights), the
    modules run eagerly: compiled, their hooks would make a graph per block."""

    def __init__(self, linears: Callable[[Any], tuple[Any, ...]], before: Callable[[Any], Any] | None,
                 eager: Callable[..., tuple[torch.Tensor, ...]], name: str, mode: str,
                 passive: Sequence[str]) -> None:
        self.linears, self.before, self.passive, self.eager = linears, before, tuple(passive), eager
        self.fused = Compiled(fused_linear if before is None else norm_then_fused, name, mode, own_graphs=False)

    @property
    def active(self) -> bool:
        return self.fused.active

    def __call__(self, owner: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        f = current(self.linears(owner), self.passive)
        if f is None:
            return self.eager(owner, x)
        if self.before is None:
            return self.fused(x, f.weight, f.bias, f.sizes)
        return self.fused(self.before(owner), x, f.weight, f.bias, f.sizes)


class BlockKernels:
    """The packed path's token-wise computations, compiled together under one mode (never with
    torch.compile's own CUDA graphs: ``WITHOUT_OWN_GRAPHS``). A block's projections of one input
    run as one GEMM where the modules allow it (``passive``: names of the caller's diffusers hooks
    on them that do nothing in the packed path), eager or compiled."""

    def __init__(self, mode: str = "off", passive: Sequence[str] = ()) -> None:
        self.mode = check_mode(mode)
        self.self_qkv: Callable[..., tuple[torch.Tensor, ...]]
        self.text_kv: Callable[..., tuple[torch.Tensor, ...]]
        self.self_qkv = functools.partial(self_qkv_fused, passive=tuple(passive))
        self.text_kv = functools.partial(text_kv_fused, passive=tuple(passive))
        if self.mode != "off":
            self.self_qkv = CompiledProjections(lambda b: (b.attn1.to_q, b.attn1.to_k, b.attn1.to_v),
                                                lambda b: b.norm1, self.self_qkv, "packed self-attention Q/K/V",
                                                self.mode, passive)
            self.text_kv = CompiledProjections(lambda a: (a.to_k, a.to_v), None, self.text_kv,
                                               "packed cross-attention K/V", self.mode, passive)
        self.attn_out = Compiled(attn_out_residual, "packed attention output", self.mode, own_graphs=False)
        self.cross_q = Compiled(cross_q, "packed cross-attention Q", self.mode, own_graphs=False)
        self.ff = Compiled(ff_residual, "packed feed-forward", self.mode, own_graphs=False)

    def compiled(self) -> list[Compiled[Any]]:
        """Every compiled function (to report which fell back to eager)."""
        out: list[Compiled[Any]] = []
        for part in vars(self).values():
            out += [part.fused] if isinstance(part, CompiledProjections) else \
                [part] if isinstance(part, Compiled) else []
        return out


__all__ = ["BlockKernels", "COMPILE_MODES", "Compiled", "CompiledProjections", "check_mode"]
