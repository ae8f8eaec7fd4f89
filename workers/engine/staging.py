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
    """A job's step cache on the compute device: ``writable`` when its tensors are private copies."""

    writable = False


def _private(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``t`` (decoded from ``source``) as a fresh contiguous tensor that aliases nothing."""
    if not t.is_contiguous():
        return t.contiguous()
    if t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return t.clone()
    return t


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
        out = StagedCache()
        out.writable = self.writable
        with scope:
            for name, src in stored.items():
                t = cache_codec.decode_tensor(src, dtype or src.dtype, self.device, rows)
                d = delta.get(name) if delta else None
                if d is not None:
                    t = d + t.to(d)  # the job's offset (``OffsetCache``'s expression): a fresh tensor
                elif self.writable:
                    t = _private(t, src)
                out[name] = t
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return out, event

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
            for t in out.values():
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
