"""The dispatcher: reads the intake stream and routes each job as a Celery chain.

At-least-once: entries are read with XREADGROUP and acknowledged only after the chain was sent
and the job marked routed; on restart the consumer first re-reads its own pending entries, and
XAUTOCLAIM takes over entries that another (dead) dispatcher left idle. Entries delivered too
many times are dead-lettered (the job fails with a reason). A resent chain is harmless: every
task is idempotent against the job record.

Routing sees the workers through a ``LiveWorkerView``: what every engine last published to
``stencil:worker:<id>`` (read in one pipeline, at most every ``VIEW_REFRESH_S``) plus
the jobs this dispatcher routed that the engines cannot show yet (still in ``prepare``). Those
in-flight entries leave when the job appears in a worker's state, ends, or gets too old. A worker
is live while its state is fresher than ``STENCIL_WORKER_STALE_SECONDS``; one that never published
(its host not started yet) is not, so a listed GPU host that is down gets no jobs (all workers are
candidates only while none is live: at a cold start).

SLO at routing: with a fitted cost model, a job whose deadline cannot be met even if it started
now alone on an idle worker is marked ``expired`` with the reason instead of being routed. The
fit is scaled by the pace the engines measure (the fastest live worker's published
``step_time_factor``, ``app/calibration.py``), so the dispatcher and the engines' SLO admission
predict the same step times. A job
without a deadline gets a default one, ``STENCIL_SLO_FACTOR`` x its standalone time (that same
prediction, at the job's own image size with the resolution-aware batch predictor, plus
``Dispatcher.slo_overhead_s`` for prepare and finalize), recorded as ``slo_deadline``; every job with one has
``slo_met`` on its record when it ends (``app/jobs.py``), so SLO satisfaction is a number every
deployment reports.
"""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import redis
from celery import Celery, chain

from app.adapters import lora_meta_key
from app.blobs import BlobStore
from app.calibration import BOUNDS as CALIBRATION_BOUNDS
from app.celery_app import gpu_queue, stage_queue
from app.controls import controlnet_meta_key
from app.costmodel import (
    BlockSpec,
    CostModel,
    UNetArch,
    find_model,
    min_service_seconds,
    shipped_model,
    token_counts_from_mask,
)
from app.fidelity import policy_schedule
from app.jobs import INTAKE_GROUP, INTAKE_STREAM, JobRecord, JobStatus, JobStore
from app.routing import JobDemand, JobLoad, RoutingPolicy, WorkerState, WorkerView, make_router
from app.settings import Settings
from app.storage import open_store
from app.sweeper import Sweeper

log = logging.getLogger(__name__)

HEARTBEAT_KEY = "stencil:dispatcher:heartbeat"
DEAD_LETTER_STREAM = "stencil:jobs:dead"
WORKER_STATE_PREFIX = "stencil:worker:"
# The live worker view: refreshed at most this often (a routing decision in between reuses it plus the
# dispatcher's own assignments); a job routed but not yet seen in its worker's state counts against
# that worker this long (a worker silent for ``Settings.worker_stale_seconds`` is presumed gone).
VIEW_REFRESH_S = 0.05
INFLIGHT_TTL_S = 600.0
# Re-sends of a stalled job's chain before it fails with the reason (app/sweeper.py).
MAX_REDRIVES = 3
# Intake entries pending this long in another consumer are claimed; one delivered more often than
# MAX_DELIVERIES goes to the dead-letter stream.
CLAIM_IDLE_MS = 60_000
MAX_DELIVERIES = 5
# A job whose mask cannot be decoded for routing counts as wholly masked.
DEFAULT_MASK_RATIO = 1.0
_LIVE_STATUSES = {JobStatus.QUEUED.value, JobStatus.ROUTED.value, JobStatus.PREPARING.value,
                  JobStatus.WAITING.value, JobStatus.DENOISING.value}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def num_denoise_steps(steps: int, strength: float) -> int:
    """Steps the engine runs (diffusers' img2img/inpaint ``get_timesteps``)."""
    return max(1, min(int(steps * strength), steps))


def parse_worker_hash(worker_id: str, fields: dict[Any, Any], *, now: float, stale_s: float,
                      max_batch: int, known: dict[str, JobDemand]) -> WorkerState:
    """A worker's published state (``RedisEngineHooks._state``) as a ``WorkerState``.

    Tolerates older engines: fields they do not publish (max_batch, templates, per-job cached,
    template_id, masked_tokens, late) fall back to defaults or to what the dispatcher knew at routing.
    """
    f = {_s(k): _s(v) for k, v in fields.items()}

    def jobs(raw: str) -> list[JobLoad]:
        out = []
        for e in json.loads(raw or "[]"):
            rem = int(e.get("remaining", 0))
            if rem <= 0:
                continue
            d = known.get(e["job_id"])
            tokens = e.get("masked_tokens")
            grid = e.get("latent_hw")
            out.append(JobLoad(
                job_id=e["job_id"], remaining=rem, mask_ratio=float(e.get("mask_ratio", d.mask_ratio if d else 1.0)),
                masked_tokens=tuple(tokens) if tokens else (d.masked_tokens if d else None),
                cached=bool(e["cached"]) if "cached" in e else (d.cached if d else True),
                template_id=e.get("template_id") or (d.template_id if d else ""),
                refresh_share=d.refresh_share if d else 0.0, addons=d.addons if d else (),
                latent_hw=(int(grid[0]), int(grid[1])) if grid else (d.latent_hw if d else None),
                late=bool(e.get("late", False))))
        return out

    updated = float(f.get("updated") or 0.0)
    return WorkerState(
        worker_id=worker_id, running=jobs(f.get("running", "[]")), waiting=jobs(f.get("waiting", "[]")),
        templates=frozenset(json.loads(f["templates"])) if f.get("templates") else None,
        addons=_published_addons(f),
        last_step_seconds=float(f.get("last_step_seconds") or 0.0), updated=updated,
        max_batch=int(f.get("max_batch") or max_batch),
        alive=bool(updated) and now - updated <= stale_s,  # never published: not (yet) joined
        step_time_factor=_step_time_factor(f.get("step_time_factor")))


def _step_time_factor(raw: str | None) -> float:
    """A published calibration factor, bounded as the engine bounds it; 1.0 if absent or unreadable
    (older engines, SLO admission off): the fit is then taken as is."""
    try:
        factor = float(raw) if raw else 1.0
    except ValueError:
        return 1.0
    return min(max(factor, CALIBRATION_BOUNDS[0]), CALIBRATION_BOUNDS[1]) if math.isfinite(factor) else 1.0


def _published_addons(f: dict[str, str]) -> frozenset[str] | None:
    """The add-ons a worker says it holds (``lora:<id>``, ``controlnet:<id>``); None if it says nothing."""
    if "loras" not in f and "controlnets" not in f:
        return None
    return frozenset(f"{kind}:{i}" for kind, field in (("lora", "loras"), ("controlnet", "controlnets"))
                     for i in json.loads(f.get(field) or "[]"))


class LiveWorkerView:
    """Worker states from Redis + this dispatcher's in-flight assignments (module docstring)."""

    def __init__(self, client: redis.Redis, worker_ids: list[str], *, max_batch: int,
                 refresh_s: float = 0.05, stale_s: float = 120.0, inflight_ttl_s: float = 600.0,
                 status_check_s: float = 2.0, jobs: JobStore | None = None) -> None:
        self.r = client
        self.worker_ids = list(worker_ids)
        self.max_batch = max_batch
        self.refresh_s = refresh_s
        self.stale_s = stale_s
        self.inflight_ttl_s = inflight_ttl_s
        self.status_check_s = status_check_s
        self.jobs = jobs
        self.inflight: dict[str, OrderedDict[str, tuple[JobDemand, float]]] = {w: OrderedDict() for w in worker_ids}
        self.known: OrderedDict[str, JobDemand] = OrderedDict()  # recently routed (enriches worker views)
        self._view: WorkerView | None = None
        self._fetched = 0.0
        self._checked = time.monotonic()

    def refresh(self, force: bool = False) -> WorkerView:
        mono = time.monotonic()
        if self._view is not None and not force and mono - self._fetched < self.refresh_s:
            return self._view
        pipe = self.r.pipeline(transaction=False)
        for w in self.worker_ids:
            pipe.hgetall(WORKER_STATE_PREFIX + w)
        raw = pipe.execute()
        now = time.time()
        states = [parse_worker_hash(w, fields or {}, now=now, stale_s=self.stale_s, max_batch=self.max_batch,
                                    known=self.known) for w, fields in zip(self.worker_ids, raw)]
        visible = {j.job_id for st in states for j in st.running + st.waiting}
        if mono - self._checked > self.status_check_s:
            self._checked = mono
            self._drop_finished()
        for st in states:
            pending = self.inflight[st.worker_id]
            for job_id in [j for j, (_, at) in pending.items() if j in visible or mono - at > self.inflight_ttl_s]:
                del pending[job_id]
            st.inflight = [_inflight_load(d) for d, _ in pending.values()]
        self._view = WorkerView(states)
        self._fetched = mono
        return self._view

    def _drop_finished(self) -> None:
        """In-flight jobs that ended (or reached finalize) without ever being seen at a worker."""
        if self.jobs is None:
            return
        ids = [j for pending in self.inflight.values() for j in pending]
        if not ids:
            return
        statuses = self.jobs.statuses(ids)
        for pending in self.inflight.values():
            for job_id in [j for j in pending if statuses.get(j) is None or statuses[j].value not in _LIVE_STATUSES]:
                del pending[job_id]

    def assign(self, worker_id: str, demand: JobDemand) -> None:
        self.inflight[worker_id][demand.job_id] = (demand, time.monotonic())
        self.known[demand.job_id] = demand
        while len(self.known) > 100_000:
            self.known.popitem(last=False)
        if self._view is not None:
            self._view.assign(worker_id, demand)


def _inflight_load(d: JobDemand) -> JobLoad:
    return JobLoad.from_demand(d)


class DecisionStats:
    """Latency of routing decisions (policy ``choose`` only), for logs and benchmarks."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self.samples: deque[float] = deque(maxlen=maxlen)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    def quantile(self, q: float) -> float:
        if not self.samples:
            return 0.0
        xs = sorted(self.samples)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def load_cost_model(settings: Settings) -> CostModel | None:
    """``STENCIL_COST_MODEL`` (a file), else the newest fitted model for this model id under
    ``<home>/costmodels``; None when there is none (mask-aware routing then uses a FLOPs proxy)."""
    try:
        return find_model(settings.home, settings.model_id, settings.cost_model)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cost model unusable (%s); routing without one", exc)
        return None


def model_blocks(settings: Settings) -> tuple[BlockSpec, ...] | None:
    """The configured model's transformer blocks (from its UNet config; no torch), None without one."""
    folders = [Path(settings.model_dir)] if settings.model_dir else [
        Path(__file__).resolve().parents[1] / "workers" / "models" / "trained" / settings.model_id,
        settings.home / "models" / settings.model_id]
    for folder in folders:
        cfg = folder / "unet" / "config.json"
        if cfg.is_file():
            try:
                return UNetArch.from_unet_config(json.loads(cfg.read_text()), (64, 64)).blocks
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("UNet config %s unreadable for cost-model matching: %s", cfg, exc)
                return None
    return None


def routing_model(settings: Settings, fitted: CostModel | None) -> tuple[str, CostModel | None]:
    """The routing policy to run and its cost model. ``mask_aware`` (the default) uses the fitted
    model (``STENCIL_COST_MODEL`` or ``<home>/costmodels``), else the one shipped for the configured
    model on this device type (ops/sim/costmodels); with neither it falls back to
    ``least_requests`` (mask-blind but load-aware) and says so."""
    policy = settings.routing_policy
    if policy != "mask_aware" or fitted is not None:
        return policy, fitted
    model_id = Path(settings.model_dir).name if settings.model_dir else settings.model_id
    found = shipped_model(model_id, settings.device, model_blocks(settings))
    if found is not None:
        log.info("mask_aware routing with the shipped cost model %s (%s on %s)", found[1].name, model_id,
                 found[0].device_kind)
        return policy, found[0]
    log.warning("mask_aware routing: no fitted or shipped cost model fits model %s on %s; routing with "
                "least_requests instead (fit one: python -m ops.bench.profile)", model_id, settings.device)
    return "least_requests", None


class Dispatcher:
    def __init__(self, settings: Settings, celery: Celery, *, router: RoutingPolicy | None = None,
                 consumer: str | None = None, cost_model: CostModel | None = None,
                 view_refresh_s: float = VIEW_REFRESH_S, claim_idle_ms: int = CLAIM_IDLE_MS) -> None:
        self.s = settings
        self.celery = celery
        self.r = redis.Redis.from_url(settings.redis_url)
        self.jobs = JobStore(self.r, ttl_seconds=settings.job_ttl_seconds)
        self.blobs = BlobStore(self.r, settings.blob_ttl_seconds)
        self.cost_model = cost_model if cost_model is not None else load_cost_model(settings)
        # The shipped model (if any) steers routing only; deadlines and expiry need a fitted one.
        policy, model = (settings.routing_policy, self.cost_model) if router else \
            routing_model(settings, self.cost_model)
        self.router = router or make_router(policy, settings.gpu_worker_ids, model)
        self.view = LiveWorkerView(
            self.r, settings.gpu_worker_ids, max_batch=settings.max_batch, jobs=self.jobs,
            refresh_s=view_refresh_s, stale_s=settings.worker_stale_seconds, inflight_ttl_s=INFLIGHT_TTL_S)
        self.decisions = DecisionStats()
        self._addon_sizes: dict[str, int] = {}
        self._object_store: Any = None
        self.slo_overhead_s = 0.0  # prepare + finalize, if known
        # A stable name (per host) lets a restarted dispatcher re-read its own pending entries.
        self.consumer = consumer or socket.gethostname()
        self.stream = INTAKE_STREAM
        self.group = INTAKE_GROUP
        self.claim_idle_ms = claim_idle_ms
        stage_queue("0", settings.stage_placement)  # an unknown placement stops the dispatcher here
        self.sweeper = Sweeper(self.r, self.jobs, self.send_chain, worker_ids=settings.gpu_worker_ids,
                               stage_placement=settings.stage_placement,
                               stall_timeout_s=settings.stall_timeout_s, max_redrives=MAX_REDRIVES,
                               worker_stale_s=settings.worker_stale_seconds)

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- what the router knows about a job ----------------------------------------------------
    def _mask(self, rec: JobRecord) -> Any:
        """The uploaded mask as a bool array, or None (never fails routing)."""
        data = self.blobs.get(rec.id, "mask")
        if not data:
            return None
        try:
            import numpy as np
            from PIL import Image

            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > self.s.max_image_pixels:
                    return None
                return np.asarray(img.convert("L")) > 127
        except Exception as exc:  # prepare reports bad masks properly; routing just guesses
            log.debug("job %s: mask not decodable for routing: %s", rec.id, exc)
            return None

    def demand(self, rec: JobRecord) -> JobDemand:
        p = rec.params
        ratio_field = rec.fields.get("mask_ratio")
        ratio = float(ratio_field) if ratio_field else None
        tokens: tuple[int, ...] | None = None
        size_tokens: tuple[int, ...] | None = None
        grid: tuple[int, int] | None = None
        model = self.cost_model
        if ratio is None or model is not None:
            mask = self._mask(rec)
            if mask is not None:
                ratio = float(mask.mean()) if ratio is None else ratio
                if model is not None:
                    h, w = mask.shape
                    if p.width and p.height:
                        w, h = p.width, p.height
                    scale = min(1.0, self.s.max_side / max(w, h))
                    vae = model.arch.vae_factor
                    lat = (max(1, int(h * scale) // vae), max(1, int(w * scale) // vae))
                    tokens = token_counts_from_mask(mask, lat, model.arch.num_levels) \
                        if lat == model.arch.latent_hw else None
                    grid = lat  # the job's size as routing's size affinity compares it
                    if model.batch is not None:  # the job's own grid (as prepare sizes it) and tokens there
                        cell = model.batch.vae_factor
                        grid = (max(1, int(h * scale) // cell), max(1, int(w * scale) // cell))
                        size_tokens = token_counts_from_mask(mask, grid, model.batch.spec.levels)
        if ratio is None:
            ratio = DEFAULT_MASK_RATIO
        cached = bool(p.template_id) and p.kind == "edit" and 0.0 < ratio < 1.0
        steps = num_denoise_steps(p.steps, p.strength)
        refresh = len(policy_schedule(p.fidelity or self.s.fidelity, steps)) / steps if cached else 0.0
        addons = tuple(f"lora:{i}" for i, _ in p.loras) + tuple(dict.fromkeys(f"controlnet:{c[0]}" for c in p.controls))
        return JobDemand(job_id=rec.id, steps=steps, mask_ratio=ratio, masked_tokens=tokens, cached=cached,
                         template_id=p.template_id, priority=p.priority, deadline=p.deadline, refresh_share=refresh,
                         addons=addons, addon_bytes=tuple(self._addon_bytes(a) for a in addons),
                         latent_hw=grid, size_tokens=size_tokens)

    def _addon_bytes(self, addon: str) -> int:
        """An add-on's size from its description in the object store (cached; 0 if unknown)."""
        size = self._addon_sizes.get(addon)
        if size is None:
            kind, _, name = addon.partition(":")
            key = lora_meta_key(name) if kind == "lora" else controlnet_meta_key(name)
            try:
                size = int(json.loads(self._store().get(key)).get("nbytes", 0))
            except Exception:  # unknown add-on: prepare fails the job with the reason
                return 0
            self._addon_sizes[addon] = size
        return size

    def _store(self):  # type: ignore[no-untyped-def]
        if self._object_store is None:
            self._object_store = open_store(self.s)
        return self._object_store

    def min_latency(self, demand: JobDemand, step_time_factor: float = 1.0) -> float | None:
        """Fastest possible time of a job (denoising alone on an idle worker, at its own size when the
        model has the resolution-aware predictor, x the fastest live worker's measured pace
        ``step_time_factor``, plus the configured prepare/finalize overhead), or None without a
        fitted model."""
        if self.cost_model is None:
            return None
        sized = demand.latent_hw is not None and self.cost_model.batch is not None
        return min_service_seconds(self.cost_model, demand.steps, mask_ratio=demand.mask_ratio,
                                   masked_tokens=demand.size_tokens if sized else demand.masked_tokens,
                                   cached=demand.cached, latent_hw=demand.latent_hw if sized else None
                                   ) * step_time_factor + self.slo_overhead_s

    def slo_deadline(self, rec: JobRecord, need: float | None) -> float | None:
        """The job's SLO deadline: its own, else (edits) submission + ``STENCIL_SLO_FACTOR`` x ``need``
        (its standalone time); None without either (no fitted model, the factor is 0, a warm-up)."""
        if rec.params.deadline is not None:
            return rec.params.deadline
        if need is None or self.s.slo_factor <= 0 or rec.params.kind != "edit":  # warm-ups: the service's own work
            return None
        return (rec.ts("queued") or time.time()) + self.s.slo_factor * need

    # -- routing --------------------------------------------------------------------------------
    def route(self, job_id: str) -> str:
        """Route one job; returns what happened (for logs and tests)."""
        rec = self.jobs.get(job_id)
        if rec is None:
            return "missing"
        if rec.status != JobStatus.QUEUED:
            return f"skipped ({rec.status.value})"
        reason = rec.params.validate(self.s.max_steps)
        if reason:
            self.jobs.fail(job_id, reason)
            return "invalid"
        now = time.time()
        if rec.params.deadline is not None and rec.params.deadline < now:
            self.jobs.transition(job_id, JobStatus.EXPIRED, error="deadline passed before routing",
                                 slo_deadline=repr(rec.params.deadline))
            return "expired"
        demand = self.demand(rec)
        view = self.view.refresh()
        # The engines' online calibration: the fit x how fast the fastest live worker runs now, so
        # expiry and default deadlines use the same step times as the engines' SLO admission.
        need = self.min_latency(demand, min(w.step_time_factor for w in view.candidates()))
        if demand.deadline is not None and need is not None and now + need > demand.deadline:
            self.jobs.transition(job_id, JobStatus.EXPIRED, slo_deadline=repr(demand.deadline),
                                 error=f"deadline unreachable: needs at least {need:.3f} s, "
                                       f"{demand.deadline - now:.3f} s left")
            return "expired"
        slo = self.slo_deadline(rec, need)
        slo_fields = {} if slo is None else {"slo_deadline": repr(slo),
                                             **({"slo_alone_s": f"{need:.4f}"} if need is not None else {})}
        start = time.perf_counter()
        worker = self.router.choose(demand, view)
        self.decisions.add(time.perf_counter() - start)
        if rec.params.loras:  # fetch them while the job is prepared (deduplicated on the worker)
            loras = [[i, s] for i, s in rec.params.loras]
            self.celery.send_task("stencil.prefetch_loras", args=(loras,), queue=gpu_queue(worker))
        if rec.params.controls:
            ids = list(dict.fromkeys(c[0] for c in rec.params.controls))
            self.celery.send_task("stencil.prefetch_controlnets", args=(ids,), queue=gpu_queue(worker))
        if slo_fields:  # before the chain: the GPU worker reads it, whatever prepare's pace
            self.jobs.update(job_id, **slo_fields)
        self.send_chain(job_id, worker)
        if self.jobs.transition(job_id, JobStatus.ROUTED, expect=(JobStatus.QUEUED,), worker=gpu_queue(worker)):
            self.view.assign(worker, demand)
        return f"routed to {gpu_queue(worker)}"

    def send_chain(self, job_id: str, worker: str) -> None:
        """prepare [stage] -> denoise [gpu.<worker>] -> finalize [stage], the stage queue being ``cpu``
        or the worker's host's ``stage.<worker>`` (``STENCIL_STAGE_PLACEMENT``). Signatures by task
        name on this dispatcher's app: no worker code (or torch) is imported."""
        stages = stage_queue(worker, self.s.stage_placement)
        chain(
            self.celery.signature("stencil.prepare", args=(job_id,), immutable=True, queue=stages),
            self.celery.signature("stencil.denoise", queue=gpu_queue(worker)),
            self.celery.signature("stencil.finalize", queue=stages),
        ).apply_async()

    def _handle(self, entries: list) -> None:
        for entry_id, fields in entries:
            job_id = (fields.get(b"job_id") or b"").decode()
            try:
                outcome = self.route(job_id) if job_id else "malformed entry"
                log.info("job %s: %s", job_id, outcome)
            except Exception:
                log.exception("routing job %s failed; it stays pending for a retry", job_id)
                continue
            self.r.xack(self.stream, self.group, entry_id)

    def _reclaim(self) -> None:
        """Take over entries idle too long (dead consumer); dead-letter over-delivered ones."""
        _, claimed, _ = self.r.xautoclaim(self.stream, self.group, self.consumer,
                                          min_idle_time=self.claim_idle_ms, start_id="0-0", count=100)
        if not claimed:
            return
        pending = {p["message_id"]: p["times_delivered"] for p in
                   self.r.xpending_range(self.stream, self.group, min="-", max="+", count=1000,
                                         consumername=self.consumer)}
        retry = []
        for entry_id, fields in claimed:
            if pending.get(entry_id, 0) > MAX_DELIVERIES:
                job_id = (fields.get(b"job_id") or b"").decode()
                self.jobs.fail(job_id, "dispatch failed repeatedly (dead-lettered)")
                self.r.xadd(DEAD_LETTER_STREAM, {"job_id": job_id, "entry": entry_id})
                self.r.xack(self.stream, self.group, entry_id)
            else:
                retry.append((entry_id, fields))
        self._handle(retry)

    def run(self, stop: threading.Event | None = None, block_ms: int = 1000) -> None:
        """Route until ``stop``; survives Redis outages (reconnects with capped exponential backoff)."""
        stop = stop or threading.Event()
        log.info("dispatcher %s routing %s with policy %s (cost model: %s)", self.consumer, self.s.gpu_worker_ids,
                 getattr(self.router, "name", type(self.router).__name__),
                 f"{self.cost_model.model_id}/{self.cost_model.device_kind}" if self.cost_model else "none")
        backoff = 0.0
        while not stop.is_set():
            try:
                self._serve(stop, block_ms)
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
                backoff = min(5.0, max(0.1, backoff * 2))
                log.warning("redis unavailable (%s); retrying in %.1f s", type(exc).__name__, backoff)
                stop.wait(backoff)
                continue
            backoff = 0.0

    def _serve(self, stop: threading.Event, block_ms: int) -> None:
        self.ensure_group()
        # Entries this consumer read but never acknowledged before a restart (or an outage).
        for _stream, entries in self.r.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=1000) or []:
            self._handle(entries)
        last_claim = last_sweep = -float("inf")
        last_stats = time.monotonic()
        while not stop.is_set():
            self.r.set(HEARTBEAT_KEY, repr(time.time()), ex=30)
            if time.monotonic() - last_claim > 5.0:
                last_claim = time.monotonic()
                self._reclaim()
            if time.monotonic() - last_sweep > self.s.sweep_interval_s:
                last_sweep = time.monotonic()
                counts = self.sweeper.sweep(self.consumer)
                if counts["redriven"] or counts["failed"]:
                    log.info("sweep: %s", counts)
            if time.monotonic() - last_stats > 60.0 and self.decisions.samples:
                last_stats = time.monotonic()
                log.info("routing decisions: p50 %.3f ms, p99 %.3f ms over %d", self.decisions.quantile(0.5) * 1e3,
                         self.decisions.quantile(0.99) * 1e3, len(self.decisions.samples))
            resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=64, block=block_ms)
            for _stream, entries in resp or []:
                self._handle(entries)
