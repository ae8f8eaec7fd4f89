"""Floating-point work of a step, by operator kind and by the spatial size a convolution writes.

A step's speedup on a GPU that has stopped waiting for its host is bounded by the work it does:
``FlopTally`` (a ``TorchDispatchMode`` over PyTorch's own FLOP formulas, ``torch.utils.flop_counter``)
counts a region's FLOPs on any device, the meta device included (true sizes, no memory), so the
bound is known before a GPU measures how close the step gets to it. Convolutions are kept by their
output's height and width, the level of the map they run on, because they are the part of a
mask-aware UNet step that still runs on the whole map.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

CONVOLUTION = "convolution"
MATMUL = "matmul"  # mm, addmm, bmm, baddbmm and attention, however it decomposes


class FlopTally(TorchDispatchMode):
    """FLOPs of every operator PyTorch has a formula for: ``by_kind`` (convolution or matmul) and
    ``conv_by_size`` ((height, width) of a convolution's output -> FLOPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.conv_by_size: collections.Counter[tuple[int, int]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            if func._overloadpacket is torch.ops.aten.convolution:
                self.by_kind[CONVOLUTION] += flops
                self.conv_by_size[tuple(out.shape[-2:])] += flops
            else:
                self.by_kind[MATMUL] += flops
        return out

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


__all__ = ["CONVOLUTION", "MATMUL", "FlopTally"]
