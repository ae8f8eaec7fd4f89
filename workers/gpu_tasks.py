"""GPU worker: the ``denoise`` Celery task and the one engine thread it feeds.

The worker runs Celery with ``-P threads`` (CUDA does not survive fork) and enough threads for a
full batch plus a queue: each ``denoise`` task hands its job to the engine and blocks on the job's
future, so in-flight jobs, retries and queue lengths show in Flower. A per-job lease in Redis,
renewed by the engine every step, keeps a redelivered copy of a task from running a job that a
live worker is still denoising; after a worker dies the lease expires and the copy takes over.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore
from celery.signals import worker_ready, worker_shutdown

from app import metrics
from app.celery_app import app
from app.jobs import JobStatus
from app.keys import LEASE_PREFIX
from workers import context as ctx
from workers.engine.engine import Engine, EngineHooks
from workers.engine.job import EngineJob, JobCancelled
from workers.tensors import pack, unpack

log = logging.getLogger(__name__)

# The engine's fixed choices (measured, not settings; the benchmarks that varied them take them as
# options). Concurrent background fetches of template caches per GPU worker: S3 reads are
# latency-bound, so several requests in flight (boto3's pool allows 10) keep prefetch ahead of the queue.
PREFETCH_THREADS = 4
# STENCIL_HOST_CACHE_BYTES=0: this share of physical memory per GPU worker of the host, minus the weights.
HOST_CACHE_FRACTION = 0.5
# How long an idle engine sleeps before it looks for work again.
ENGINE_IDLE_SLEEP_S = 0.005

WORKER_STATE_PREFIX = "stencil:worker:"

_engine: Engine | None = None
_engine_lock = threading.Lock()


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    """A Redis lease on denoising one job (SET NX PX, renewed by the engine)."""

    def __init__(self, job_id: str, ttl_seconds: float) -> None:
        self.key = LEASE_PREFIX + job_id
        self.ttl_ms = int(ttl_seconds * 1000)
        self.holder = holder_id()

    def acquire(self) -> bool:
        return bool(ctx.redis_client().set(self.key, self.holder, nx=True, px=self.ttl_ms))

    def release(self) -> None:
        r = ctx.redis_client()
        if (r.get(self.key) or b"").decode() == self.holder:
            r.delete(self.key)


class RedisEngineHooks(EngineHooks):
    """Publishes progress, renews leases, reads cancellations, publishes worker state.

    Only the cancellation check (one read per step) runs on the engine thread. Writes are handed
    to a publisher thread that merges what accumulated since its last round trip, so Redis I/O
    never lengthens a denoising step.
    """

    def __init__(self, worker_id: str, lease_seconds: float, *, max_batch: int = 8,
                 resident_templates: Any = None, resident_adapters: Any = None,
                 resident_controlnets: Any = None, step_time: Any = None,
                 step_graph: Callable[[], str] = lambda: "off") -> None:
        self.worker_id = worker_id
        self.step_graph = step_graph  # how the engine's last step ran (CUDA graph replay or not)
        self.step_time = step_time  # SLO admission's predictor; its calibration factor is published
        self.max_batch = max_batch
        self.resident_templates = resident_templates
        self.resident_adapters = resident_adapters
        self.resident_controlnets = resident_controlnets
        self.lease_ms = int(lease_seconds * 1000)
        self.last_step_seconds = 0.0
        self.busy_seconds = 0.0
        self.steps = 0
        self._last_idle_publish = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._admits: list[str] = []
        self._progress: dict[str, tuple[int, int]] = {}
        self._leases: set[str] = set()
        self._state_update: dict[str, str] | None = None
        threading.Thread(target=self._publish_loop, name="stencil-publisher", daemon=True).start()

    def cancelled(self, job_ids: list[str]) -> set[str]:
        statuses = ctx.jobs().statuses(job_ids)
        return {j for j, s in statuses.items() if s is None or s.terminal}

    def on_admit(self, jobs: list[EngineJob]) -> None:
        with self._lock:
            self._admits += [job.job_id for job in jobs]
        self._wake.set()

    def on_step(self, batch: list[EngineJob], step_seconds: float, waiting: list[EngineJob]) -> None:
        self.last_step_seconds = step_seconds
        self.busy_seconds += step_seconds
        metrics.observe_step(len(batch), sum((j.masked_tokens or (0,))[0] for j in batch), step_seconds,
                             self.step_graph())
        self.steps += 1
        state = self._state(batch, waiting)
        with self._lock:
            self._progress.update({job.job_id: (job.steps_done, job.total_steps) for job in batch})
            self._leases.update(job.job_id for job in batch + waiting)
            self._state_update = state
        self._wake.set()

    def on_idle(self, waiting: list[EngineJob]) -> None:
        now = time.monotonic()
        if now - self._last_idle_publish > 1.0:
            self._last_idle_publish = now
            with self._lock:
                self._state_update = self._state([], waiting)
            self._wake.set()

    def _publish_loop(self) -> None:
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            with self._lock:
                admits, self._admits = self._admits, []
                progress, self._progress = self._progress, {}
                leases, self._leases = self._leases, set()
                state, self._state_update = self._state_update, None
            try:
                self._publish(admits, progress, leases, state)
            except Exception:  # Redis hiccup: the next round publishes newer values
                log.exception("publishing engine state failed")

    def _publish(self, admits: list[str], progress: dict[str, tuple[int, int]], leases: set[str],
                 state: dict[str, str] | None) -> None:
        for job_id in admits:
            ctx.jobs().transition(job_id, JobStatus.DENOISING,
                                  expect=(JobStatus.WAITING, JobStatus.ROUTED, JobStatus.PREPARING),
                                  worker=f"gpu.{self.worker_id}")
        if not (progress or leases or state):
            return
        pipe = ctx.redis_client().pipeline(transaction=False)
        for job_id, (step, total) in progress.items():
            pipe.hset(ctx.jobs().key(job_id), mapping={"progress_step": step, "progress_total": total})
        for job_id in leases:
            pipe.pexpire(LEASE_PREFIX + job_id, self.lease_ms)
        if state is not None:
            pipe.hset(WORKER_STATE_PREFIX + self.worker_id, mapping=state)
        pipe.execute()

    def _state(self, batch: list[EngineJob], waiting: list[EngineJob]) -> dict[str, str]:
        def view(jobs: list[EngineJob]) -> str:
            return json.dumps([{"job_id": j.job_id, "mask_ratio": j.mask_ratio,
                                "remaining": j.total_steps - j.steps_done, "cached": j.cached,
                                "template_id": j.template_id, "priority": j.priority, "deadline": j.deadline,
                                "masked_tokens": list(j.masked_tokens) if j.masked_tokens else None,
                                "latent_hw": list(j.latent_hw) if j.latent_hw else None, "late": j.late}
                               for j in jobs])

        state = {"max_batch": str(self.max_batch)}
        if self.resident_templates is not None:
            state["templates"] = json.dumps(sorted(self.resident_templates()))
        if self.resident_adapters is not None:
            state["loras"] = json.dumps(sorted(self.resident_adapters()))
        if self.resident_controlnets is not None:
            state["controlnets"] = json.dumps(sorted(self.resident_controlnets()))
        factor = getattr(self.step_time, "factor", None)
        if factor is not None:  # the dispatcher's deadline check and router use the engine's pace
            state["step_time_factor"] = repr(float(factor))
        return state | {"running": view(batch), "waiting": view(waiting), "updated": repr(time.time()),
                "last_step_seconds": repr(self.last_step_seconds), "holder": holder_id(),
                "busy_seconds": repr(self.busy_seconds), "steps": str(self.steps)}


def get_engine() -> Engine:
    """The process's engine, created on first use (model load happens here, once)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            from workers.engine.scheduler import SIZE_AFFINITY_STEPS, BatchScheduler, device_defaults
            from workers.engine.template_cache import CacheRecorder, StepCacheProvider
            from workers.maskaware.tokens import POOL_THRESHOLD
            from workers.models import loader

            s = ctx.settings()
            cache_options: dict[str, Any] = {}
            if s.mask_aware:
                # Budget set below once the model's weights are known (auto = from memory).
                cache_options = {"caches": StepCacheProvider(
                    ctx.activations(), max(s.host_cache_bytes, 0), fetch_threads=PREFETCH_THREADS,
                    device=s.device),
                                 "recorder": CacheRecorder(ctx.activations(), codec=s.cache_dtype),
                                 "prefetch_steps": s.prefetch_steps, "cache_plan": "plan",
                                 "read_gbps": None}  # warm-ups store units by the measured host->device read
            # Adapters: the patcher goes in before the mask-aware hooks (see workers/adapters/patcher.py).
            from workers.adapter_tasks import read_weights
            from workers.adapters.bank import AdapterBank
            from workers.adapters.patcher import LoraPatcher

            bank = AdapterBank(read_weights, s.lora_cache_bytes)
            cache_options.update(adapters=bank, batch_invariant=s.batch_invariant_for(s.dtype, s.device))
            if ctx.model_family() == "flux":
                from workers.engine.flux_runner import FluxRunner
                from workers.maskaware.flux import MaskAwareFlux

                model = loader.load_flux_transformer(ctx.model_dir(), s.device, loader.torch_dtype(s.dtype))
                lora = LoraPatcher(model, "transformer", bank.get, resident=bank.resident)
                runner: Any = FluxRunner(model, ctx.scheduler_config(), loader.vae_scale_factor(ctx.model_dir()),
                                         s.device, compile=s.compile, graphs=s.cuda_graphs_for(s.device),
                                         maskaware=MaskAwareFlux(model, compile=s.compile) if s.mask_aware else None,
                                         lora=lora, **cache_options)
            else:
                from workers.controlnets.bank import ControlNetBank, store_loader
                from workers.engine.sd_runner import SDRunner
                from workers.maskaware.unet import MaskAwareUNet

                unet = loader.load_unet(ctx.model_dir(), s.device, loader.torch_dtype(s.dtype))
                lora = LoraPatcher(unet, "unet", bank.get, resident=bank.resident)
                maskaware = MaskAwareUNet(unet, compile=s.compile) if s.mask_aware else None
                if maskaware is not None:
                    maskaware.pool_threshold = POOL_THRESHOLD
                controlnets = ControlNetBank(store_loader(ctx.object_store().get, s.device, unet.dtype),
                                             s.controlnet_cache_bytes)
                runner = SDRunner(unet, ctx.scheduler_config(), s.device, maskaware=maskaware, lora=lora, compile=s.compile,
                                  graphs=s.cuda_graphs_for(s.device),
                                  controlnets=controlnets, controlnet_parallel=True, **cache_options)
            log.info("engine: %s model on %s in %s (mask-aware %s)", ctx.model_family(), s.device, s.dtype,
                     "on" if s.mask_aware else "off")
            caches = cache_options.get("caches")
            if caches is not None:
                from workers.engine.host_budget import host_cache_budget

                denoiser = getattr(runner, "unet", None) or getattr(runner, "model", None) or getattr(runner, "transformer", None)
                caches.host.budget_bytes = host_cache_budget(
                    s.host_cache_bytes, HOST_CACHE_FRACTION, [denoiser] if denoiser is not None else [], s.device)
                if denoiser is not None:
                    caches.dtype = next(denoiser.parameters()).dtype
                log.info("template caches stored as %s (exact-region caches: float32)", s.cache_dtype)
            step_time = None
            if s.slo_admission.strip().lower() not in ("off", "0", "false", "no"):
                from app.calibration import STEP_TIME_CALIBRATION, calibrated
                from app.costmodel import find_model, slo_admission_on, step_time_predictor

                try:
                    model = find_model(s.home, s.model_id, s.cost_model)
                except (OSError, ValueError, KeyError) as exc:
                    log.warning("cost model unusable (%s): SLO admission off", exc)
                    model = None
                on = slo_admission_on(s.slo_admission, model)
                step_time = calibrated(step_time_predictor(model) if on and model is not None else None,
                                       STEP_TIME_CALIBRATION)
                log.info("SLO admission %s", f"on ({model.model_id}/{model.device_kind}, "
                         f"{'resolution-aware batch SVR' if model.batch else 'linear model'})" if on and model else
                         "off: no fitted cost model with the batch step-time predictor (`stencil profile --sizes`)")

            def expire(job: EngineJob, why: str) -> None:
                ctx.jobs().transition(job.job_id, JobStatus.EXPIRED, error=why)

            caches = cache_options.get("caches")
            hooks = RedisEngineHooks(s.worker_id, s.lease_seconds, max_batch=s.max_batch,
                                     resident_templates=caches.resident_templates if caches else None,
                                     resident_adapters=bank.resident,
                                     resident_controlnets=getattr(getattr(runner, "controlnets", None), "resident",
                                                                  None),
                                     step_time=step_time,
                                     step_graph=lambda: getattr(runner, "last_step_graph", "off"))
            _engine = Engine(runner, BatchScheduler(s.max_batch, s.batching, step_time=step_time, on_expire=expire,
                                                     size_affinity_steps=SIZE_AFFINITY_STEPS,
                                                     **device_defaults(s.device)),
                             hooks, idle_wait=ENGINE_IDLE_SLEEP_S).start()
        return _engine


@worker_ready.connect
def _warm_engine(sender: Any = None, **_: Any) -> None:
    queues = {q.name for q in getattr(sender.app.amqp, "queues", {}).values()} if sender else set()
    if any(q.startswith("gpu.") for q in queues) or ctx.role() == "gpu":
        try:
            get_engine()
        except BaseException as exc:  # noqa: BLE001 - Celery would log a handler's error and serve on without an engine
            log.exception("the engine could not start")
            log.critical("the GPU worker exits: the engine could not start (%s: %s)", type(exc).__name__, exc)
            logging.shutdown()
            os._exit(1)  # its supervisor (stencil serve, compose, the embedded stack) sees it at once


@worker_shutdown.connect
def _stop_engine(**_: Any) -> None:
    if _engine is not None:
        _engine.stop()


@app.task(name="stencil.prefetch", ignore_result=True, acks_late=False)
def prefetch(key: dict[str, Any], steps: int) -> None:
    """Start fetching a template cache into host RAM (first steps first) while its job waits."""
    from workers.maskaware.activation_store import TemplateCacheKey

    caches = getattr(get_engine().runner, "caches", None)
    if caches is not None:
        caches.prefetch(TemplateCacheKey.from_dict(key), range(int(steps)))


@app.task(name="stencil.prefetch_loras", ignore_result=True, acks_late=False)
def prefetch_loras(loras: list[list[Any]]) -> None:
    """Start fetching a routed job's adapters into host RAM (deduplicated) while it is prepared;
    on an idle engine also merge them in the background, so its first step swaps them in."""
    engine = get_engine()
    runner = engine.runner
    if getattr(runner, "adapters", None) is None:
        return
    adapters = tuple(sorted((str(i), float(s)) for i, s in loras))

    def stage() -> None:
        if not engine.scheduler.jobs() and runner.lora is not None:
            runner.lora.stage(adapters)

    runner.adapters.prefetch((i for i, _ in adapters), on_ready=stage)


@app.task(name="stencil.prefetch_controlnets", ignore_result=True, acks_late=False)
def prefetch_controlnets(ids: list[str]) -> None:
    """Start loading a routed job's ControlNets (resident LRU) while the job is prepared."""
    controlnets = getattr(get_engine().runner, "controlnets", None)
    if controlnets is not None:
        controlnets.prefetch(str(i) for i in ids)


def _lora_fields(out: dict[str, Any]) -> dict[str, Any]:
    """What the record says about a job's adapters: from which step they applied (0 = exact; a
    late job's result is approximate) and how often they were merged vs added as per-row terms."""
    applied = out.get("lora_applied_step")
    if applied is None:
        return {}
    fields = {"lora_applied_step": applied, "lora_merged_steps": out.get("lora_merged_steps", 0),
              "lora_term_steps": out.get("lora_term_steps", 0)}
    if applied > 0:
        fields["approximate"] = "1"
    return fields


@app.task(name="stencil.denoise", bind=True)
def denoise(self: Any, prep: dict[str, Any]) -> dict[str, Any]:
    job_id = prep["job_id"]
    jobs = ctx.jobs()
    rec = jobs.get(job_id)
    if rec is None or rec.status.terminal:
        raise Ignore()
    if prep.get("empty") or ctx.blobs().exists(job_id, "latents"):
        return prep  # nothing to denoise, or already denoised before a redelivery
    lease = Lease(job_id, ctx.settings().lease_seconds)
    if not lease.acquire():
        log.info("job %s is being denoised by a live worker; dropping this duplicate", job_id)
        raise Ignore()
    try:
        blob = ctx.blobs().get(job_id, "inputs")
        if blob is None:
            jobs.fail(job_id, "prepared inputs are missing (expired?)")
            raise Ignore()
        tensors, meta = unpack(blob)
        # The user's deadline is hard; the dispatcher's default SLO deadline (slo_deadline) is soft.
        deadline, hard = rec.params.deadline, True
        if deadline is None and rec.fields.get("slo_deadline"):
            deadline, hard = float(rec.fields["slo_deadline"]), False
        job = get_engine().submit(job_id, tensors, meta, total_steps=int(meta["num_steps"]),
                                  priority=rec.params.priority, deadline=deadline, hard_deadline=hard,
                                  template_id=rec.params.template_id,
                                  mask_ratio=float(meta.get("mask_ratio", 1.0)))
        try:
            out = job.future.result()
            if out["commit"] is not None:  # a warm-up is done when its cache is committed
                out["commit"].result(timeout=600)
        except JobCancelled as exc:
            raise Ignore() from exc
        except Exception as exc:
            log.warning("job %s failed while denoising: %s", job_id, exc)
            jobs.fail(job_id, f"denoising failed: {type(exc).__name__}: {exc}")
            raise Ignore() from exc
        ctx.blobs().put(job_id, "latents", pack({"latents": out["latents"]}))
        used = out["masked_steps"] + out["fallback_steps"]
        # Denoisings that ran to the end: 1, unless a job was denoised again after a loss (a duplicate).
        ctx.redis_client().hincrby(jobs.key(job_id), "denoise_runs", 1)
        jobs.update(job_id, ts_denoised=repr(time.time()), cache_mode=out["mode"],
                    masked_steps=out["masked_steps"], fallback_steps=out["fallback_steps"],
                    refresh_steps=out.get("refresh_steps", 0),
                    # Share of steps whose cache fetch was hidden (wholly resident when the step
                    # ran); masked_steps also counts steps the plan ran partly from the cache.
                    fetch_hidden=f"{out.get('resident_steps', out['masked_steps']) / used:.3f}" if used else "",
                    # Share of (step, plan unit) computations that used the cache.
                    cached_unit_share=("" if out.get("cached_unit_share") is None
                                       else f"{out['cached_unit_share']:.3f}"),
                    # Bytes of the job's template cache this worker's host-RAM tier read from the object
                    # store (cumulative per worker): > 0 where the cache came from the store.
                    cache_store_bytes=out.get("cache_store_bytes", 0),
                    # ``turbo``: share of (step, unit, patch) computations taken from the job's last step
                    reused_share=("" if out.get("reused_share") is None else f"{out['reused_share']:.3f}"),
                    # steps whose denoiser call replayed a captured CUDA graph (GPU; 0 elsewhere)
                    graph_replayed_steps=out.get("graph_replayed_steps", 0),
                    **_lora_fields(out))
        return prep
    finally:
        lease.release()
