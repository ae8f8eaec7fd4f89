"""Denoiser calls replayed as CUDA graphs: one captured graph per step signature, a bounded pool.

Why: at the batch sizes a service sees, a diffusion step on a modern GPU is bound by the host: an
SD 1.5 step launches over a thousand kernels, each costing host time, and the mask-aware step
adds its gathers and scatters. A CUDA graph replays a captured step's kernels with one launch.

How (the pattern of vLLM's and SGLang's CUDA-graph runners): a step is described by its *signature*
(the shapes and the layout of its row groups: each job's mode, rows and, for a masked job, its
token counts per level) and by a flat list of *inputs* (the tensors it reads that change from step
to step: latents, timesteps, text, each masked job's staged cache and token indices). The first
time a signature repeats, the call is captured: inputs are copied into static buffers, the call
runs once eagerly on them (warm-up: cuBLAS handles, lazily built indices) and is captured. From
then on a step copies its inputs into the graph's buffers and replays it. The output buffer is
the graph's own: the runner consumes it within the step, before any other replay.

A job's mask is fixed for its life and a steady batch keeps its jobs for many steps, so a batch's
signature repeats at every step until a job joins or leaves; token counts are rounded up to token
buckets (``workers/maskaware/buckets.py``), so a job taking the place of one whose counts fell in
the same buckets replays the graph already captured. A signature whose batch has fewer than
``min_horizon`` steps left (its first job finishes then) is not captured while it is seen for the
first time in a row; one that comes back after other signatures ran (under continuous batching the
step after a job joins, or a batch of a size seen before, recurs all the time) is captured then,
however short its stretch: it will be seen again. Graphs share one memory pool (they
never run concurrently and never read each other's outputs); the pool of graphs is an LRU bounded
by count and by the bytes of its static inputs and outputs. A signature whose capture fails runs
eagerly from then on (logged once), so an unsupported call costs nothing but its eager time; after
``MAX_FAILED_CAPTURES`` such signatures no other is tried. A step of several calls (one per image
size) copies each replayed call's output out before the next call: graphs of one pool may use
each other's output memory as scratch. Memoized row indices a call reads are kept by its graph.

Static input buffers are shared between graphs (vLLM's way): every replay first copies its inputs
in, and graphs never run concurrently, so graphs whose inputs have the same shapes (every graph of
a batch size: its latents, text, staged caches) read the same buffers. A graph then holds only its
outputs, so the pool keeps many (``max_graphs``) within the bytes the buffers take; under
continuous batching a batch comes back to signatures seen long before, which an LRU of a few
dozen graphs had evicted.

``capture`` is injectable: on a machine without CUDA, ``EagerReplay`` stands in for a graph (it
re-runs the call on the static buffers at every replay), which tests the buffer plumbing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from workers.maskaware.tokens import holding_row_indices

log = logging.getLogger(__name__)

Forward = Callable[[Sequence[torch.Tensor]], torch.Tensor]
MIN_HORIZON = 4  # steps a signature must have left to be worth a capture (a few eager steps' cost)
MAX_GRAPHS = 256  # graphs kept (they share their input buffers: each holds only its outputs)
# Signatures whose capture failed after which no other is tried: failures of a model's call are
# systematic (an operator a graph cannot hold), and each try costs an eager call and a capture.
MAX_FAILED_CAPTURES = 3


class Replayable(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


class CudaGraphCall:
    """One captured call: warm-up and capture on a side stream, into the shared pool.

    Captured with ``CUDAGraph.capture_begin``/``capture_end``, not the ``torch.cuda.graph`` context:
    that one first synchronizes the device and empties the device's and the pinned host memory's
    caching allocators (made for captures at start-up; vLLM stubs the emptying out). Here a capture
    happens while serving: a device-wide wait, device memory given back and re-allocated, and the
    staging and recording buffers' pinned memory freed and pinned again at every capture."""

    _streams: dict[torch.device, torch.cuda.Stream] = {}  # one per device: cuBLAS keeps a workspace per stream

    def __init__(self, forward: Forward, static: Sequence[torch.Tensor], pool: Any) -> None:
        device = static[0].device
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            forward(static)  # warm-up: kernels' lazy state, index tensors the call memoizes
            # thread_local: the provider's fetch threads keep pinning host memory during a capture
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.output = forward(static)
            except BaseException:
                self._abandon(device)
                raise
            try:
                self.graph.capture_end()
            except BaseException:
                _end_allocating_to_pool(device, self.graph)
                raise
        torch.cuda.current_stream(device).wait_stream(side)

    def _abandon(self, device: torch.device) -> None:
        """End a capture whose call raised, so that the caching allocator stops allocating to the
        graphs' pool: ``capture_end`` on an invalidated capture raises before it ends that, and the
        allocator would then keep deferring frees (and read this graph's state) for ever."""
        try:
            self.graph.capture_end()
        except Exception:  # the capture was invalidated: the call's own error is the one to report
            _end_allocating_to_pool(device, self.graph)

    def replay(self) -> None:
        self.graph.replay()


def _end_allocating_to_pool(device: torch.device, graph: Any) -> None:
    torch._C._cuda_endAllocateToPool(device.index if device.index is not None else torch.cuda.current_device(),
                                     graph.pool())


class EagerReplay:
    """A stand-in for a graph where there is no CUDA: each replay re-runs the call on the static
    buffers (what a graph's replay computes), so the input plumbing is testable on the CPU."""

    def __init__(self, forward: Forward, static: Sequence[torch.Tensor], pool: Any) -> None:
        self.forward, self.static = forward, static
        self.output = forward(static)

    def replay(self) -> None:
        for dst, src in zip(tree_leaves(self.output), tree_leaves(self.forward(self.static))):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


class _Entry:
    def __init__(self, call: Replayable, static: list[torch.Tensor], keys: list[Hashable],
                 held: Sequence[torch.Tensor] = ()) -> None:
        self.call, self.static, self.keys = call, static, keys
        self.held = held  # memoized tensors the graph reads by address (``tokens.holding_row_indices``)
        self.output_bytes = 0


class StaticArena:
    """Input buffers shared by the graphs (module doc): one per (shape, dtype, occurrence of that
    shape among a call's inputs), counted by the graphs that read it, freed with the last."""

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._users: dict[Hashable, int] = {}

    @staticmethod
    def keys(inputs: Sequence[torch.Tensor]) -> list[Hashable]:
        seen: dict[tuple[Any, ...], int] = {}
        out: list[Hashable] = []
        for t in inputs:
            shape = (tuple(t.shape), t.dtype, str(t.device))
            out.append((*shape, seen.get(shape, 0)))
            seen[shape] = seen.get(shape, 0) + 1
        return out

    def new_bytes(self, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor]) -> int:
        """Bytes that taking ``keys`` would add."""
        return sum(t.numel() * t.element_size() for k, t in zip(keys, inputs) if k not in self._buffers)

    def take(self, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers of ``keys``, holding ``inputs``' values (made where new)."""
        out = []
        for k, t in zip(keys, inputs):
            buf = self._buffers.get(k)
            if buf is None:
                buf = self._buffers[k] = torch.empty_like(t, memory_format=torch.contiguous_format)
            buf.copy_(t)
            self._users[k] = self._users.get(k, 0) + 1
            out.append(buf)
        return out

    def release(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            self._users[k] -= 1
            if not self._users[k]:
                del self._users[k], self._buffers[k]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


class StepGraphs:
    """Captured denoiser calls by signature (module doc). ``run`` returns the call's output."""

    def __init__(self, device: torch.device | str, *, max_graphs: int = MAX_GRAPHS, budget_bytes: int | None = None,
                 repeats: int = 2, min_horizon: int = MIN_HORIZON,
                 capture: Callable[[Forward, Sequence[torch.Tensor], Any], Replayable] | None = None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.capture = capture or (CudaGraphCall if cuda else EagerReplay)
        self.pool = torch.cuda.graph_pool_handle() if cuda and self.capture is CudaGraphCall else None
        self.max_graphs = max_graphs
        self.budget_bytes = budget_bytes if budget_bytes is not None else _default_budget(self.device)
        self.repeats = repeats
        self.min_horizon = min_horizon
        self._graphs: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._arena = StaticArena()
        self._seen: dict[Hashable, int] = {}
        self._stretches: dict[Hashable, int] = {}  # runs of consecutive calls of a signature
        self._previous: Hashable = None
        self._failed: set[Hashable] = set()
        self.last = "eager"  # how the latest call ran: replayed | captured (then replayed) | eager
        self.reset_counts()

    def reset_counts(self) -> None:
        """Zero the counts of how calls ran (a benchmark's run starts from none)."""
        self.captures = self.replays = self.eager = 0
        # replays of a wider batch's graph (``graph_calls``), and their padded / own token rows
        self.widened = 0
        self.widened_rows = [0, 0]

    def has(self, key: Hashable) -> bool:
        """Whether ``key`` has a captured graph."""
        return key in self._graphs

    def keys(self) -> list[Hashable]:
        """The captured signatures, least recently used first."""
        return list(self._graphs)

    @property
    def static_bytes(self) -> int:
        return self._arena.nbytes

    @property
    def output_bytes(self) -> int:
        """Bytes of the kept graphs' outputs (each graph's own memory)."""
        return sum(e.output_bytes for e in self._graphs.values())

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor], forward: Forward,
            horizon: int | None = None) -> torch.Tensor:
        """``forward(tensors)`` on ``inputs``, replayed from a graph once ``key`` has repeated.
        ``forward`` must read only the tensors it is given (besides the model's weights) and run
        only device work (no host reads, no host tensors). ``horizon``: steps the signature can
        still last (the batch's fewest remaining steps); a capture costs a few eager steps, so a
        signature about to change is not captured unless it has come back (module doc)."""
        returning, self._previous = key != self._previous, key
        entry = self._graphs.get(key)
        if entry is None:
            if returning:
                self._stretches[key] = self._stretches.get(key, 0) + 1
            short = horizon is not None and horizon < self.min_horizon and self._stretches[key] < 2
            entry = self._maybe_capture(key, inputs, forward, count_only=short)
            if entry is None:
                self.eager += 1
                self.last = "eager"
                return forward(inputs)
            self.last = "captured"
        else:
            self._graphs.move_to_end(key)
            self.last = "replayed"
        for dst, src in zip(entry.static, inputs):
            if dst is not src:
                dst.copy_(src, non_blocking=True)
        entry.call.replay()
        self.replays += 1
        return entry.call.output

    def _maybe_capture(self, key: Hashable, inputs: Sequence[torch.Tensor], forward: Forward,
                       count_only: bool = False) -> _Entry | None:
        """Count a sighting of ``key``; capture it once seen ``repeats`` times (not if ``count_only``)."""
        if key in self._failed or len(self._failed) >= MAX_FAILED_CAPTURES:
            return None
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if len(self._seen) > 4096:  # bounded: sightings of long-gone signatures are forgotten
            self._seen, self._stretches = {key: seen}, {key: self._stretches.get(key, 1)}
        if seen < self.repeats or count_only:
            return None
        keys = self._arena.keys(inputs)
        if sum(t.numel() * t.element_size() for t in inputs) > self.budget_bytes:
            return None
        while self._graphs and (len(self._graphs) >= self.max_graphs
                                or self.static_bytes + self._arena.new_bytes(keys, inputs) > self.budget_bytes):
            self._arena.release(self._graphs.popitem(last=False)[1].keys)  # least recently used
        static = self._arena.take(keys, inputs)
        try:
            with holding_row_indices() as held:
                call = self.capture(forward, static, self.pool)
        except Exception as exc:  # an unsupported call: eager from now on
            self._arena.release(keys)
            self._failed.add(key)
            log.warning("CUDA graph capture failed (%s: %s); this step signature runs eagerly%s",
                        type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
                        "; no other will be captured" if len(self._failed) >= MAX_FAILED_CAPTURES else "")
            return None
        self.captures += 1
        entry = self._graphs[key] = _Entry(call, static, keys, held)
        # A graph's outputs are its own (a refresh step's recorded activations among them): they
        # count against the budget too, the least recently used graphs going first.
        entry.output_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(call.output)
                                 if isinstance(t, torch.Tensor))
        while len(self._graphs) > 1 and self.static_bytes + self.output_bytes > self.budget_bytes:
            self._arena.release(self._graphs.popitem(last=False)[1].keys)
        return entry

    def clear(self) -> None:
        self._graphs.clear()
        self._arena = StaticArena()
        self._seen.clear()
        self._stretches.clear()
        self._previous = None


# torch.compile modes that replay CUDA graphs of their own: those cannot run inside a capture.
SELF_GRAPHED_COMPILE_MODES = frozenset({"reduce-overhead", "max-autotune"})


def step_graphs(device: torch.device, wanted: bool | None, compile_mode: str = "off") -> StepGraphs | None:
    """A runner's step graphs: on CUDA unless turned off (``wanted``), and never under a compile
    mode that captures graphs itself (``SELF_GRAPHED_COMPILE_MODES``)."""
    compile_mode = (compile_mode or "off").strip().lower()
    if compile_mode in SELF_GRAPHED_COMPILE_MODES:
        if wanted or (wanted is None and device.type == "cuda"):
            log.info("step graphs off: STENCIL_COMPILE=%s replays CUDA graphs of its own", compile_mode)
        return None
    return StepGraphs(device) if (device.type == "cuda" if wanted is None else wanted) else None


def _default_budget(device: torch.device) -> int:
    """Bytes the graphs may hold (static inputs and outputs): a quarter of the device memory free
    at start (the caches they copy are a step's worth per job); unbounded off CUDA (tests)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 1 << 62
    free, _total = torch.cuda.mem_get_info(device)
    return free // 4


__all__ = ["CudaGraphCall", "EagerReplay", "StaticArena", "StepGraphs", "step_graphs"]
