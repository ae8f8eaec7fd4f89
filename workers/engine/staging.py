"""A job's step cache moved to the compute device before its step, off the step's critical path.

The host-RAM tier holds stored bytes (``template_cache``, possibly compressed). A masked job's
step needs them on the compute device, decoded, with the job's offset added (refresh steps,
``runner_base``), and -- for the SD-family UNet -- as a private copy the model may write the step's
fresh tokens into (``MaskAwareUNet``: K/V and block outputs with the masked tokens replaced). The
stager makes that copy:

- on CUDA on a side stream, one step ahead (``ahead`` while the current step computes, ``take``
  at the next step): host tensors are pinned by the provider, so copies are ``non_blocking`` and
  the decode runs on the side stream too; the compute stream waits for the copy's event only when
  the step starts, and the staged tensors are recorded on it so that the allocator never reuses
  them early. Nothing in this path reads a device value back to the host.
- elsewhere inline at ``take`` (a CPU step costs the same either way).

``writable``: the copies are private (fresh, contiguous tensors the model may write); without it
(Flux reads its cache only) tensors are decoded onto the device and handed over as they are.

Batch-wide: the masked jobs of a step are staged together (``stage_batch``, ``ahead_batch``,
``take_batch``) into one buffer laid out name-major: for each cached tensor, the rows of every job
one after another. A tensor of several adjacent jobs is then one ``[rows, N, C]`` slab, so the
model writes every job's fresh tokens with one scatter and runs one attention call for jobs of
equal token counts (``MaskAwareUNet``), instead of a few kernels per job and block. Where the
jobs' steps are packed buffers of one layout (a GPU host's tier, ``pack``), the buffers go side by
side into one device buffer and each tensor is decoded for every job by one kernel (``_stacked``):
a step's staging issues a copy per job and a kernel per cached tensor, not one per tensor and job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from workers.engine import cache_codec

Layout = tuple[tuple[str, int, tuple[int, ...]], ...]
Stored = tuple[Mapping[str, torch.Tensor], "torch.dtype | None", int]  # a step's stored tensors, dtype, rows
_ALIGN = 64  # bytes: every packed tensor starts at a multiple (any dtype's view, vectorised copies)


class PackedStep(dict):  # type: ignore[type-arg]
    """A step's stored tensors as views of one host buffer (``pack``; page-locked on a GPU host):
    staging copies the whole step to the device at once (``on``), not tensor by tensor."""

    buffer: torch.Tensor
    places: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]  # name -> (offset, bytes, dtype, shape)

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The step's tensors on ``device``: one copy of the buffer (asynchronous from pinned
        memory), then views of it."""
        data = self.buffer.to(device, non_blocking=True)
        return {name: data.narrow(0, offset, nbytes).view(dtype).view(shape)
                for name, (offset, nbytes, dtype, shape) in self.places.items()}


def pack(tensors: Mapping[str, torch.Tensor], pin: bool) -> PackedStep:
    """``tensors`` copied into one host buffer (``pin``: page-locked), as a ``PackedStep``."""
    places, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        places[name] = (offset, nbytes, t.dtype, tuple(t.shape))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    out = PackedStep()
    out.buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    out.places = places
    for name, t in tensors.items():
        o, nbytes, dtype, shape = places[name]
        view = out.buffer.narrow(0, o, nbytes).view(dtype).view(shape)
        view.copy_(t)
        out[name] = view
    return out


class StagedCache(dict):  # type: ignore[type-arg]
    """A job's step cache on the compute device: ``writable`` when its tensors are private copies.
    Writable caches keep every tensor in one ``flat`` buffer (``layout``: name, offset, shape), so
    that a graph-replayed step copies the caches into its static inputs with one copy per buffer.
    ``row0``: the job's first row in the buffer's name-major slabs; jobs of one buffer whose rows
    follow each other (``adjacent``) form one slab per tensor (``slab``)."""

    writable = False
    flat: torch.Tensor | None = None
    layout: Layout = ()
    row0 = 0

    @classmethod
    def over(cls, flat: torch.Tensor, layout: Layout, row0: int = 0) -> "StagedCache":
        """The writable cache whose tensors are views of ``flat`` at ``layout``."""
        out = cls()
        out.writable, out.flat, out.layout, out.row0 = True, flat, layout, row0
        for name, offset, shape in layout:
            out[name] = flat[offset:offset + _numel(shape)].view(shape)
        return out

    def adjacent(self, other: Any) -> bool:
        """Whether ``other``'s rows follow this cache's rows in every slab of one buffer."""
        if not (isinstance(other, StagedCache) and other.flat is not None and other.flat is self.flat):
            return False
        rows = self.layout[0][2][0] if self.layout else 0
        return other.row0 == self.row0 + rows and len(other.layout) == len(self.layout)

    def slab(self, name: str, rows: int) -> torch.Tensor:
        """Tensor ``name`` of this job and the jobs adjacent after it, ``rows`` rows in all."""
        t = self[name]
        if rows == t.shape[0]:
            return t
        offset = t.storage_offset() - self.flat.storage_offset()  # type: ignore[union-attr]
        per_row = t.numel() // t.shape[0]
        return self.flat.narrow(0, offset, rows * per_row).view(rows, *t.shape[1:])  # type: ignore[union-attr]


def _broadcast(flat: torch.Tensor, offset: int, numel: int, count: int) -> None:
    """Copy the slot at ``offset`` on to the ``count - 1`` slots after it (one kernel)."""
    if count > 1:
        block = flat.narrow(0, offset, count * numel).view(count, numel)
        block[1:].copy_(block[:1].expand(count - 1, numel))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Offset(dict):  # type: ignore[type-arg]
    """A job's offset (own minus template activations at its last refresh, ``runner_base``), made
    on the compute stream and added to its staged caches on the stager's side stream.

    On CUDA the side stream must not read it before the compute stream has written it (the host
    runs a step ahead of the device), nor may the allocator hand its memory to the compute stream
    while a staging that reads it is pending: ``ready`` is the event after which it is written, and
    ``used_on`` orders a stream after that event and records the tensors on it, once per stream."""

    ready: Any = None

    @classmethod
    def made_now(cls, tensors: Mapping[str, torch.Tensor]) -> "Offset":
        """``tensors``, with an event on the current stream of their device when that is a GPU."""
        out = cls(tensors)
        first = next(iter(out.values()), None)
        if first is not None and first.device.type == "cuda":
            out.ready = torch.cuda.Event()
            out.ready.record(torch.cuda.current_stream(first.device))
        return out

    def used_on(self, stream: Any) -> None:
        """Make ``stream``'s later work wait until the offset is written, and keep its memory from
        being reused before that work is done (once per stream: a stream runs in order)."""
        streams = self.__dict__.setdefault("_streams", set())
        if stream in streams:
            return
        if self.ready is not None:
            stream.wait_event(self.ready)
        for t in self.values():
            if t.device.type == "cuda":
                t.record_stream(stream)
        streams.add(stream)


class CacheStager:
    def __init__(self, device: torch.device | str, writable: bool = True) -> None:
        self.device = torch.device(device)
        self.writable = writable
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # (job id, step) -> (staged cache, its event, the offset it was staged with)
        self._ahead: dict[tuple[str, int], tuple[StagedCache, Any, Mapping[str, torch.Tensor] | None]] = {}

    @property
    def asynchronous(self) -> bool:
        """Whether staging overlaps with compute (a side stream), so staging ahead pays."""
        return self.stream is not None

    def stage(self, cache: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor] | None = None
              ) -> tuple[StagedCache, Any]:
        """Every tensor of ``cache`` on the device (decoded; plus the job's ``delta``), and the event
        after which they are there (None when staged inline)."""
        outs, event = self.stage_batch([(cache, delta)])
        return outs[0], event

    def stage_batch(self, items: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor] | None]]
                    ) -> tuple[list[StagedCache], Any]:
        """``stage`` for several jobs' caches (cache, delta), in order: writable caches of one
        layout share one name-major buffer (module doc)."""
        views = [(_stored_view(cache), delta) for cache, delta in items]
        if self.stream is not None:
            self._after_offsets([delta for _cache, delta in items if delta])
            if any(_on_device(stored) for (stored, _dtype, _rows), _delta in views):
                # a step already on the device (recorded by this process): written on the compute stream
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
        scope = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with scope:
            if self.writable:
                outs = self._writable_batch(views)
            else:
                outs = [self._decoded(stored, dtype, rows, delta) for (stored, dtype, rows), delta in views]
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return outs, event

    def _after_offsets(self, deltas: list[Mapping[str, torch.Tensor]]) -> None:
        """The side stream ordered after the compute stream's writing of these offsets (``Offset``;
        any other mapping: after everything the compute stream was given so far)."""
        for delta in deltas:
            if isinstance(delta, Offset):
                delta.used_on(self.stream)
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))  # type: ignore[union-attr]
                for t in delta.values():
                    if t.device.type == "cuda":
                        t.record_stream(self.stream)

    def _decoded(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype | None, rows: int,
                 delta: Mapping[str, torch.Tensor] | None) -> StagedCache:
        out = StagedCache()
        for name, src in stored.items():
            t = cache_codec.decode_tensor(src, dtype or src.dtype, self.device, rows)
            d = delta.get(name) if delta else None
            out[name] = t if d is None else d + t.to(d)  # the job's offset (``OffsetCache``'s expression)
        return out

    def _writable_batch(self, views: list[tuple[tuple[Mapping[str, torch.Tensor], torch.dtype | None, int],
                                                Mapping[str, torch.Tensor] | None]]) -> list[StagedCache]:
        """Private copies, jobs of one layout (names, shapes, dtype) in one name-major buffer:
        stored bytes go straight into their slot (moved, converted, shared rows broadcast by the
        copy); int8 tensors are dequantized on the way. Adjacent jobs reading the same stored
        tensor (edits of one template at one step: a burst, a catalog) decode it once and copy it
        on to the others' slots with one broadcast; each job's offset is added afterwards."""
        kinds: dict[tuple[Any, ...], list[int]] = {}
        for i, ((stored, dtype, rows), _delta) in enumerate(views):
            named = [(name, cache_codec.decoded_shape(src, rows)) for name, src in stored.items()]
            dtype = dtype or (next(iter(stored.values())).dtype if stored else torch.float32)
            kinds.setdefault((dtype, tuple(named)), []).append(i)
        outs: list[StagedCache | None] = [None] * len(views)
        for (dtype, named), members in kinds.items():
            layouts: list[list[tuple[str, int, tuple[int, ...]]]] = [[] for _ in members]
            row0s, row0 = [], 0
            for i in members:
                row0s.append(row0)
                row0 += named[0][1][0] if named else 0
            offset = 0
            for name, shape in named:  # name-major: every job's rows of a tensor, one after another
                for k in range(len(members)):
                    layouts[k].append((name, offset, shape))
                    offset += _numel(shape)
            flat = torch.empty(offset, dtype=dtype, device=self.device)
            staged = [StagedCache.over(flat, tuple(layouts[k]), row0s[k]) for k in range(len(members))]
            for k, i in enumerate(members):
                outs[i] = staged[k]
            stored = [views[i][0] for i in members]
            if not self._decode_stacked(stored, named, layouts, flat):
                self._decode_each(stored, named, layouts, staged, flat)
            offset_views: list[torch.Tensor] = []
            offsets: list[torch.Tensor] = []
            for k, i in enumerate(members):
                delta = views[i][1]
                for name, _shape in named if delta else ():
                    d = delta.get(name)  # type: ignore[union-attr]
                    if d is not None:
                        offset_views.append(staged[k][name])
                        offsets.append(d)
            same = [(v, d) for v, d in zip(offset_views, offsets) if d.dtype == v.dtype]
            if same:  # the jobs' offsets (``OffsetCache``'s d + t, bit for bit) in one multi-tensor op
                torch._foreach_add_([v for v, _ in same], [d for _, d in same])
            for view, d in zip(offset_views, offsets):
                if d.dtype != view.dtype:
                    torch.add(d, view.to(d), out=view)
        return outs  # type: ignore[return-value]

    def _decode_stacked(self, stored: list[Stored], named: tuple[tuple[str, tuple[int, ...]], ...],
                        layouts: list[list[tuple[str, int, tuple[int, ...]]]], flat: torch.Tensor) -> bool:
        """Every job's stored tensors into their slots, a tensor for every job by one kernel, where
        the steps allow it (``_stacked``); False where they do not. (A function of its own: the
        jobs' device buffer is freed on return, before another layout's is allocated.)"""
        stacked = _stacked(self.device, stored)
        if stacked is None:
            return False
        for j, (name, shape) in enumerate(named):
            slab = flat.narrow(0, layouts[0][j][1], len(stored) * _numel(shape)).view(len(stored), *shape)
            cache_codec.decode_jobs_into(slab, stacked[name], stored[0][2])
        return True

    def _decode_each(self, stored: list[Stored], named: tuple[tuple[str, tuple[int, ...]], ...],
                     layouts: list[list[tuple[str, int, tuple[int, ...]]]], staged: list[StagedCache],
                     flat: torch.Tensor) -> None:
        """Each job's stored tensors into its slots, job by job; adjacent jobs reading one stored
        tensor decode it once and broadcast it (``_writable_batch``)."""
        sources: dict[int, Mapping[str, torch.Tensor]] = {}  # each packed step on the device, once
        for step, _dtype, _rows in stored:
            if isinstance(step, PackedStep) and step.buffer.device != self.device and id(step) not in sources:
                sources[id(step)] = step.on(self.device)
        for j, (name, shape) in enumerate(named):
            first = 0  # the run of adjacent jobs reading one stored tensor begins here
            for k, (step, _dtype, rows) in enumerate(stored):
                src = step[name]
                before = stored[k - 1] if k else None
                if before is None or before[0][name] is not src or before[2] != rows:
                    _broadcast(flat, layouts[first][j][1], _numel(shape), k - first)
                    first = k
                    src = sources.get(id(step), step)[name]
                    cache_codec.decode_into(staged[k][name], src, rows)  # int8: the copy and one kernel
            _broadcast(flat, layouts[first][j][1], _numel(shape), len(stored) - first)

    def ahead_batch(self, entries: Sequence[tuple[str, int, Mapping[str, torch.Tensor],
                                                  Mapping[str, torch.Tensor] | None]]) -> None:
        """Start staging these jobs' next steps now (job id, step, cache, delta), together
        (``stage_batch``; a side stream: it overlaps the current step)."""
        if not entries:
            return
        outs, event = self.stage_batch([(cache, delta) for _j, _s, cache, delta in entries])
        for (job_id, step, _cache, delta), out in zip(entries, outs):
            self._ahead[(job_id, step)] = (out, event, delta)

    def _staged_ahead(self, job_id: str, step: int,
                      delta: Mapping[str, torch.Tensor] | None) -> tuple[StagedCache, Any] | None:
        """What was staged ahead for this job's step, if it was staged with this very offset (a
        refresh in between replaces the offset: that copy is stale)."""
        entry = self._ahead.pop((job_id, step), None)
        if entry is None or entry[2] is not delta:
            return None
        return entry[0], entry[1]

    def take_batch(self, entries: Sequence[tuple[str, int, Mapping[str, torch.Tensor],
                                                 Mapping[str, torch.Tensor] | None]]) -> list[StagedCache]:
        """``take`` for several jobs (job id, step, cache, delta): those not staged ahead are
        staged now, together."""
        found = [self._staged_ahead(job_id, step, delta) for job_id, step, _cache, delta in entries]
        missing = [i for i, staged in enumerate(found) if staged is None]
        if missing:
            outs, event = self.stage_batch([(entries[i][2], entries[i][3]) for i in missing])
            for i, out in zip(missing, outs):
                found[i] = (out, event)
        return [self._on_compute_stream(*staged) for staged in found]  # type: ignore[misc]

    def take(self, job_id: str, step: int, cache: Mapping[str, torch.Tensor],
             delta: Mapping[str, torch.Tensor] | None = None) -> StagedCache:
        """The job's staged step (staged ahead, else now); the compute stream waits for its copy."""
        staged = self._staged_ahead(job_id, step, delta)
        return self._on_compute_stream(*(staged if staged is not None else self.stage(cache, delta)))

    def _on_compute_stream(self, out: StagedCache, event: Any) -> StagedCache:
        """``out`` once the compute stream has waited for its copy (``event``; None: staged inline)."""
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in ([out.flat] if out.flat is not None else out.values()):
                t.record_stream(current)  # once per job: a shared buffer is recorded again, harmlessly
        return out

    def reset(self) -> None:
        """Drop what was staged ahead and not taken (jobs that left the batch)."""
        self._ahead.clear()


def _stacked(device: torch.device, stored: Sequence[Stored]) -> dict[str, torch.Tensor] | None:
    """Several jobs' steps as one strided view per tensor, ``[jobs, *stored shape]``, so that one
    kernel decodes a tensor for every job (``cache_codec.decode_jobs_into``): packed steps of one
    layout, either all different (jobs at different steps, or of different templates of one model
    and size: their buffers copied into one device buffer, a row per job) or all the same one (a
    burst of edits of one template: its buffer copied once and read by every job). None where the
    steps do not qualify (one job; some steps read by several jobs and some not, which are
    decoded job by job; another layout or row count; tensors that are not one packed buffer)."""
    if len(stored) < 2:
        return None
    first, _dtype, rows = stored[0]
    if not isinstance(first, PackedStep):
        return None
    unique: dict[int, PackedStep] = {}
    for step, _dtype, step_rows in stored:
        if (not isinstance(step, PackedStep) or step_rows != rows or step.buffer.shape != first.buffer.shape
                or step.places != first.places):
            return None
        unique.setdefault(id(step), step)
    if len(unique) not in (1, len(stored)):
        return None
    raw = torch.empty((len(unique), first.buffer.shape[0]), dtype=torch.uint8, device=device)
    for row, step in zip(raw, unique.values()):
        row.copy_(step.buffer, non_blocking=True)  # asynchronous from pinned memory
    return {name: raw[:, offset:offset + nbytes].view(dtype).view(len(unique), *shape).expand(len(stored), *shape)
            for name, (offset, nbytes, dtype, shape) in first.places.items()}


def _on_device(stored: Mapping[str, torch.Tensor]) -> bool:
    """Whether a step's stored tensors are on a GPU (a step's tensors are all in one place)."""
    if isinstance(stored, PackedStep):
        return stored.buffer.device.type == "cuda"
    if not isinstance(stored, dict):  # a lazy mapping: reading it could load or decode
        return False
    first = next(iter(stored.values()), None)
    return isinstance(first, torch.Tensor) and first.device.type == "cuda"


def _stored_view(cache: Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], torch.dtype | None, int]:
    """(stored tensors, compute dtype, row count) behind a provider's step mapping: a lazily
    decoding view exposes its stored tensors; any other mapping holds decoded tensors."""
    if isinstance(cache, cache_codec.DecodedStep):
        return cache.stored, cache.dtype, cache.rows
    return cache, None, 0


__all__ = ["CacheStager", "Offset", "PackedStep", "StagedCache", "pack"]
