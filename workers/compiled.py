"""Compiled denoising steps (``STENCIL_COMPILE``): ``torch.compile`` of the full denoiser forward and
of the mask-aware controllers' per-block token-wise computations, eager when compilation fails.

``dynamic=True`` because the packed computations see a different token count almost every call
(ragged packs of masked tokens) and the full forward a different batch: one graph per module shape
instead of one per token count. Modules are arguments (dynamo inlines them and takes their
parameters as graph inputs), so same-shaped blocks share a graph and merged LoRA weights are seen.
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

from workers.fused_projections import project

log = logging.getLogger(__name__)

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
R = TypeVar("R")


def check_mode(mode: str) -> str:
    mode = (mode or "off").strip().lower()
    if mode not in COMPILE_MODES:
        raise ValueError(f"STENCIL_COMPILE must be one of {COMPILE_MODES}, got {mode!r}")
    return mode


class Compiled(Generic[R]):
    """``fn`` through ``torch.compile(dynamic=True)`` under ``mode``, or as is with mode ``off``.
    The first failure of the compiled function logs and switches it to eager for good (eager then
    raises whatever error the inputs themselves cause)."""

    def __init__(self, fn: Callable[..., R], name: str, mode: str = "off") -> None:
        self.fn, self.name, self.mode = fn, name, check_mode(mode)
        self.failed = False
        self._compiled: Callable[..., R] | None = None
        if self.mode != "off":
            self._compiled = torch.compile(fn, dynamic=True, mode=None if self.mode == "default" else self.mode)

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


def self_qkv(blk: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n1 = blk.norm1(x)
    a1 = blk.attn1
    return a1.to_q(n1), a1.to_k(n1), a1.to_v(n1)


def attn_out_residual(attn: Any, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return attn.to_out[1](attn.to_out[0](o)) / attn.rescale_output_factor + x


def cross_q(blk: Any, x: torch.Tensor) -> torch.Tensor:
    return blk.attn2.to_q(blk.norm2(x))


def text_kv(attn: Any, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return attn.to_k(src), attn.to_v(src)


def ff_residual(blk: Any, x: torch.Tensor) -> torch.Tensor:
    return blk.ff(blk.norm3(x)) + x


def self_qkv_fused(blk: Any, x: torch.Tensor, passive: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """``self_qkv`` as one GEMM (``workers/fused_projections.py``)."""
    a1 = blk.attn1
    return project((a1.to_q, a1.to_k, a1.to_v), blk.norm1(x), passive)


def text_kv_fused(attn: Any, src: torch.Tensor, passive: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """``text_kv`` as one GEMM (``workers/fused_projections.py``)."""
    return project((attn.to_k, attn.to_v), src, passive)


class BlockKernels:
    """The packed path's token-wise computations, compiled together under one mode. Eager (mode
    ``off``), a block's projections of one input run as one GEMM where the modules allow it
    (``passive``: names of the caller's diffusers hooks on them that do nothing in the packed path);
    compiled, inductor is given the stock modules."""

    def __init__(self, mode: str = "off", passive: Sequence[str] = ()) -> None:
        self.mode = check_mode(mode)
        eager = self.mode == "off"
        qkv = functools.partial(self_qkv_fused, passive=tuple(passive)) if eager else self_qkv
        kv = functools.partial(text_kv_fused, passive=tuple(passive)) if eager else text_kv
        self.self_qkv = Compiled(qkv, "packed self-attention Q/K/V", self.mode)
        self.attn_out = Compiled(attn_out_residual, "packed attention output", self.mode)
        self.cross_q = Compiled(cross_q, "packed cross-attention Q", self.mode)
        self.text_kv = Compiled(kv, "packed cross-attention K/V", self.mode)
        self.ff = Compiled(ff_residual, "packed feed-forward", self.mode)


__all__ = ["BlockKernels", "COMPILE_MODES", "Compiled", "check_mode"]
