"""Adapters a GPU worker can apply: a host-RAM LRU over the object store, fetched while jobs wait.

The same tier as template activations (``app/storage/hostcache.HostCache``: byte budget, one
fetch per key however many jobs ask, pins): the dispatcher asks the worker to fetch a job's
adapters as soon as it routes the job (``stencil.prefetch_loras``), the engine admits an exact
job only once its adapters are resident (``ready``), so loading never stalls a denoising step.
A job holds its adapters' weights from admission to the end, so eviction never pulls an adapter
from under a running job. An adapter that cannot be read is remembered with the reason, and the
jobs that need it fail with that reason instead of waiting forever; it is tried again after
``retry_after_s`` (the store may have been down).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from app.storage.hostcache import HostCache
from workers.adapters.lora import LoraWeights

log = logging.getLogger(__name__)


class AdapterBank:
    def __init__(self, read: Callable[[str], LoraWeights], budget_bytes: int, fetch_threads: int = 2,
                 retry_after_s: float = 30.0) -> None:
        self.read = read
        self.host: HostCache[LoraWeights] = HostCache(budget_bytes, size_fn=lambda w: w.nbytes)
        self._pool = ThreadPoolExecutor(max(1, fetch_threads), thread_name_prefix="stencil-lora-fetch")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._failed: dict[str, tuple[str, float]] = {}
        self._waiters: list[tuple[frozenset[str], Callable[[], None]]] = []
        self.retry_after_s = retry_after_s
        self.fetches = 0

    def _fetch(self, lora_id: str) -> None:
        try:
            self.host.get_or_fetch(lora_id, lambda: self._read(lora_id))
        except Exception as exc:
            log.warning("adapter %s could not be loaded: %s", lora_id, exc)
            with self._lock:
                reason = f"LoRA adapter {lora_id!r} could not be loaded ({type(exc).__name__})"
                self._failed[lora_id] = (reason, time.monotonic())
        finally:
            with self._lock:
                self._pending.discard(lora_id)
            self._notify()

    def _notify(self) -> None:
        """Run the callbacks whose adapters are all resident now (once each)."""
        with self._lock:
            due = [w for w in self._waiters if all(i in self.host for i in w[0])]
            self._waiters = [w for w in self._waiters if w not in due
                             and not any(i in self._failed for i in w[0])]
        for _ids, callback in due:
            try:
                callback()
            except Exception:
                log.exception("adapter ready callback failed")

    def _read(self, lora_id: str) -> LoraWeights:
        self.fetches += 1
        return self.read(lora_id)

    def prefetch(self, ids: Iterable[str], on_ready: Callable[[], None] | None = None) -> None:
        """Start loading adapters that are not resident (deduplicated; returns at once). ``on_ready``
        runs once all of them are resident (on the thread whose fetch completed the set, or here);
        never if one of them fails to load."""
        ids = list(ids)
        now = time.monotonic()
        for lora_id in ids:
            with self._lock:
                failed = self._failed.get(lora_id)
                if failed is not None and now - failed[1] < self.retry_after_s:
                    continue
                if lora_id in self.host or lora_id in self._pending:
                    continue
                self._failed.pop(lora_id, None)
                self._pending.add(lora_id)
            self._pool.submit(self._fetch, lora_id)
        if on_ready is not None:
            with self._lock:
                self._waiters.append((frozenset(ids), on_ready))
            self._notify()  # all of them may be resident already

    def ready(self, ids: Iterable[str]) -> bool:
        return all(i in self.host for i in ids)

    def failure(self, ids: Iterable[str]) -> str | None:
        """Why one of these adapters will never load, if one will not."""
        with self._lock:
            return next((self._failed[i][0] for i in ids if i in self._failed), None)

    def get(self, lora_id: str) -> LoraWeights:
        """A resident adapter (loads it now if it is not: callers check ``ready`` first)."""
        return self.host.get_or_fetch(lora_id, lambda: self._read(lora_id))

    def resident(self) -> set[str]:
        return {str(k) for k in self.host.keys()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["AdapterBank"]
