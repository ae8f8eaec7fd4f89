"""Template activations for the engine: host-RAM tier over the object store, fetched ahead.

``StepCacheProvider`` serves one (template cache, step) at a time to the runner without ever
blocking the denoising loop: ``ready`` returns the tensors if they are resident in host RAM and
otherwise starts fetching them and returns None (the runner then computes that job's step fully,
which is always correct). Fetches are deduplicated per (cache digest, step), so jobs sharing a
template share one copy (DESIGN.md pitfall 7), and run on a small thread pool. A step that failed
to load (missing, corrupt, store down) is remembered and never retried in a tight loop.

``CacheRecorder`` writes a warm-up's per-step activations in order on a background thread and
commits the manifest last, so a partly written cache is never visible.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from app import metrics
from app.storage.hostcache import HostCache
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey

log = logging.getLogger(__name__)

StepTensors = dict[str, torch.Tensor]


class StepCacheProvider:
    def __init__(self, activations: ActivationStore, budget_bytes: int, fetch_threads: int = 2,
                 retry_after_s: float = 30.0) -> None:
        self.activations = activations
        self.host: HostCache[StepTensors] = HostCache(budget_bytes)
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="stencil-fetch")
        self._inflight: set[tuple[str, int]] = set()
        self._failed: dict[tuple[str, int], float] = {}
        self._templates: dict[str, str] = {}  # cache digest -> template id
        self._lock = threading.Lock()
        self.retry_after_s = retry_after_s
        self.fetch_seconds = 0.0
        self.fetched_bytes = 0

    def _fetch(self, key: TemplateCacheKey, step: int) -> StepTensors:
        start = time.perf_counter()
        tensors = self.activations.read_step(key, step)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            self.fetch_seconds += time.perf_counter() - start
            self.fetched_bytes += nbytes
        metrics.observe_cache("store", True, nbytes)
        return tensors

    def _run(self, key: TemplateCacheKey, step: int, slot: tuple[str, int]) -> None:
        try:
            self.host.get_or_fetch(slot, lambda: self._fetch(key, step))
        except Exception as exc:  # missing/corrupt/unreachable: this step computes fully
            log.warning("activation cache %s step %d unavailable: %s", slot[0], step, exc)
            with self._lock:
                self._failed[slot] = time.monotonic()
        finally:
            with self._lock:
                self._inflight.discard(slot)

    def resident_templates(self) -> set[str]:
        """Templates with at least one step in host RAM (the dispatcher's affinity term)."""
        digests = {slot[0] for slot in self.host.keys()}
        return {self._templates[d] for d in digests if d in self._templates}

    def prefetch(self, key: TemplateCacheKey, steps: Iterable[int]) -> None:
        digest = key.digest()
        self._templates[digest] = key.template_id
        for step in steps:
            if not 0 <= step < key.steps:
                continue
            slot = (digest, step)
            if slot in self.host:
                continue
            with self._lock:
                failed_at = self._failed.get(slot)
                if slot in self._inflight or (failed_at is not None
                                              and time.monotonic() - failed_at < self.retry_after_s):
                    continue
                self._inflight.add(slot)
            self._pool.submit(self._run, key, step, slot)

    def ready(self, key: TemplateCacheKey, step: int) -> StepTensors | None:
        """The step's tensors if resident (never blocks); otherwise start fetching them."""
        value = self.host.peek((key.digest(), step))
        metrics.observe_cache("host", value is not None, 0)
        if value is None:
            self.prefetch(key, [step])
        return value

    def wait(self, key: TemplateCacheKey, step: int, timeout: float) -> StepTensors | None:
        """Blocking variant for tools and tests (not used inside the loop)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.ready(key, step)
            if value is not None:
                return value
            time.sleep(0.005)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class CacheRecorder:
    """Ordered background writer of warm-up activations."""

    def __init__(self, activations: ActivationStore) -> None:
        self.activations = activations
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stencil-record")

    def put(self, key: TemplateCacheKey, step: int, tensors: StepTensors) -> Future:
        # Copy out of the batch's buffers now: the loop reuses nothing, but be explicit.
        owned = {k: v.detach().to("cpu").clone() for k, v in tensors.items()}
        return self._pool.submit(self.activations.put_step, key, step, owned)

    def commit(self, key: TemplateCacheKey) -> Future:
        """Runs after every ``put`` submitted before it (single ordered worker)."""
        return self._pool.submit(self.activations.commit, key)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
