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
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from workers.engine import cache_codec


class StagedCache(dict):  # type: ignore[type-arg]
    """A job's step cache on the compute device: ``writable`` when its tensors are private copies.
    Writable caches keep every tensor in one ``flat`` buffer (``layout``: name, offset, shape), so
    that a graph-replayed step copies a job's cache into its static input with one copy."""

    writable = False
    flat: torch.Tensor | None = None
    layout: tuple[tuple[str, int, tuple[int, ...]], ...] = ()

    @classmethod
    def over(cls, flat: torch.Tensor, layout: tuple[tuple[str, int, tuple[int, ...]], ...]) -> "StagedCache":
        """The writable cache whose tensors are views of ``flat`` at ``layout``."""
        out = cls()
        out.writable, out.flat, out.layout = True, flat, layout
        for name, offset, shape in layout:
            out[name] = flat[offset:offset + _numel(shape)].view(shape)
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class CacheStager:
    def __init__(self, device: torch.device | str, writable: bool = True) -> None:
        self.device = torch.device(device)
        self.writable = writable
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._ahead: dict[tuple[str, int, int], tuple[StagedCache, Any]] = {}

    @property
    def asynchronous(self) -> bool:
        """Whether staging overlaps with compute (a side stream), so staging ahead pays."""
        return self.stream is not None

    def stage(self, cache: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor] | None = None
              ) -> tuple[StagedCache, Any]:
        """Every tensor of ``cache`` on the device (decoded; plus the job's ``delta``), and the event
        after which they are there (None when staged inline)."""
        stored, dtype, rows = _stored_view(cache)
        scope = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with scope:
            build = self._writable if self.writable else self._decoded
            out = build(stored, dtype, rows, delta)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return out, event

    def _decoded(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype | None, rows: int,
                 delta: Mapping[str, torch.Tensor] | None) -> StagedCache:
        out = StagedCache()
        for name, src in stored.items():
            t = cache_codec.decode_tensor(src, dtype or src.dtype, self.device, rows)
            d = delta.get(name) if delta else None
            out[name] = t if d is None else d + t.to(d)  # the job's offset (``OffsetCache``'s expression)
        return out

    def _writable(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype | None, rows: int,
                  delta: Mapping[str, torch.Tensor] | None) -> StagedCache:
        """Private copies in one flat buffer: stored bytes go straight into their slot (moved,
        converted, shared rows broadcast by the copy); int8 tensors are dequantized first."""
        layout, offset = [], 0
        for name, src in stored.items():
            shape = cache_codec.decoded_shape(src, rows)
            layout.append((name, offset, shape))
            offset += _numel(shape)
        dtype = dtype or (next(iter(stored.values())).dtype if stored else torch.float32)
        out = StagedCache.over(torch.empty(offset, dtype=dtype, device=self.device), tuple(layout))
        for name, src in stored.items():
            view, d = out[name], delta.get(name) if delta else None
            if src.dtype == torch.int8 or d is not None:
                t = cache_codec.decode_tensor(src, dtype, self.device, rows)
                if d is None:
                    view.copy_(t)
                else:
                    torch.add(d, t.to(d), out=view)  # the job's offset (``OffsetCache``'s expression)
            else:
                view.copy_(cache_codec.expand_rows(src, rows), non_blocking=True)
        return out

    def ahead(self, job_id: str, step: int, cache: Mapping[str, torch.Tensor],
              delta: Mapping[str, torch.Tensor] | None = None) -> None:
        """Start staging a job's next step now (a side stream: it overlaps the current step)."""
        self._ahead[(job_id, step, id(delta))] = self.stage(cache, delta)

    def take(self, job_id: str, step: int, cache: Mapping[str, torch.Tensor],
             delta: Mapping[str, torch.Tensor] | None = None) -> StagedCache:
        """The job's staged step (staged ahead, else now); the compute stream waits for its copy."""
        staged = self._ahead.pop((job_id, step, id(delta)), None)
        out, event = staged if staged is not None else self.stage(cache, delta)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in ([out.flat] if out.flat is not None else out.values()):
                t.record_stream(current)
        return out

    def reset(self) -> None:
        """Drop what was staged ahead and not taken (jobs that left the batch)."""
        self._ahead.clear()


def _stored_view(cache: Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], torch.dtype | None, int]:
    """(stored tensors, compute dtype, row count) behind a provider's step mapping: a lazily
    decoding view exposes its stored tensors; any other mapping holds decoded tensors."""
    if isinstance(cache, cache_codec.DecodedStep):
        return cache.stored, cache.dtype, cache.rows
    return cache, None, 0


__all__ = ["CacheStager", "StagedCache"]
