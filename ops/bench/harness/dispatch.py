"""Counting what a step dispatches: operators, and the ones that read a device value on the host.

On a GPU an operator whose result the host must see (``.item()``, ``bool(t)``, ``nonzero``,
boolean indexing, ...) stalls the host until the device has caught up: the step is then bound by
the host. ``DispatchCounter`` (a ``TorchDispatchMode``) counts every ATen operator a region
dispatches and, among them, those that synchronise on a device, so that a step's host syncs and
its operator count (a proxy for kernel launches) can be checked on the CPU. View operators
and allocations (no kernel) are counted apart.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that copy a device value to the host (or size their output by one).
SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default", "aten.equal.default",
    "aten.nonzero.default", "aten.masked_select.default", "aten.unique_consecutive.default",
    "aten._unique2.default", "aten.unique_dim.default", "aten.repeat_interleave.Tensor",
    "aten.allclose.default",
})

VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
    "aten.permute.default", "aten.slice.Tensor", "aten.select.int", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.default", "aten.squeeze.dims", "aten.expand.default",
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.alias.default",
    "aten.detach.default", "aten.unbind.int", "aten.as_strided.default", "aten.view_as_real.default",
    "aten.view_as_complex.default", "aten.unflatten.int", "aten.lift_fresh.default", "aten.view.dtype",
})

# Allocations: on a GPU the caching allocator hands out memory on the host, launching no kernel.
ALLOC_OPS = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.empty_like.default",
})


FUSED_ATTENTION = "attention (one fused kernel)"


class DispatchCounter(TorchDispatchMode):
    """Counts dispatched operators by name (``ops``); ``syncs``, ``kernels`` and ``total`` sum them.

    On the meta device (true sizes without memory) ``scaled_dot_product_attention`` has no fused
    kernel and decomposes into a dozen operators; on a GPU it is one flash or memory-efficient
    kernel, and on the CPU one operator: there it is counted once, as ``FUSED_ATTENTION``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self._paused = False
        self._attention = _FusedAttention(self)

    def __enter__(self) -> "DispatchCounter":
        self._attention.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._attention.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._attention.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self._paused:
            return func(*args, **(kwargs or {}))
        name = str(func)
        if name == "aten.index.Tensor" and _bool_index(args):
            name = "aten.index.Tensor(bool)"  # boolean indexing: a nonzero inside
        self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> dict[str, int]:
        return {k: v for k, v in self.ops.items() if k in SYNC_OPS or k.endswith("(bool)")}

    @property
    def kernels(self) -> int:
        """Operators that are neither views nor allocations (each one a kernel launch, or more, on a GPU)."""
        return sum(v for k, v in self.ops.items() if k not in VIEW_OPS and k not in ALLOC_OPS)


class _FusedAttention(TorchFunctionMode):
    """Counts a meta-device ``scaled_dot_product_attention`` as one operator and returns its
    output's shape without decomposing it (see ``DispatchCounter``)."""

    def __init__(self, counter: DispatchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        q = (args[0] if args else kwargs["query"]) if func is F.scaled_dot_product_attention else None
        if q is None or q.device.type != "meta":
            return func(*args, **kwargs)
        v = args[2] if len(args) > 2 else kwargs["value"]
        self.counter.ops[FUSED_ATTENTION] += 1
        self.counter._paused = True
        try:
            return q.new_empty((*q.shape[:-1], v.shape[-1]))
        finally:
            self.counter._paused = False


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def counting_forward(model: torch.nn.Module) -> Iterator[DispatchCounter]:
    """Counts what ``model``'s forward dispatches while the block runs, so that a step's own work
    (everything else it dispatches) is the difference from a counter around the whole step."""
    counter = DispatchCounter()
    own = model.__dict__.get("forward")
    forward = model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        with counter:
            return forward(*args, **kwargs)

    model.forward = counted  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own  # type: ignore[method-assign]


__all__ = ["FUSED_ATTENTION", "DispatchCounter", "SYNC_OPS", "VIEW_OPS", "counting_forward"]
