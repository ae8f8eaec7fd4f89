"""An ObjectStore wrapper that emulates a slower link (PCIe, S3, NVMe) on this CPU-only machine.

Why: the loader's plan (``workers/engine/plan.py``) trades load time against compute time, and
benchmarks must show that trade at realistic bandwidths, not at local-disk speed. Transfers share
one emulated link, served in request order like a single copy engine: a request's bytes start
moving when the link is free, take ``nbytes / bandwidth``, and the request returns after that
plus its own ``latency_s`` (latency overlaps between concurrent requests; bandwidth does not).
The inner store's real time counts against the emulated time, so the result is
``max(real, emulated)`` rather than their sum.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from app.storage.base import ObjectStore


@dataclass(frozen=True)
class ThrottleStats:
    """What went over the emulated link and how long callers were held back."""

    requests: int
    bytes_read: int
    bytes_written: int
    slept_s: float


class ThrottledStore(ObjectStore):
    """Wrap ``inner``; data calls cost ``latency_s + nbytes / bandwidth_bytes_per_s``."""

    def __init__(
        self,
        inner: ObjectStore,
        bandwidth_bytes_per_s: float = math.inf,
        latency_s: float = 0.0,
    ) -> None:
        if bandwidth_bytes_per_s <= 0 or latency_s < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        self.inner = inner
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._lock = threading.Lock()
        self._link_free_at = 0.0
        self._requests = self._bytes_read = self._bytes_written = 0
        self._slept = 0.0

    def transfer_time(self, nbytes: int) -> float:
        """Emulated seconds for one request of ``nbytes`` on an idle link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def _hold(self, started: float, nbytes: int, *, read: bool) -> None:
        """Sleep until this request would have completed on the emulated link."""
        duration = nbytes / self.bandwidth_bytes_per_s
        with self._lock:
            begin = max(started, self._link_free_at)
            finish = begin + duration
            self._link_free_at = finish
            self._requests += 1
            if read:
                self._bytes_read += nbytes
            else:
                self._bytes_written += nbytes
        wait = finish + self.latency_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
            with self._lock:
                self._slept += wait

    def put(self, key: str, data: bytes) -> None:
        started = time.monotonic()
        self.inner.put(key, data)
        self._hold(started, len(data), read=False)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        started = time.monotonic()
        data = self.inner.get(key, start, end)
        self._hold(started, len(data), read=True)
        return data

    def exists(self, key: str) -> bool:
        started = time.monotonic()
        found = self.inner.exists(key)
        self._hold(started, 0, read=True)
        return found

    def size(self, key: str) -> int:
        started = time.monotonic()
        size = self.inner.size(key)
        self._hold(started, 0, read=True)
        return size

    def list(self, prefix: str) -> Iterator[str]:
        started = time.monotonic()
        keys = list(self.inner.list(prefix))
        self._hold(started, 0, read=True)
        yield from keys

    def delete(self, key: str) -> None:
        started = time.monotonic()
        self.inner.delete(key)
        self._hold(started, 0, read=False)

    def stats(self) -> ThrottleStats:
        with self._lock:
            return ThrottleStats(self._requests, self._bytes_read, self._bytes_written, self._slept)


__all__ = ["ThrottleStats", "ThrottledStore"]
