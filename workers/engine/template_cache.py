"""Template activations for the engine: host-RAM tier over the object store, fetched ahead.

``StepCacheProvider`` serves one (template cache, step) at a time to the runner without ever
blocking the denoising loop on a whole step: ``ready`` returns the tensors if they are resident
in host RAM and otherwise starts fetching them and returns None. Fetches are deduplicated per
(cache digest, step), so jobs sharing a template share one copy (DESIGN.md pitfall 7), and run on
a few fetch threads. A step that failed to load (missing, corrupt, store down) is remembered and
never retried in a tight loop.

Fetch order (earliest need first). Background fetches are served from a priority queue keyed by
when each (template, step) is expected to be needed, not in request order: jobs share one link,
and FIFO would make a newly routed job's first steps wait behind a running job's step 20. The
estimate: for a template whose job is running (``ready`` was called for step ``c`` at time
``t_c``), step ``s`` is needed at ``t_c + (s - c) * dt``; for one whose job has not started (or stopped stepping),
at ``request time + start_in_s + s * dt`` (with ``batch_slots`` set: at its expected start, when
a batch slot frees after the running jobs' remaining steps, FIFO by request, if later); ``dt`` is
the measured interval between a job's
consecutive steps (EMA; ``default_step_s`` before any). A queued step is re-keyed when its
template's job advances (``ready``) or is requested again with an earlier need; a fetch that has
started is never preempted. Dedup per (template, step) and the never-block behaviour are as before.

Block-wise loading (the plan, ``workers/engine/plan.py``). With ``set_units`` (the mask-aware
model's plan units, in execution order, and the tensor names of each), a step is fetched unit by
unit with one ranged GET per unit (header first), and units already fetched are visible while the
rest are still in flight (``unit_status``). The engine's plan may then ask for the units it wants
*now*: ``load_units`` queues them on one loader thread (the copy stream: on CPU it only sleeps
on the store, so it overlaps with compute), in block order, ahead of background prefetch, and
``acquire`` waits for one unit until a deadline (False = compute that unit fully);
``link_busy_s`` tells the plan how long background fetches in flight still hold the link. Background
prefetch reads a step nobody has touched in one GET of the whole object (manifests are cached,
so one request per step: the prefetcher is latency-bound on S3), otherwise all units nobody has
claimed yet in one ranged GET per contiguous run after the header; units queued on the copy
stream are left to it (``claimed``: a background completion that starts first must not swallow
the plan's first unit into one big GET), otherwise whatever fetches a unit first, the other path skips it; a step whose
units are all fetched is assembled into the host-RAM LRU as one entry. The provider measures
the store's bandwidth and per-request latency from its own fetches (EMA) for the plan's load
times (``store_tier``).

``CacheRecorder`` writes a warm-up's per-step activations in order on a background thread and
commits the manifest last, so a partly written cache is never visible.

Storage codec (``workers/engine/cache_codec.py``). The recorder encodes steps with the configured
codec (exact-region caches: lossless); host RAM keeps the stored bytes, so the byte budget holds
as many more templates as the codec compresses; ``ready`` and ``acquire`` hand the model a view
that decodes each tensor on first access into ``dtype`` on ``device`` (float32 storage of a
float32 model: the stored tensors themselves). Units a warm-up did not store (manifest ``units``)
are never fetched or waited for; the runner computes them fully.

Stored steps (``STENCIL_CACHE_STEPS`` = n, ``stored_steps``). A template warm-up may store only n
steps of its schedule (its key's layout says so, ``/steps-<n>``: warm-up and edits agree, and a
cache of another count is another cache). The schedule is cut into n equal segments, the middle
step of each is stored (manifest ``stored_steps``), and an edit's step is served by its segment's
stored step. K/V of the unmasked tokens change slowly from step to step (and the refresh steps'
offset re-anchors them to the edit's own), so a template costs n steps of bytes whatever its step
count; measured against every-step caches in ``docs/bench/cache_steps.md``. Exact-region caches
store every step. The provider maps steps at its public methods, so the host tier, prefetch queue
and plan see stored steps only (one copy serves a whole segment).

Shared CFG rows (``cache_codec.share_rows``). The recorder stores a tensor whose rows are bit-equal
(template warm-ups: prompt "" and negative prompt "") with one row and records the cache's row
count (manifest ``rows``) and the names stored so in every step (``shared_rows``). Host RAM, the
link and the store carry the one row; the decoding view expands it back to the recorded rows
(zero-copy), so the model reads what was recorded, bit for bit.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from app import metrics
from app.storage.hostcache import HostCache
from app.storage.tensorfile import TensorHeader
from workers.engine import cache_codec
from workers.engine.plan import Tier
from workers.engine.staging import pack
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey

log = logging.getLogger(__name__)

StepTensors = dict[str, torch.Tensor]
Slot = tuple[str, int]


def stored_steps(steps: int, n: int) -> list[int]:
    """The steps a warm-up of ``steps`` steps stores when it stores ``n`` (module doc): the middle
    step of each of ``n`` equal segments; every step when ``n`` is 0 or at least ``steps``."""
    return list(_stored_steps(steps, n))


@functools.lru_cache(maxsize=256)
def _stored_steps(steps: int, n: int) -> tuple[int, ...]:
    if n <= 0 or n >= steps:
        return tuple(range(steps))
    segments: dict[int, list[int]] = {}
    for s in range(steps):
        segments.setdefault(s * n // steps, []).append(s)
    return tuple(members[len(members) // 2] for _, members in sorted(segments.items()))


def serving_step(step: int, stored: Sequence[int], steps: int) -> int:
    """The stored step that serves ``step`` of a ``steps``-step schedule: its segment's."""
    return int(stored[step * len(stored) // steps])


def key_stored_steps(key: TemplateCacheKey) -> tuple[int, ...] | None:
    """The steps a cache under ``key`` stores (its ``stored_step_count``, module doc); None = every
    step. Computed from the key: no I/O, cheap enough for the step loop."""
    n = key.stored_step_count
    return None if n <= 0 else _stored_steps(key.steps, n)


@dataclass
class _Fill:
    """A step being fetched unit by unit: what has arrived so far."""

    key: TemplateCacheKey
    step: int
    obj: str | None = None
    header: TensorHeader | None = None
    units: dict[str, StepTensors] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)
    claimed: set[str] = field(default_factory=set)  # queued on the copy stream, not started yet
    error: BaseException | None = None
    header_lock: threading.Lock = field(default_factory=threading.Lock)
    whole: StepTensors | None = None  # the step read in one piece (packed in one buffer on a GPU host)


class StepCacheProvider:
    def __init__(self, activations: ActivationStore, budget_bytes: int, fetch_threads: int = 2,
                 retry_after_s: float = 30.0, default_step_s: float = 0.25,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if fetch_threads < 1 or default_step_s <= 0:
            raise ValueError("fetch_threads must be >= 1 and default_step_s > 0")
        self.activations = activations
        # Host RAM holds the stored (possibly compressed) bytes; tensors are decoded into the
        # compute ``dtype`` on ``device`` only when handed to the model (``cache_codec``).
        self.dtype = dtype
        self.device = device
        self.host: HostCache[StepTensors] = HostCache(budget_bytes)
        self._inflight: set[Slot] = set()  # queued or running background fetches
        # Background fetch queue, earliest expected need first (module doc).
        self._heap: list[tuple[float, int, Slot]] = []
        self._queued: dict[Slot, tuple[float, TemplateCacheKey, float]] = {}  # slot -> (need, key, start_at)
        self._seq = itertools.count()
        self._cursor: dict[str, tuple[int, float]] = {}  # digest -> (step, monotonic time of ``ready``)
        self.default_step_s = default_step_s
        self._step_ema: float | None = None
        # Engine batch slots, if known: then a job that has not started is expected to start when a
        # slot frees (running jobs' remaining steps x dt, FIFO by request), not at its request.
        self.batch_slots: int | None = None
        self._steps: dict[str, int] = {}  # digest -> the cache's step count
        self._start_est: dict[str, float] = {}  # digest of a waiting job -> expected start
        self.fetch_order: list[Slot] = []  # background fetches in the order they started (tests, logs)
        self._failed: dict[Slot, float] = {}
        self._templates: dict[str, str] = {}  # cache digest -> template id
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.retry_after_s = retry_after_s
        self.fetch_seconds = 0.0
        self.fetched_bytes = 0
        self._store_bytes: dict[str, int] = {}  # cache digest -> bytes read from the store (``store_bytes_of``)
        # Block-wise loading (enabled by ``set_units``).
        self._units: dict[str, list[str]] | None = None
        self._fills: dict[Slot, _Fill] = {}
        self._demand: queue.Queue[tuple[TemplateCacheKey, int, str] | None] = queue.Queue()
        self._demand_pending = 0  # queued + in-flight demand loads (``drain``)
        self._loader: threading.Thread | None = None
        self._closed = False
        # Measured store link (EMA over this provider's own requests).
        self._bw_ema: float | None = None
        self._lat_ema: float | None = None
        self.ema_alpha = 0.3
        self.load_log: list[tuple[Slot, str, float, float, int]] = []  # (slot, unit, start, end, bytes)
        self._bg_started: dict[Slot, float] = {}  # background fetches in flight -> start (monotonic)
        self._bg_ema: float | None = None  # measured duration of one background fetch
        self._workers = [threading.Thread(target=self._fetch_loop, name=f"stencil-fetch-{i}", daemon=True)
                         for i in range(fetch_threads)]
        for w in self._workers:
            w.start()

    # -- configuration -----------------------------------------------------------------------
    def set_units(self, units: Mapping[str, Sequence[str]]) -> None:
        """Enable unit-wise fetching: ``{unit: tensor names}`` in execution order."""
        self._units = {u: list(names) for u, names in units.items()}
        if self._loader is None:
            self._loader = threading.Thread(target=self._demand_loop, name="stencil-copy", daemon=True)
            self._loader.start()

    @property
    def unit_names(self) -> list[str]:
        return list(self._units or {})

    def stored_units(self, key: TemplateCacheKey) -> set[str] | None:
        """Plan units a cache stores, if its warm-up stored only some (manifest ``units``; a
        warm-up at a given link speed, ``runner_base``); None = all of them."""
        try:
            units = self.activations.cached_manifest(key).get("units")
        except Exception:  # no manifest (deleted, store down): the step's own reads will say so
            return None
        return None if units is None else set(units)  # type: ignore[arg-type]

    def codec_of(self, key: TemplateCacheKey) -> str:
        """The storage codec a committed cache was recorded with (manifest; ``float32`` before codecs)."""
        try:
            return str(self.activations.cached_manifest(key).get("codec", "float32"))
        except Exception:
            return "float32"

    def rows_of(self, key: TemplateCacheKey) -> int:
        """Row count of a committed cache's tensors (manifest ``rows``), for expanding shared rows;
        0 = not recorded (caches from before shared rows: nothing to expand)."""
        try:
            return int(self.activations.cached_manifest(key).get("rows", 0))  # type: ignore[call-overload]
        except Exception:  # no manifest: the step's own reads will say so
            return 0

    def shared_rows_of(self, key: TemplateCacheKey) -> frozenset[str]:
        """Names a committed cache stores with one row in every step (the plan's load bytes)."""
        try:
            return frozenset(self.activations.cached_manifest(key).get("shared_rows", ()))  # type: ignore[arg-type]
        except Exception:
            return frozenset()

    @staticmethod
    def stored_step(key: TemplateCacheKey, step: int) -> int:
        """The step whose stored tensors serve ``step`` (the key's ``stored_step_count``, module
        doc; computed, no I/O); ``step`` itself when the warm-up stored every step."""
        stored = key_stored_steps(key)
        if stored is None or not 0 <= step < key.steps:
            return step
        return serving_step(step, stored, key.steps)

    def _present(self, key: TemplateCacheKey) -> list[str]:
        """This cache's stored units, in execution order."""
        assert self._units is not None
        stored = self.stored_units(key)
        return [u for u in self._units if stored is None or u in stored]

    # -- measurement ---------------------------------------------------------------------------
    def _observe(self, digest: str, nbytes: int, seconds: float, request: bool = True) -> None:
        with self._lock:
            self.fetch_seconds += seconds
            self.fetched_bytes += nbytes
            self._store_bytes[digest] = self._store_bytes.get(digest, 0) + nbytes
            a = self.ema_alpha
            if nbytes == 0 or nbytes < 64 * 1024:  # small requests: latency
                self._lat_ema = seconds if self._lat_ema is None else (1 - a) * self._lat_ema + a * seconds
            else:
                lat = self._lat_ema or 0.0
                bw = nbytes / max(seconds - (lat if request else 0.0), 1e-6)
                self._bw_ema = bw if self._bw_ema is None else (1 - a) * self._bw_ema + a * bw

    def store_bytes_of(self, key: TemplateCacheKey) -> int:
        """Bytes of this template cache that this worker's host-RAM tier has read from the object
        store: a job's record says so (``cache_store_bytes``), since a cache recorded on another host
        can only arrive that way."""
        with self._lock:
            return self._store_bytes.get(key.digest(), 0)

    def store_tier(self) -> Tier | None:
        """The object store as a plan tier, from measured fetches (None before any)."""
        with self._lock:
            if self._bw_ema is None:
                return None
            return Tier("store", self._bw_ema, self._lat_ema or 0.0)

    # -- fetch order ---------------------------------------------------------------------------------
    def step_seconds(self) -> float:
        """Measured interval between a job's consecutive steps (``default_step_s`` before any)."""
        return self._step_ema if self._step_ema is not None else self.default_step_s

    def _need_at(self, digest: str, step: int, start_at: float) -> float:
        """Expected time (``time.monotonic``) the engine needs this step (caller holds the lock)."""
        dt = self.step_seconds()
        cursor = self._cursor.get(digest)
        if cursor is None or time.monotonic() - cursor[1] > max(2.0, 20 * dt):
            # No job of this template is running (or it stopped stepping): from the request
            # (or the job's expected start).
            return max(start_at, self._start_est.get(digest, start_at)) + step * dt
        c, t_c = cursor
        return t_c + (step - c) * dt

    def _push(self, slot: Slot, key: TemplateCacheKey, start_at: float) -> None:
        """Queue a background fetch, or move a queued one earlier (caller holds the lock)."""
        need = self._need_at(slot[0], slot[1], start_at)
        old = self._queued.get(slot)
        if old is not None:
            if old[0] <= need:
                return
            start_at = min(start_at, old[2])
        self._queued[slot] = (need, key, start_at)
        heapq.heappush(self._heap, (need, next(self._seq), slot))
        self._cond.notify_all()

    def _estimate_starts(self, now: float) -> None:
        """Expected start of each waiting job's template (``batch_slots`` known; caller holds the
        lock): slots free when running jobs finish their remaining steps; waiting jobs take them
        in request order (the engine admits FIFO)."""
        self._start_est.clear()
        if self.batch_slots is None:
            return
        dt = self.step_seconds()
        stale = max(2.0, 20 * dt)
        running = {d for d, (_c, t_c) in self._cursor.items() if now - t_c <= stale}
        ends = [t_c + max(0, self._steps.get(d, c + 1) - c) * dt
                for d, (c, t_c) in self._cursor.items() if d in running]
        free = [now] * max(0, self.batch_slots - len(ends)) + sorted(ends)[:self.batch_slots]
        heapq.heapify(free)
        waiting: dict[str, float] = {}
        for slot, (_need, _key, start_at) in self._queued.items():
            if slot[0] not in running:
                waiting[slot[0]] = min(waiting.get(slot[0], math.inf), start_at)
        for d, requested in sorted(waiting.items(), key=lambda item: item[1]):
            start = max(heapq.heappop(free) if free else now, requested)
            self._start_est[d] = start
            heapq.heappush(free, start + self._steps.get(d, 1) * dt)

    def _advance(self, digest: str, step: int) -> None:
        """A job of this template is at ``step`` now: measure the step interval, re-key its queue."""
        now = time.monotonic()
        with self._lock:
            cursor = self._cursor.get(digest)
            if cursor is not None and cursor[0] == step:
                return
            if cursor is not None and 0 < step - cursor[0] <= 4:
                dt = (now - cursor[1]) / (step - cursor[0])
                self._step_ema = dt if self._step_ema is None else 0.7 * self._step_ema + 0.3 * dt
            self._cursor[digest] = (step, now)
            if len(self._cursor) > 1024:  # forget templates nobody has stepped for 10 minutes
                self._cursor = {d: c for d, c in self._cursor.items() if now - c[1] < 600}
            self._estimate_starts(now)
            for slot, (old, key, start_at) in list(self._queued.items()):
                if slot[0] == digest or self.batch_slots is not None:
                    need = self._need_at(slot[0], slot[1], start_at)
                    if need != old:
                        self._queued[slot] = (need, key, start_at)
                        heapq.heappush(self._heap, (need, next(self._seq), slot))
            if len(self._heap) > 4 * len(self._queued) + 64:  # drop stale entries now and then
                self._heap = [(n, q, sl) for n, q, sl in self._heap
                              if sl in self._queued and self._queued[sl][0] == n]
                heapq.heapify(self._heap)
            self._cond.notify_all()

    def _fetch_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._heap:
                        need, _seq, slot = heapq.heappop(self._heap)
                        entry = self._queued.get(slot)
                        if entry is None or entry[0] != need:
                            continue  # stale: re-keyed or already taken
                        del self._queued[slot]
                        self._bg_started[slot] = time.monotonic()
                        key = entry[1]
                        self.fetch_order.append(slot)
                        del self.fetch_order[:-4096]
                        break
                    self._cond.wait(1.0)
            self._run(key, slot[1], slot)

    def queued(self) -> list[Slot]:
        """Queued background fetches, the next one first (tests, logs)."""
        with self._lock:
            return [slot for _need, slot in sorted((e[0], s) for s, e in self._queued.items())]

    # -- whole-step fetches (background prefetch) --------------------------------------------------
    def _fetch(self, key: TemplateCacheKey, step: int) -> StepTensors:
        start = time.perf_counter()
        tensors = self._pinned(self.activations.read_step(key, step))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._observe(key.digest(), nbytes, time.perf_counter() - start, request=False)
        metrics.observe_cache("store", True, nbytes)
        return tensors

    def _run(self, key: TemplateCacheKey, step: int, slot: Slot) -> None:
        try:
            if self._units is None:
                self.host.get_or_fetch(slot, lambda: self._fetch(key, step))
            else:
                self._fill_all(key, step, slot)
        except Exception as exc:  # missing/corrupt/unreachable: this step computes fully
            log.warning("activation cache %s step %d unavailable: %s", slot[0], step, exc)
            with self._cond:
                self._failed[slot] = time.monotonic()
                fill = self._fills.pop(slot, None)
                if fill is not None:
                    fill.error = exc
                self._cond.notify_all()
        finally:
            with self._lock:
                self._inflight.discard(slot)
                started = self._bg_started.pop(slot, None)
                if started is not None:
                    took = time.monotonic() - started
                    self._bg_ema = took if self._bg_ema is None else 0.7 * self._bg_ema + 0.3 * took

    def link_busy_s(self) -> float:
        """How long background fetches already in flight will still occupy the link (the plan
        starts its loads after them): each one's expected duration (EMA) minus its age."""
        with self._lock:
            if not self._bg_started or self._bg_ema is None:
                return 0.0
            now = time.monotonic()
            return sum(max(0.0, self._bg_ema - (now - t0)) for t0 in self._bg_started.values())

    # -- unit-wise fetches -----------------------------------------------------------------------
    def _fill_for(self, key: TemplateCacheKey, step: int) -> _Fill:
        slot = (key.digest(), step)
        with self._lock:
            fill = self._fills.get(slot)
            if fill is None:
                fill = self._fills[slot] = _Fill(key, step)
            return fill

    def _header(self, fill: _Fill) -> tuple[str, TensorHeader]:
        with fill.header_lock:
            if fill.header is None:
                t0 = time.perf_counter()
                fill.obj, fill.header = self.activations.step_header(fill.key, fill.step)
                self._observe(fill.key.digest(), 0, (time.perf_counter() - t0) / 2)  # two small GETs: manifest, header
            assert fill.obj is not None
            return fill.obj, fill.header

    def _load_unit(self, fill: _Fill, slot: Slot, unit: str) -> bool:
        """Fetch one unit unless present or being fetched; True if this call fetched it."""
        assert self._units is not None
        absent = unit not in self._present(fill.key)  # not stored by its warm-up: computed fully
        with self._lock:
            fill.claimed.discard(unit)
            if absent or unit in fill.units or unit in fill.loading or fill.error is not None:
                self._cond.notify_all()
                return False
            fill.loading.add(unit)
        try:
            tensors, t0, t1, nbytes = self._read_measured(fill, self._units[unit])
        except BaseException:
            with self._cond:
                fill.loading.discard(unit)
                self._cond.notify_all()
            raise
        with self._cond:
            fill.loading.discard(unit)
            fill.units[unit] = tensors
            self.load_log.append((slot, unit, t0, t1, nbytes))
            del self.load_log[:-4096]
            self._cond.notify_all()
        return True

    def _read_measured(self, fill: _Fill, names: list[str]) -> tuple[dict[str, torch.Tensor], float, float, int]:
        """One ranged read of ``names`` from the step object; feeds the bandwidth estimate."""
        obj, header = self._header(fill)
        t0 = time.perf_counter()
        tensors = self.activations.read_tensors(obj, header, names)
        t1 = time.perf_counter()
        tensors = self._pinned(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._observe(fill.key.digest(), nbytes, t1 - t0)
        metrics.observe_cache("store", True, nbytes)
        return tensors, t0, t1, nbytes

    def _land(self, fill: _Fill, slot: Slot, units: list[str],
              read: Callable[[], tuple[StepTensors, float, float, int]], whole: bool = False) -> None:
        """Run one read of ``units`` (already marked loading) and make them visible, or unmark
        them if the read fails; either way waiters are woken. ``whole``: the read is the step."""
        assert self._units is not None
        try:
            tensors, t0, t1, nbytes = read()
        except BaseException:
            with self._cond:
                fill.loading.difference_update(units)
                self._cond.notify_all()
            raise
        with self._cond:
            fill.loading.difference_update(units)
            if whole:
                fill.whole = tensors
            for u in units:
                fill.units[u] = {n: tensors[n] for n in self._units[u]}
            self.load_log.append((slot, "+".join(units) if len(units) < 3 else f"{len(units)} units", t0, t1, nbytes))
            del self.load_log[:-4096]
            self._cond.notify_all()

    def _load_rest(self, fill: _Fill, slot: Slot) -> None:
        """Fetch every unit nobody has fetched or claimed, in one ranged GET per contiguous run
        (background prefetch: one request latency per step, not one per unit)."""
        assert self._units is not None
        with self._lock:
            if fill.error is not None:
                return
            todo = [u for u in self._present(fill.key)
                    if u not in fill.units and u not in fill.loading and u not in fill.claimed]
            fill.loading.update(todo)
        if todo:
            self._land(fill, slot, todo, lambda: self._read_measured(fill, [n for u in todo for n in self._units[u]]))

    def _load_whole(self, fill: _Fill, slot: Slot) -> bool:
        """Background fetch of a step nobody has touched yet: one GET of the whole object
        (verified) instead of a header GET plus a ranged GET; False if some unit is already
        fetched, in flight or claimed by the copy stream (then ``_load_rest`` ranges around it)."""
        assert self._units is not None
        with self._lock:
            if fill.header is not None or fill.units or fill.loading or fill.claimed or fill.error is not None:
                return False
            units = self._present(fill.key)
            fill.loading.update(units)

        def read() -> tuple[StepTensors, float, float, int]:
            t0 = time.perf_counter()
            tensors = self.activations.read_step(fill.key, fill.step)
            t1 = time.perf_counter()
            tensors = self._pinned(tensors)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._observe(fill.key.digest(), nbytes, t1 - t0)
            metrics.observe_cache("store", True, nbytes)
            return tensors, t0, t1, nbytes

        self._land(fill, slot, units, read, whole=True)
        return True

    def _fill_all(self, key: TemplateCacheKey, step: int, slot: Slot) -> None:
        assert self._units is not None
        fill = self._fill_for(key, step)
        if self._closed:
            return
        if not self._load_whole(fill, slot):
            self._load_rest(fill, slot)
        with self._cond:  # the demand loader may still be fetching (or about to fetch) some unit
            while (fill.loading or fill.claimed) and fill.error is None:
                if self._closed or self._fills.get(slot) is not fill:
                    return  # closed, or forgotten meanwhile: nothing to assemble
                self._cond.wait(0.5)
            if fill.error is not None:
                raise fill.error
            tensors = {n: t for unit in self._present(key) for n, t in fill.units[unit].items()}
            if fill.whole is not None and fill.whole.keys() == tensors.keys():
                tensors = fill.whole  # as read: one buffer, staged in one copy
        self.host.put(slot, tensors)
        with self._cond:
            self._fills.pop(slot, None)
            self._cond.notify_all()

    def _demand_loop(self) -> None:
        while True:
            item = self._demand.get()
            if item is None:
                return
            key, step, unit = item
            slot = (key.digest(), step)
            try:
                if slot not in self.host:
                    self._load_unit(self._fill_for(key, step), slot, unit)
                else:
                    with self._cond:
                        fill = self._fills.get(slot)
                        if fill is not None:
                            fill.claimed.discard(unit)
            except Exception as exc:
                log.warning("activation cache %s step %d unit %s unavailable: %s", slot[0], step, unit, exc)
                with self._cond:
                    fill = self._fills.pop(slot, None)
                    if fill is not None:
                        fill.error = exc
                    self._failed[slot] = time.monotonic()
            finally:
                with self._cond:
                    self._demand_pending -= 1
                    self._cond.notify_all()

    def unit_status(self, key: TemplateCacheKey, step: int) -> tuple[set[str], bool]:
        """(units resident in host RAM now, whether the step is known to be unavailable)."""
        slot = (key.digest(), self.stored_step(key, step))
        if slot in self.host:
            return set(self._units or {}), False
        with self._lock:
            failed_at = self._failed.get(slot)
            if failed_at is not None and time.monotonic() - failed_at < self.retry_after_s:
                return set(), True
            fill = self._fills.get(slot)
            return (set(fill.units) if fill is not None else set()), False

    def load_units(self, key: TemplateCacheKey, step: int, units: Iterable[str], complete: bool = True) -> None:
        """Queue these units of a step on the copy-stream thread (in the order given); with
        ``complete`` the rest of the step follows in the background, after the queued loads."""
        if self._units is None:
            raise RuntimeError("load_units needs set_units")
        step = self.stored_step(key, step)
        fill = self._fill_for(key, step)
        for unit in units:
            with self._lock:
                self._demand_pending += 1
                if unit not in fill.units and unit not in fill.loading:
                    fill.claimed.add(unit)  # background prefetch leaves it to the copy stream
            self._demand.put((key, step, unit))
        if complete:
            self.prefetch(key, [step])

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until no demand load is queued or running (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._demand_pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def forget(self, key: TemplateCacheKey, step: int) -> None:
        """Drop a step from host RAM and any partial fill (benchmarks: a cold start each trial)."""
        slot = (key.digest(), self.stored_step(key, step))
        self.host.invalidate(slot)
        with self._cond:
            self._fills.pop(slot, None)
            self._failed.pop(slot, None)

    def acquire(self, key: TemplateCacheKey, step: int, unit: str, deadline: float) -> StepTensors | None:
        """One unit's tensors, waiting until ``deadline`` (``time.monotonic``); None = not in time
        (or not stored by the cache's warm-up: never waited for)."""
        slot = (key.digest(), self.stored_step(key, step))
        if self._units is not None and unit in self._units and unit not in self._present(key):
            return None
        with self._cond:
            while True:
                whole = self.host.peek(slot)
                if whole is not None:
                    assert self._units is not None
                    if any(n not in whole for n in self._units[unit]):
                        return None  # a unit its warm-up did not store
                    return self._decoded({n: whole[n] for n in self._units[unit]}, key)
                fill = self._fills.get(slot)
                if fill is not None and unit in fill.units:
                    return self._decoded(fill.units[unit], key)
                if fill is None or fill.error is not None:
                    return None  # not being fetched (or failed): never wait for nothing
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.05))

    # -- public step-level API -------------------------------------------------------------------
    def resident_templates(self) -> set[str]:
        """Templates with at least one step in host RAM (the dispatcher's affinity term)."""
        digests = {slot[0] for slot in self.host.keys()}
        return {self._templates[d] for d in digests if d in self._templates}

    def prefetch(self, key: TemplateCacheKey, steps: Iterable[int], start_in_s: float = 0.0) -> None:
        """Queue background fetches of these steps (never blocks). ``start_in_s``: when the job is
        expected to start, for jobs not running yet (fetch order, module doc)."""
        digest = key.digest()
        self._templates[digest] = key.template_id
        self._steps[digest] = key.steps
        start_at = time.monotonic() + max(0.0, start_in_s)
        for step in dict.fromkeys(self.stored_step(key, s) for s in steps):
            if not 0 <= step < key.steps:
                continue
            slot = (digest, step)
            if slot in self.host:
                continue
            with self._lock:
                if self._closed:
                    return
                failed_at = self._failed.get(slot)
                if failed_at is not None and time.monotonic() - failed_at < self.retry_after_s:
                    continue
                if slot in self._inflight:
                    if slot in self._queued:
                        self._push(slot, key, start_at)  # requested again: maybe needed sooner
                    continue
                self._inflight.add(slot)
                self._push(slot, key, start_at)

    def ready(self, key: TemplateCacheKey, step: int, fetch: bool = True) -> StepTensors | None:
        """The step's tensors if resident (never blocks); otherwise start fetching them (unless
        ``fetch`` is False: the caller's plan queues unit loads first, then completes the step).
        Also tells the fetch order that a job of this template is at ``step`` now."""
        step = self.stored_step(key, step)
        self._advance(key.digest(), step)
        value = self.host.peek((key.digest(), step))
        metrics.observe_cache("host", value is not None, 0)
        if value is None and fetch:
            self.prefetch(key, [step])
        return None if value is None else self._decoded(value, key)  # type: ignore[return-value]

    def peek(self, key: TemplateCacheKey, step: int) -> Mapping[str, torch.Tensor] | None:
        """The step's tensors if resident, else None: no fetch, no effect on the fetch order
        (the runner staging a job's next step while the current one computes)."""
        value = self.host.peek((key.digest(), self.stored_step(key, step)))
        return None if value is None else self._decoded(value, key)

    def _pinned(self, tensors: StepTensors) -> StepTensors:
        """Host tensors page-locked in one buffer when steps are read by a GPU, so that a step's
        copy to it is one asynchronous transfer (``workers/engine/staging.py``); as they are
        otherwise."""
        if self.device is None or torch.device(self.device).type != "cuda" or not torch.cuda.is_available():
            return tensors
        return pack(tensors, pin=True)  # one buffer: staging copies the step in one transfer

    def _decoded(self, stored: StepTensors, key: TemplateCacheKey) -> Mapping[str, torch.Tensor]:
        """Stored tensors as the model reads them (decoded lazily, shared rows expanded; as they
        are when lossless and no row is shared)."""
        return cache_codec.decoded(stored, self.dtype, self.device, self.rows_of(key))

    def wait(self, key: TemplateCacheKey, step: int, timeout: float) -> StepTensors | None:
        """Blocking variant for tools and tests (not used inside the loop)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.ready(key, step)
            if value is not None:
                return value
            time.sleep(0.005)
        return None

    def close(self, wait: bool = False) -> None:
        """Stop fetching (queued fetches are dropped; ``wait``: join the running ones)."""
        with self._cond:
            self._closed = True
            for slot in self._queued:
                self._inflight.discard(slot)
            self._queued.clear()
            self._heap.clear()
            self._cond.notify_all()
        self._demand.put(None)
        if wait:
            for w in self._workers:
                w.join()
            if self._loader is not None:
                self._loader.join()


def _to_host(tensors: StepTensors) -> tuple[StepTensors, Any]:
    """Private host copies of a recorded step, and the CUDA event after which they hold their
    values (None: copied already). From a GPU the copies go into pinned memory asynchronously,
    so the engine thread never waits for them; the writer thread does."""
    on_gpu = [t for t in tensors.values() if t.device.type == "cuda"]
    if not on_gpu:
        return {k: v.detach().to("cpu").clone() for k, v in tensors.items()}, None
    owned = {}
    for k, v in tensors.items():
        dst = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        owned[k] = dst.copy_(v.detach(), non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(on_gpu[0].device))
    return owned, event


class UnitCache(Mapping[str, torch.Tensor]):
    """One job's step cache as the mask-aware model sees it while it is loaded block by block.

    ``acquire_unit`` (asked once per unit by ``MaskAwareUNet``) answers at once for resident units,
    waits until ``deadline`` (one for the step, or one per unit) for units the plan chose to load,
    and says False (compute fully) for the rest: a unit whose data is not resident is never waited
    for unless the plan wants it.
    """

    def __init__(self, provider: StepCacheProvider, key: TemplateCacheKey, step: int,
                 names: Sequence[str], wait_units: Iterable[str], deadline: float | Mapping[str, float]) -> None:
        self.provider = provider
        self.key = key
        self.step = step
        self._names = set(names)
        self.wait_units = set(wait_units)
        self.deadline = deadline
        self._tensors: StepTensors = {}
        self.used: list[str] = []
        self.missed: list[str] = []
        self.waited_s = 0.0

    def acquire_unit(self, unit: str) -> bool:
        t0 = time.monotonic()
        if unit not in self.wait_units:
            deadline = -math.inf
        elif isinstance(self.deadline, Mapping):
            deadline = self.deadline.get(unit, -math.inf)
        else:
            deadline = self.deadline
        got = self.provider.acquire(self.key, self.step, unit, deadline)
        self.waited_s += time.monotonic() - t0
        if got is None:
            if unit in self.wait_units:
                self.missed.append(unit)
            return False
        self._tensors.update(got)
        self.used.append(unit)
        return True

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class CacheRecorder:
    """Ordered background writer of warm-up activations, encoded with the storage codec.

    ``codec`` (``STENCIL_CACHE_DTYPE``, ``workers/engine/cache_codec.py``) applies to template
    warm-ups; exact-region warm-ups (key layout ``.../exact-<region>``: recorded for one edit, which
    must then equal the stock pipeline) are always stored losslessly, in the dtype they were
    recorded in (``cache_codec.lossless_codec``), whatever the codec, so the exact path stays
    bit-exact. ``units`` (per key, set by the runner): store only
    these plan units' tensors (the rest is computed fully by edits); recorded in the manifest.
    ``share_rows`` (on by default: lossless): a tensor whose rows are bit-equal after encoding is
    stored with one row (``cache_codec.share_rows``); the manifest records the row count
    (``rows``) and the names stored so in every step (``shared_rows``). A key whose layout
    names a step count (``/steps-<n>``, ``TemplateCacheKey.stored_step_count``) stores only those
    steps (``stored_steps``; manifest ``stored_steps``)."""

    def __init__(self, activations: ActivationStore, codec: str = "float32", share_rows: bool = True) -> None:
        self.activations = activations
        self.codec = cache_codec.check_codec(codec)
        self.share_rows = share_rows
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stencil-record")
        self._units: dict[str, list[str]] = {}
        self._rows: dict[str, int] = {}  # digest -> the recording's row count (validated per step)
        self._shared: dict[str, set[str]] = {}  # digest -> names shared in every step so far (writer thread)

    def codec_for(self, key: TemplateCacheKey) -> str:
        """The codec a cache under ``key`` is stored with. Exact-region caches: lossless, i.e. the
        dtype they were recorded in (``kv+y@bfloat16`` -> bfloat16; no suffix: float32)."""
        if key.exact_region:
            return cache_codec.lossless_codec(key.layout)
        return self.codec

    def set_units(self, key: TemplateCacheKey, units: Sequence[str]) -> None:
        """Record that this warm-up stores only ``units`` (goes into the manifest at commit)."""
        self._units[key.digest()] = list(units)

    def put(self, key: TemplateCacheKey, step: int, tensors: StepTensors) -> Future:
        keep = key_stored_steps(key)
        if keep is not None and step not in keep:  # served by its segment's stored step
            skipped: Future = Future()
            skipped.set_result(0)
            return skipped
        owned, copied = _to_host(tensors)
        codec = self.codec_for(key)
        rows = self._recorded_rows(key, owned) if self.share_rows else 0
        return self._pool.submit(self._put, key, step, owned, codec, rows, copied)

    def _recorded_rows(self, key: TemplateCacheKey, tensors: StepTensors) -> int:
        """The recording's row count: every tensor's leading axis, the same in every step (a
        one-row tensor of a cache of more rows reads as shared); 0 if the step's tensors disagree
        (then nothing is shared). Raises if a recording's row count changes between steps."""
        leads = {int(t.shape[0]) if t.dim() else 0 for t in tensors.values()}
        rows = leads.pop() if len(leads) == 1 else 0
        known = self._rows.setdefault(key.digest(), rows)
        if known != rows and max(known, rows) > 1:
            raise ValueError(f"cache {key.digest()}: tensors of {rows or 'mixed'} rows after {known}-row "
                             "steps (shared rows need one row count per cache)")
        return rows

    def _put(self, key: TemplateCacheKey, step: int, tensors: StepTensors, codec: str, rows: int,
             copied: Any = None) -> int:
        if copied is not None:  # the device-to-host copies were queued by the engine: wait here, not there
            copied.synchronize()
        stored = cache_codec.encode(tensors, codec)
        if rows > 1:
            stored, shared = cache_codec.share_rows(stored, rows)
            prev = self._shared.get(key.digest())
            self._shared[key.digest()] = set(shared) if prev is None else prev & set(shared)
        return self.activations.put_step(key, step, stored, codec=codec, rows=rows)

    def commit(self, key: TemplateCacheKey) -> Future:
        """Runs after every ``put`` submitted before it (single ordered worker)."""
        extra: dict[str, object] = {"codec": self.codec_for(key)}
        keep = key_stored_steps(key)
        if keep is not None:
            extra["stored_steps"] = list(keep)
        units = self._units.pop(key.digest(), None)
        if units is not None:
            extra["units"] = units
        rows = self._rows.pop(key.digest(), 0)
        return self._pool.submit(self._commit, key, extra, rows)

    def _commit(self, key: TemplateCacheKey, extra: dict[str, object], rows: int) -> dict[str, object]:
        """On the writer thread, after the steps' puts: their shared names are known now."""
        shared = self._shared.pop(key.digest(), set())
        if rows > 1:
            extra = {**extra, "rows": rows, "shared_rows": sorted(shared)}
        return self.activations.commit(key, extra)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
