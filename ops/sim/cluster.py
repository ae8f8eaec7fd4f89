"""Discrete-event simulation of a Stencil cluster: dispatcher + N continuously batching workers.

The dispatcher side calls the production routing policy (``app.routing``) on a ``WorkerView``
built exactly like the real one: each worker's state as its engine last published it (after
every step) plus the dispatcher's in-flight assignments (routed jobs still in ``prepare``). Each
worker runs the production ``BatchScheduler`` (continuous batching; with ``slo_admission`` the
cost-model step predictor, slack or arrival ordering, expiry and admission refusal). Step durations come
from the fitted cost model (``intercept + sum of job step seconds``) times lognormal noise.

Template caches: a job whose template was warmed computes masked tokens only, but only once its
template's activations are in the worker's host-RAM LRU; until the fetch (predicted by the load
model) completes it computes full steps, exactly as ``SDRunner`` falls back. Jobs with an empty
mask never reach a GPU worker (``prepare`` returns the template).

Mixed image sizes: jobs carry their latent grid (``SimJob.latent_hw``); a batch's step time then
comes from ``ClusterConfig.step_cost`` (e.g. the resolution-aware batch predictor fitted on this
CPU, or a GPU-shaped batch curve), and SLO admission from ``ClusterConfig.step_time`` (default:
the cost model's predictor). Batching modes are the engine's: continuous, static, bucketed.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.calibration import STEP_TIME_CALIBRATION, calibrated
from app.costmodel import CostModel, min_service_seconds, step_time_predictor
from app.routing import JobDemand, JobLoad, RoutingPolicy, WorkerState, WorkerView, fetched_steps
from app.settings import Settings
from ops.sim.workload import SimJob
from workers.engine.job import EngineJob
from workers.engine.scheduler import SIZE_AFFINITY_STEPS, BatchScheduler


@dataclass
class ClusterConfig:
    workers: int
    max_batch: int = 8
    slo_admission: bool = False
    noise: float = 0.03  # lognormal sigma of a step's duration around the prediction
    host_templates: int = 32  # host-RAM LRU capacity, in templates
    fetch_tier: str = "local"
    # steps a template cache stores (STENCIL_CACHE_STEPS for the UNets cost models describe): a
    # fetch moves that many steps, as the mask_aware router prices it
    cache_steps: int = Settings().cache_steps_for("sd")
    prepare_s: float = 0.0
    finalize_s: float = 0.0
    # 0: the dispatcher sees every publish at once; > 0: it re-reads the workers' state at most this
    # often (``LiveWorkerView.refresh_s``, 0.05 s in production) and adds its own routing
    # decisions to that snapshot until a publish shows them (every policy sees the same view).
    view_refresh_s: float = 0.0
    seed: int = 0
    batching: str = "continuous"  # or "static": a batch is admitted only once the last one drained
    size_affinity_steps: int = SIZE_AFFINITY_STEPS  # the engine's (workers/engine/scheduler.py)
    size_switch: str = "mix"  # mix | drain (``BatchScheduler``): the simulated device's, as auto resolves it
    slo_order: str = "slack"  # slack | arrival | deadline (``BatchScheduler``): the device's, as auto resolves it
    slo_yield: str = "alone"  # alone | batch (``BatchScheduler``): likewise
    slo_margin: float = 0.0  # ``BatchScheduler``'s: likewise
    # Workers publish which waiting jobs SLO admission has put behind the on-time ones (``late``), and
    # routers leave them out of a worker's load, as the engine and dispatcher do; False: an engine that
    # does not (every waiting job counts).
    publish_late: bool = True
    # each worker corrects its SLO predictor online from its steps, as the engine does (app/calibration.py)
    step_time_calibration: float = STEP_TIME_CALIBRATION
    # Step cost of a batch of B jobs = intercept + (sum of their job seconds) * B ** (exponent - 1):
    # 1 is the linear cost fitted on this CPU, < 1 a sublinear (GPU-shaped) one.
    batch_exponent: float = 1.0
    # Overrides: seconds of one step of a batch of engine jobs (replaces the formula above), and
    # the SLO admission's step-time predictor (default: ``step_time_predictor(model)``).
    step_cost: Callable[[list[EngineJob]], float] | None = None
    step_time: Callable[..., float] | None = None
    # With ``step_cost``: price a job whose template cache has not reached the worker's RAM yet as full
    # compute (as the linear path and ``SDRunner`` do); False keeps ``step_cost`` blind to fetches.
    step_cost_fetch: bool = False


@dataclass
class SimWorker:
    wid: str
    sched: BatchScheduler
    state: WorkerState
    busy: bool = False
    batch: list[EngineJob] = field(default_factory=list)
    templates: OrderedDict[str, float] = field(default_factory=OrderedDict)  # template -> usable at
    ready_at: dict[str, float] = field(default_factory=dict)  # job -> its cache is usable at
    busy_s: float = 0.0


class Cluster:
    """One simulation run; ``run(jobs)`` fills each job's ``worker``, ``finish`` or ``expired``."""

    def __init__(self, model: CostModel, cfg: ClusterConfig, policy: RoutingPolicy) -> None:
        self.model = model
        self.cfg = cfg
        self.policy = policy
        self.now = 0.0
        self.rng = np.random.default_rng(cfg.seed + 1)
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.jobs: dict[str, SimJob] = {}
        predictor = (cfg.step_time or step_time_predictor(model)) if cfg.slo_admission else None
        self.workers = [self._make_worker(str(i), predictor) for i in range(cfg.workers)]
        self.by_id = {w.wid: w for w in self.workers}
        self.view = WorkerView(w.state for w in self.workers)
        self._snap: WorkerView | None = None  # what the dispatcher last read (view_refresh_s > 0)
        self._snap_at = -math.inf
        self._snap_src: dict[str, int] = {}  # worker -> stamp of the published state it copies
        self.decision_s: list[float] = []
        self.steps = 0

    def _make_worker(self, wid: str, predictor: Any) -> SimWorker:
        sched = BatchScheduler(self.cfg.max_batch, self.cfg.batching,
                               step_time=calibrated(predictor, self.cfg.step_time_calibration),
                               on_expire=self._on_expire, clock=lambda: self.now,
                               size_affinity_steps=self.cfg.size_affinity_steps,
                               size_switch=self.cfg.size_switch, slo_order=self.cfg.slo_order,
                               slo_yield=self.cfg.slo_yield, slo_margin=self.cfg.slo_margin)
        return SimWorker(wid, sched, WorkerState(wid, max_batch=self.cfg.max_batch))

    # -- event queue ------------------------------------------------------------------------
    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn, args))

    def run(self, jobs: list[SimJob]) -> list[SimJob]:
        for job in jobs:
            self.jobs[job.job_id] = job
            self._at(job.arrival, self._arrive, job)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        return jobs

    # -- dispatcher -------------------------------------------------------------------------
    def _arrive(self, job: SimJob) -> None:
        if job.ratio <= 0.0:  # empty mask: prepare returns the template, no GPU work
            job.finish = self.now + self.cfg.prepare_s + self.cfg.finalize_s
            return
        if self.cfg.slo_admission and job.hard_deadline:
            need = min_service_seconds(self.model, job.steps, mask_ratio=job.ratio, masked_tokens=job.masked_tokens,
                                       cached=job.cached) + self.cfg.prepare_s + self.cfg.finalize_s
            if self.now + need > job.deadline:
                job.expired = "deadline unreachable at routing"
                return
        demand = JobDemand(job.job_id, job.steps, job.ratio, job.masked_tokens, job.cached, job.template_id,
                           deadline=job.deadline, latent_hw=job.latent_hw)
        view = self._dispatcher_view()
        start = time.perf_counter()
        wid = self.policy.choose(demand, view)
        self.decision_s.append(time.perf_counter() - start)
        self.view.assign(wid, demand)
        if view is not self.view:
            view.assign(wid, demand)
            self._snap_src[wid] = self.by_id[wid].state.stamp
        job.worker = wid
        self._at(self.now + self.cfg.prepare_s, self._enqueue, job, self.by_id[wid])

    def _dispatcher_view(self) -> WorkerView:
        """The live states, or (``view_refresh_s`` > 0) a snapshot re-read at most that often: between
        reads the dispatcher only adds its own decisions, as ``LiveWorkerView`` does."""
        if self.cfg.view_refresh_s <= 0:
            return self.view
        if self._snap is not None and self.now - self._snap_at < self.cfg.view_refresh_s:
            return self._snap
        old = self._snap.workers if self._snap is not None else {}
        states = []
        for w in self.workers:
            st = w.state
            prev = old.get(w.wid)
            if prev is not None and self._snap_src.get(w.wid) == st.stamp:
                states.append(prev)  # unchanged since the last read (keeps the routers' per-state caches)
                continue
            self._snap_src[w.wid] = st.stamp
            states.append(WorkerState(st.worker_id, running=list(st.running), waiting=list(st.waiting),
                                      inflight=list(st.inflight), templates=st.templates,
                                      last_step_seconds=st.last_step_seconds, updated=st.updated,
                                      max_batch=st.max_batch, alive=st.alive))
        self._snap, self._snap_at = WorkerView(states), self.now
        return self._snap

    # -- workers ----------------------------------------------------------------------------
    def _enqueue(self, job: SimJob, w: SimWorker) -> None:
        ej = EngineJob(job_id=job.job_id, total_steps=job.steps, deadline=job.deadline, arrival=self.now,
                       mask_ratio=job.ratio, masked_tokens=job.masked_tokens, cached=job.cached,
                       template_id=job.template_id, latent_hw=job.latent_hw, rows=job.rows,
                       hard_deadline=job.hard_deadline)
        if job.cached:
            usable = w.templates.get(job.template_id)
            if usable is None:
                stored = fetched_steps(job.steps, self.cfg.cache_steps)
                usable = self.now + self.model.template_fetch_seconds(stored, self.cfg.fetch_tier)
                w.templates[job.template_id] = usable
                while len(w.templates) > self.cfg.host_templates:
                    w.templates.popitem(last=False)
            else:
                w.templates.move_to_end(job.template_id)
            w.ready_at[job.job_id] = usable
        w.sched.add(ej)
        if not w.busy:
            self._start_step(w)

    def _on_expire(self, ej: EngineJob, reason: str) -> None:
        self.jobs[ej.job_id].expired = reason

    def _job_seconds(self, w: SimWorker, ej: EngineJob) -> float:
        cached = ej.cached and w.ready_at.get(ej.job_id, math.inf) <= self.now
        return self.model.job_seconds(mask_ratio=ej.mask_ratio, masked_tokens=ej.masked_tokens, cached=cached)

    def _start_step(self, w: SimWorker) -> None:
        batch, _ = w.sched.schedule()
        if not batch:
            w.busy = False
            self._publish(w)
            return
        if self.cfg.step_cost is not None:
            priced = batch if not self.cfg.step_cost_fetch else [
                j if not j.cached or w.ready_at.get(j.job_id, math.inf) <= self.now
                else dataclasses.replace(j, cached=False) for j in batch]
            predicted = self.cfg.step_cost(priced)
        else:
            predicted = self.model.intercept + sum(self._job_seconds(w, j) for j in batch) * (
                len(batch) ** (self.cfg.batch_exponent - 1.0))
        sigma = self.cfg.noise
        dur = predicted * (float(self.rng.lognormal(-sigma * sigma / 2, sigma)) if sigma else 1.0)
        w.busy, w.batch = True, batch
        for ej in batch:
            self.jobs[ej.job_id].extra.setdefault("start", self.now)
        w.sched.observe_step(batch, dur)  # as the engine feeds its measured step back (Engine.step_once)
        w.busy_s += dur
        self.steps += 1
        self._at(self.now + dur, self._end_step, w)

    def _end_step(self, w: SimWorker) -> None:
        for ej in w.sched.complete_step(w.batch):
            self.jobs[ej.job_id].finish = self.now + self.cfg.finalize_s
            w.ready_at.pop(ej.job_id, None)
        self._publish(w)
        self._start_step(w)

    def _publish(self, w: SimWorker) -> None:
        """What ``RedisEngineHooks.on_step`` writes; visible jobs leave the dispatcher's in-flight."""
        def load(ej: EngineJob) -> JobLoad:
            return JobLoad(ej.job_id, ej.remaining, ej.mask_ratio, ej.masked_tokens, ej.cached, ej.template_id,
                           latent_hw=ej.latent_hw, late=ej.late and self.cfg.publish_late)

        st = w.state
        st.running = [load(j) for j in w.sched.running if j.remaining > 0]
        st.waiting = [load(j) for j in w.sched.waiting]
        st.templates = frozenset(w.templates)
        st.updated = self.now
        st.touch()
        if st.inflight:
            arrived = {j.job_id for j in w.sched.jobs()}
            st.inflight = [j for j in st.inflight
                           if j.job_id not in arrived and self.jobs[j.job_id].finish is None
                           and not self.jobs[j.job_id].expired]
