"""Merged adapter weights without touching the pristine ones, prepared off the critical path.

Merging an adapter set ``S`` means giving each adapted module the weight ``W0 + sum(scale *
scaling * B @ A)``. Doing that in place costs a pass of matmuls over every adapted weight when a
batch starts (about what diffusers' ``fuse_lora`` costs) and needs a pristine copy to undo it
exactly. Here the pristine weights ``W0`` are never written. Merged weights live in ``buffers``
spare tensors per module ("slots"); a module's parameter is pointed at ``W0`` or at a slot
(``weight.data = tensor``), so switching sets is a pointer swap and going back to the base model
is exact by construction, whatever happened before. A slot can be filled in the background
(``stage``) while steps run, e.g. as soon as a routed job's adapters are fetched, so that its
first step swaps instead of merging. ``buffers = 0`` merges in place from a pristine copy (one
copy less memory, merges on the critical path).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from workers.adapters.lora import LoraModule

log = logging.getLogger(__name__)

AdapterSet = tuple[tuple[str, float], ...]
ModsOf = Callable[[str], dict[str, LoraModule]]


@dataclass
class _Slot:
    adapters: AdapterSet | None = None  # what the buffers hold (None: nothing usable)
    bufs: dict[str, torch.Tensor] = field(default_factory=dict)
    future: Future | None = None  # a background fill in progress
    reserved: bool = False  # being filled by ``switch`` (stage keeps off it)
    used: float = 0.0


class MergedWeights:
    def __init__(self, modules: dict[str, torch.nn.Module], mods_of: ModsOf, buffers: int = 2) -> None:
        self.modules = modules
        self.mods_of = mods_of
        self.buffers = buffers
        self.current: AdapterSet = ()
        self._base: dict[str, torch.Tensor] = {}  # path -> the pristine weight tensor (never written)
        self._slots = [_Slot() for _ in range(buffers)]
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stencil-lora-merge") if buffers else None
        self.sync_seconds = 0.0  # merge work done on the caller's (critical) path
        self.staged_seconds = 0.0  # merge work done in the background
        self.waited_seconds = 0.0  # time the caller waited for a background fill

    def _paths(self, adapters: AdapterSet) -> set[str]:
        out: set[str] = set()
        for lora_id, _ in adapters:
            out.update(self.mods_of(lora_id))
        return out

    def _remember(self, paths: set[str]) -> None:
        for path in paths:
            if path not in self._base:
                self._base[path] = self.modules[path].weight.data

    def _fill(self, slot: _Slot, adapters: AdapterSet, paths: set[str],
              bases: dict[str, torch.Tensor] | None = None) -> None:
        """slot.bufs[path] = W0 + the set's deltas: one fused ``addmm`` per module with the set's
        adapters as one low-rank product ([s1 B1, s2 B2] @ [A1; A2]), in float32 (half-precision
        weights are merged in float32 and rounded once)."""
        bases = self._base if bases is None else bases
        with torch.no_grad():
            for path in paths:
                base = bases[path]
                mods = [(m, scale) for lora_id, scale in adapters
                        if (m := self.mods_of(lora_id).get(path)) is not None]
                buf = slot.bufs.get(path)
                if buf is None:
                    buf = slot.bufs[path] = torch.empty_like(base)
                if not mods:
                    buf.copy_(base)
                    continue
                ups = torch.cat([m.up.reshape(m.up.shape[0], -1).float() * (scale * m.scaling) for m, scale in mods], 1)
                downs = torch.cat([m.down.reshape(m.rank, -1).float() for m, _ in mods])
                flat = base.reshape(base.shape[0], -1)
                if base.dtype == torch.float32:
                    torch.addmm(flat, ups, downs, out=buf.view(flat.shape))
                else:
                    buf.view(flat.shape).copy_(torch.addmm(flat.float(), ups, downs))
        slot.adapters = adapters

    def held(self) -> set[str]:
        """The adapters the merge buffers hold or are being filled with."""
        with self._lock:
            return {i for slot in self._slots if slot.adapters for i, _ in slot.adapters}

    def ready(self, adapters: AdapterSet) -> bool:
        """Would ``switch(adapters)`` be a pointer swap (base, current or a finished slot)?"""
        if not adapters or adapters == self.current:
            return True
        with self._lock:
            return any(s.adapters == adapters and s.future is None for s in self._slots)

    def _slot_for(self, adapters: AdapterSet, in_use: set[int]) -> _Slot:
        """The slot holding or staging ``adapters``, else the least recently used one not in use."""
        for s in self._slots:
            if s.adapters == adapters:
                return s
        candidates = [s for i, s in enumerate(self._slots) if i not in in_use] or self._slots
        return min(candidates, key=lambda s: (s.future is not None, s.used))

    def _in_use(self) -> set[int]:
        return {i for i, s in enumerate(self._slots) if self.current and s.adapters == self.current}

    def stage(self, adapters: AdapterSet) -> bool:
        """Fill a slot with ``adapters`` in the background (no-op if held, staging, or no spare slot)."""
        if not adapters or self._pool is None or self.ready(adapters):
            return False
        with self._lock:
            if any(s.adapters == adapters for s in self._slots):
                return False
            busy = self._in_use()
            free = [s for i, s in enumerate(self._slots) if i not in busy and s.future is None and not s.reserved]
            if not free:
                return False
            slot = min(free, key=lambda s: s.used)
            slot.adapters = None
            paths = self._paths(adapters)
            self._remember(paths)

            def run() -> None:
                t0 = time.perf_counter()
                try:
                    self._fill(slot, adapters, paths)
                except Exception:
                    log.exception("staging adapters %s failed", adapters)
                    slot.adapters = None
                finally:
                    self.staged_seconds += time.perf_counter() - t0
                    with self._lock:
                        slot.future = None

            slot.adapters = adapters  # claimed: ``_slot_for`` finds it, ``ready`` waits for the future
            slot.future = self._pool.submit(run)
        return True

    def switch(self, adapters: AdapterSet) -> None:
        """Point every adapted module at the weights of ``adapters`` (``()``: pristine)."""
        if adapters == self.current:
            return
        paths = self._paths(adapters) | self._paths(self.current)
        self._remember(paths)
        if self.buffers == 0:
            self._in_place(adapters, paths)
            return
        target: dict[str, torch.Tensor] = {}
        own: set[str] = set()
        if adapters:
            with self._lock:
                slot = self._slot_for(adapters, self._in_use())
                slot.reserved = True
            try:
                pending = slot.future
                if pending is not None:  # staging (this set or another): let it finish first
                    t0 = time.perf_counter()
                    pending.result()
                    self.waited_seconds += time.perf_counter() - t0
                if slot.adapters != adapters:
                    t0 = time.perf_counter()
                    slot.adapters = None
                    self._fill(slot, adapters, self._paths(adapters))
                    self.sync_seconds += time.perf_counter() - t0
            finally:
                slot.reserved = False
            slot.used = time.monotonic()
            target = slot.bufs
            own = self._paths(adapters)
        for path in paths | set(self._base):
            mod = self.modules[path]
            want = target[path] if adapters and path in own else self._base[path]
            if mod.weight.data_ptr() != want.data_ptr():
                mod.weight.data = want
        self.current = adapters

    def _in_place(self, adapters: AdapterSet, paths: set[str]) -> None:
        """``buffers = 0``: write ``W0 + deltas`` into the live weights (``W0`` kept aside once)."""
        t0 = time.perf_counter()
        if not hasattr(self, "_pristine"):
            self._pristine: dict[str, torch.Tensor] = {}
        for path in paths:
            if path not in self._pristine:
                self._pristine[path] = self.modules[path].weight.detach().clone()
        self._fill(_Slot(bufs={p: self.modules[p].weight.data for p in paths}), adapters, paths, self._pristine)
        self.sync_seconds += time.perf_counter() - t0
        self.current = adapters

    def base_identical(self) -> bool:
        """No set merged and every adapted module holds its pristine weight, bit for bit."""
        if self.current:
            return False
        if self.buffers == 0:
            return all(torch.equal(self.modules[p].weight, w) for p, w in getattr(self, "_pristine", {}).items())
        return all(self.modules[p].weight.data_ptr() == w.data_ptr() and torch.equal(self.modules[p].weight, w)
                   for p, w in self._base.items())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["MergedWeights"]
