"""Host-RAM tier of the activation cache: a byte-budgeted LRU shared by all jobs on a worker.

Why it looks like this:
- Single-flight: many jobs in a batch use the same template, so the same (template, step, block)
  is requested concurrently; it must be fetched from the object store once (DESIGN.md pitfall 7:
  load cost must not grow with batch size). Waiters share the fetcher's result or its exception;
  a failed fetch caches nothing, so the next request retries.
- Pinning: an entry the engine is about to copy to the device, or is using, must not be evicted
  under it. If everything is pinned the budget is exceeded rather than breaking a running step;
  the overshoot is logged and undone as soon as entries are unpinned.
- Values are read-only by contract (pitfall 5): callers scatter into copies, never in place.
- ``to_device`` is the only CUDA-aware code here, kept thin; on CPU it is the identity.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger(__name__)

V = TypeVar("V")


def nbytes_of(value: Any) -> int:
    """Default size function: tensors, bytes-likes and (nested) dicts/lists/tuples of them."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, Mapping):
        return sum(nbytes_of(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes_of(v) for v in value)
    raise TypeError(f"cannot size a {type(value).__name__}; pass size_fn")


@dataclass(frozen=True)
class CacheStats:
    """Counters for metrics; ``hits + coalesced + misses`` = lookups."""

    hits: int
    misses: int
    coalesced: int
    fetch_errors: int
    bytes_fetched: int
    evictions: int
    bytes_evicted: int
    over_budget_admissions: int
    resident_bytes: int
    entries: int
    pinned_entries: int
    budget_bytes: int


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    pins: int = 0


class _Flight(Generic[V]):
    """One in-progress fetch that later requesters wait on instead of fetching again."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: V | None = None
        self.error: BaseException | None = None
        self.extra_pins = 0  # pins requested by waiters, applied atomically at insertion


class HostCache(Generic[V]):
    """Thread-safe LRU over a byte budget with single-flight fetches and pin counts."""

    def __init__(self, budget_bytes: int, size_fn: Callable[[V], int] = nbytes_of) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._size_fn = size_fn
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry[V]] = OrderedDict()
        self._flights: dict[Hashable, _Flight[V]] = {}
        self._resident = 0
        self._over_budget_logged = False
        self._hits = self._misses = self._coalesced = self._fetch_errors = 0
        self._bytes_fetched = self._evictions = self._bytes_evicted = self._over_budget = 0

    # -- lookups -------------------------------------------------------------------------------

    def get_or_fetch(self, key: Hashable, fetch_fn: Callable[[], V], *, pin: bool = False) -> V:
        """The cached value, or ``fetch_fn()`` run once for all concurrent callers of ``key``.

        With ``pin=True`` the entry is pinned atomically with the lookup (call ``unpin`` later,
        or use ``pinned``); otherwise it could be evicted between lookup and pin.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._hits += 1
                self._entries.move_to_end(key)
                if pin:
                    entry.pins += 1
                return entry.value
            flight = self._flights.get(key)
            if flight is not None:
                self._coalesced += 1
                if pin:
                    flight.extra_pins += 1
                leader = False
            else:
                flight = _Flight()
                self._flights[key] = flight
                self._misses += 1
                leader = True
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value  # type: ignore[return-value]
        return self._lead(key, flight, fetch_fn, pin)

    def _lead(self, key: Hashable, flight: _Flight[V], fetch_fn: Callable[[], V], pin: bool) -> V:
        try:
            value = fetch_fn()
            size = int(self._size_fn(value))
        except BaseException as exc:
            with self._lock:
                self._fetch_errors += 1
                del self._flights[key]
            flight.error = exc
            flight.done.set()
            raise
        with self._lock:
            del self._flights[key]
            self._bytes_fetched += size
            pins = flight.extra_pins + (1 if pin else 0)
            self._admit(key, value, size, pins)
            flight.value = value
        flight.done.set()
        return value

    def _admit(self, key: Hashable, value: V, size: int, pins: int) -> None:
        """Insert (lock held). An unpinned value larger than the whole budget is not cached:
        it would evict everything else and then itself."""
        if pins == 0 and size > self.budget_bytes:
            log.debug("not caching %r: %d bytes exceed the budget %d", key, size, self.budget_bytes)
            return
        old = self._entries.pop(key, None)
        if old is not None:  # replaced by put(); keep its pins
            self._resident -= old.size
            pins += old.pins
        self._entries[key] = _Entry(value, size, pins)
        self._resident += size
        if not self._evict_to_budget():
            self._over_budget += 1

    def put(self, key: Hashable, value: V) -> None:
        """Insert or replace a value produced elsewhere (e.g. just written by a warm-up)."""
        size = int(self._size_fn(value))
        with self._lock:
            self._admit(key, value, size, 0)

    def peek(self, key: Hashable) -> V | None:
        """The resident value without fetching, counting or touching LRU order."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.value

    def keys(self) -> list[Hashable]:
        """Resident keys (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- pinning -------------------------------------------------------------------------------

    def pin(self, key: Hashable) -> V:
        """Pin a resident entry (pins nest); ``KeyError`` if it is not resident."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            entry.pins += 1
            self._entries.move_to_end(key)
            return entry.value

    def unpin(self, key: Hashable) -> None:
        """Release one pin; once nothing is pinned the budget is enforced again."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise KeyError(f"{key!r} is not pinned")
            entry.pins -= 1
            if entry.pins == 0:
                self._evict_to_budget()

    @contextmanager
    def pinned(self, key: Hashable, fetch_fn: Callable[[], V] | None = None) -> Iterator[V]:
        """Hold ``key`` resident for the block; fetch it first (single-flight) if ``fetch_fn``."""
        value = self.get_or_fetch(key, fetch_fn, pin=True) if fetch_fn else self.pin(key)
        try:
            yield value
        finally:
            self.unpin(key)

    # -- eviction ------------------------------------------------------------------------------

    def _evict_to_budget(self) -> bool:
        """Evict least-recently-used unpinned entries until within budget (lock held).

        Returns whether the budget is met; it is not when the rest is pinned.
        """
        if self._resident <= self.budget_bytes:
            self._over_budget_logged = False
            return True
        for key in list(self._entries):
            if self._resident <= self.budget_bytes:
                break
            entry = self._entries[key]
            if entry.pins:
                continue
            del self._entries[key]
            self._resident -= entry.size
            self._evictions += 1
            self._bytes_evicted += entry.size
        if self._resident <= self.budget_bytes:
            self._over_budget_logged = False
            return True
        if not self._over_budget_logged:  # once per excursion, not per insertion
            self._over_budget_logged = True
            log.warning(
                "host cache over budget: %d of %d bytes resident, the rest is pinned",
                self._resident,
                self.budget_bytes,
            )
        return False

    def invalidate(self, key: Hashable) -> bool:
        """Drop an unpinned entry (e.g. its object was found corrupt). Returns whether it was."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins:
                return False
            del self._entries[key]
            self._resident -= entry.size
            return True

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if not e.pins]:
                self._resident -= self._entries.pop(key).size

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                coalesced=self._coalesced,
                fetch_errors=self._fetch_errors,
                bytes_fetched=self._bytes_fetched,
                evictions=self._evictions,
                bytes_evicted=self._bytes_evicted,
                over_budget_admissions=self._over_budget,
                resident_bytes=self._resident,
                entries=len(self._entries),
                pinned_entries=sum(1 for e in self._entries.values() if e.pins),
                budget_bytes=self.budget_bytes,
            )


# -- device transfer (the only CUDA-specific code path) -----------------------------------------

_copy_streams: dict[torch.device, Any] = {}
_copy_streams_lock = threading.Lock()


def _copy_stream(device: torch.device) -> Any:
    with _copy_streams_lock:
        stream = _copy_streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _copy_streams[device] = stream
        return stream


def to_device(
    tensor: torch.Tensor, device: torch.device | str, stream: Any | None = None
) -> torch.Tensor:
    """Copy a host tensor to ``device`` without stalling the compute stream.

    CUDA: page-locked staging + ``non_blocking`` copy on a dedicated copy stream; an event makes
    the *calling thread's current stream* wait for the copy on the GPU side (the host never
    blocks), and ``record_stream`` keeps the allocator from reusing the memory too early.
    A tensor already on ``device`` (always the case on CPU) is returned as is: there "resident"
    and "host" are the same memory. Not exercised on this CPU-only machine.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tensor.device == device:
        return tensor
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)  # not a host-to-GPU copy: nothing to overlap
    host = tensor if tensor.is_pinned() else tensor.pin_memory()
    copy_stream = stream if stream is not None else _copy_stream(device)
    with torch.cuda.stream(copy_stream):
        out = host.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
    consumer = torch.cuda.current_stream(device)
    consumer.wait_event(done)
    out.record_stream(consumer)
    return out


__all__ = ["CacheStats", "HostCache", "nbytes_of", "to_device"]
