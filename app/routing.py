"""Routing policies: which GPU worker a job goes to. One interface, chosen by setting.

Every policy is ``choose(job: JobDemand, view: WorkerView) -> worker id`` over a snapshot of the
workers (what each engine last published to ``stencil:worker:<id>`` plus the dispatcher's own
in-flight assignments, which the engines cannot show yet). Policies are pure: the dispatcher, the
tests and the cluster simulator (ops/bench/simulate.py) run the very same objects.

``STENCIL_ROUTING_POLICY``:
- ``round_robin``: the baseline; ignores load.
- ``least_requests``: fewest jobs ahead of a new one (running + waiting + in flight); blind to job
  size and progress;
  among equals, the worker holding more of the job's add-ons (LoRA adapters, ControlNets).
- ``least_masked_tokens``: fewest masked tokens (uncached jobs count all their tokens) over the
  worker's jobs; sees size, not progress, batch limits or fixed per-step costs.
- ``mask_aware``: the paper's Algorithm 2. For each worker, the fitted cost model predicts each
  step of its batch as ``intercept + sum(job step seconds)`` and the batch's future is integrated
  step by step (jobs leave when done, waiting jobs take free slots, the new job joins in order):
  the cost is the time until the new job would finish there. On a worker without the job's
  template in host RAM (none of it on the way; residency not published is not guessed) the job
  computes in full until the cache lands: it costs that finish plus the delay its full steps add to
  other jobs, now and, scaled by load, later (``MaskAwareRouter.cold_start_cost``). Add-ons (LoRA
  adapters, ControlNets) cost their bytes at the fetch tier's bandwidth unless resident or on the
  way with another job there (add-on affinity).
  With a cost model that carries a batch-step curve (``app/costmodel.py``: a GPU step costs about
  the same for its first few jobs, then grows by a job's device time) each step is priced on the
  curve instead, so a job added to a worker costs ``t(W + w) - t(W)``: the router sees that a worker
  below the curve's knee takes it nearly for free and one past the knee does not (what it changes in
  a simulated cluster: docs/bench/dispatch_gpu.md).
  Ties go to the worker with fewer jobs, then round robin. Workers
  whose cheap lower bound already exceeds the best cost found are skipped (same choice, faster).

Size affinity (``ROUTING_SIZE_SLACK`` jobs, or ``make_policy``'s ``size_slack``; least_requests, least_masked_tokens and
mask_aware): a job whose size is known goes to a worker that is idle or already has a job of its
latent grid, if one has at most ``slack`` more jobs than the least loaded worker; otherwise to any.
Every image size in an engine step is one more denoiser call, and on a GPU each call pays the
small-batch floor again: spreading sizes evenly over workers makes every worker pay it for every
size, while grouping them keeps steps single-size (measured: ops/bench/mixed_sizes, BENCHMARKS.md).
0 = off.

Late jobs: a waiting job whose engine published it as late (SLO-aware admission: its soft deadline is
out of reach, so it runs behind every job that can still make its own) is not ahead of a new job;
every policy leaves it out of a worker's load (``WorkerState.n_jobs``, ``ahead``) and the
mask_aware cost. It still counts for template and add-on affinity (its fetches happen). Counting
it sent new jobs away from the workers that had given up on the most deadlines, towards longer
on-time queues (GPU-shaped simulator at 1.3x capacity, 10 seeds, least_requests: 93.2% -> 94.5% of
deadlines kept with deadline order, 93.1% -> 94.0% with arrival order; ops/bench/mixed_sizes).

Ablations (``make_policy`` only, not settings): ``mask_aware_marginal`` adds the delay the new
job inflicts on the jobs it shares steps with (a marginal cost); in the simulation it moved P95 by
-0.7% to +1.0% (docs/bench/dispatch.md). ``mask_aware_fetch`` / ``mask_aware_unloaded`` price a cold
start as the whole fetch / without the later arrivals' delay (docs/bench/dispatch_gpu.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app.coldstart import ClusterLoad, cold_start
from app.costmodel import CostModel, admission_profile, finish_after_admission

_stamps = itertools.count(1)


@dataclass(frozen=True)
class JobDemand:
    """What the dispatcher knows about a job when routing it."""

    job_id: str
    steps: int
    mask_ratio: float = 1.0
    masked_tokens: tuple[int, ...] | None = None  # per UNet level, if the mask was seen
    cached: bool = True  # will compute masked tokens only (template cache available)
    template_id: str = ""
    priority: int = 0
    deadline: float | None = None
    refresh_share: float = 0.0  # cached jobs: share of steps computed fully (fidelity refresh steps)
    addons: tuple[str, ...] = ()  # "lora:<id>", "controlnet:<id>": models the job needs besides the base
    addon_bytes: tuple[int, ...] = ()  # their sizes (what a worker without them has to fetch)
    latent_hw: tuple[int, int] | None = None  # the job's latent grid at its processing size, if known
    size_tokens: tuple[int, ...] | None = None  # masked tokens per level at that size (step-time predictor)


@dataclass
class JobLoad:
    """A job already at (or on its way to) a worker."""

    job_id: str
    remaining: int
    mask_ratio: float = 1.0
    masked_tokens: tuple[int, ...] | None = None
    cached: bool = True
    template_id: str = ""
    step_seconds: float | None = None  # memo of the cost model's marginal step seconds
    token_load: float | None = None  # memo of the masked-token count (least_masked_tokens)
    refresh_share: float = 0.0
    addons: tuple[str, ...] = ()
    latent_hw: tuple[int, int] | None = None  # the job's latent grid (size affinity), if known
    late: bool = False  # waiting behind every on-time job (its soft deadline is out of reach)

    @classmethod
    def from_demand(cls, d: JobDemand) -> "JobLoad":
        return cls(d.job_id, d.steps, d.mask_ratio, d.masked_tokens, d.cached, d.template_id,
                   refresh_share=d.refresh_share, addons=d.addons, latent_hw=d.latent_hw)


@dataclass
class WorkerState:
    """One worker as the router sees it."""

    worker_id: str
    running: list[JobLoad] = field(default_factory=list)
    waiting: list[JobLoad] = field(default_factory=list)
    inflight: list[JobLoad] = field(default_factory=list)
    templates: frozenset[str] | None = frozenset()  # resident in host RAM; None = not published
    addons: frozenset[str] | None = None  # add-ons resident ("lora:<id>", ...); None = not published
    last_step_seconds: float = 0.0
    updated: float = 0.0  # epoch seconds of the engine's last publish (0 = never seen)
    max_batch: int = 8
    alive: bool = True
    # The engine's online calibration (app/calibration.py): its measured / predicted step time. The
    # cost model is fitted once; this says how fast the worker runs now (1 = as fitted).
    step_time_factor: float = 1.0
    # Changes whenever the state does (new object or ``touch``): routers cache per-worker work by it.
    stamp: int = field(default_factory=lambda: next(_stamps))

    def touch(self) -> None:
        """Call after mutating the job lists in place."""
        self.stamp = next(_stamps)

    @property
    def n_jobs(self) -> int:
        """Jobs ahead of a new one (``ahead``)."""
        return len(self.running) + len(self.on_time_waiting()) + len(self.inflight)

    def jobs(self) -> Iterable[JobLoad]:
        """Every job at (or on its way to) the worker, late ones included."""
        return itertools.chain(self.running, self.waiting, self.inflight)

    def on_time_waiting(self) -> list[JobLoad]:
        """Waiting jobs a new job would queue behind: all but late ones (module docstring)."""
        return [j for j in self.waiting if not j.late]

    def ahead(self) -> Iterable[JobLoad]:
        """The jobs a new job would wait for or share steps with: running, on-time waiting, in flight."""
        return itertools.chain(self.running, self.on_time_waiting(), self.inflight)

    def missing_addons(self, addons: Iterable[str]) -> list[str]:
        """The add-ons this worker would have to fetch: neither resident nor on the way with one of
        its jobs. Unknown residency (not published) counts as resident: nothing is guessed."""
        if self.addons is None:
            return []
        wanted = [a for a in addons if a not in self.addons]
        if not wanted:
            return []
        coming = {a for j in self.jobs() for a in j.addons}
        return [a for a in wanted if a not in coming]


class WorkerView:
    """All workers the dispatcher routes to, in a fixed order."""

    def __init__(self, workers: Iterable[WorkerState]) -> None:
        self.workers: dict[str, WorkerState] = {w.worker_id: w for w in workers}
        if not self.workers:
            raise ValueError("no GPU workers configured (STENCIL_GPU_WORKERS)")

    def candidates(self) -> list[WorkerState]:
        """Live workers; all of them if none looks alive (better a late job than none routed)."""
        live = [w for w in self.workers.values() if w.alive]
        return live or list(self.workers.values())

    def assign(self, worker_id: str, job: JobDemand) -> None:
        """Count a routed job at its worker until the engine's own state shows it."""
        w = self.workers[worker_id]
        w.inflight.append(JobLoad.from_demand(job))
        w.touch()


def size_affine(workers: list[WorkerState], job: JobDemand, slack: float) -> list[WorkerState]:
    """The workers a job should choose among under size affinity (module docstring): those idle or
    holding a job of its latent grid with at most ``slack`` more jobs than the least loaded worker;
    all of ``workers`` when there is none, the size is unknown or ``slack`` is 0."""
    if slack <= 0 or job.latent_hw is None or len(workers) < 2:
        return workers
    least = min(w.n_jobs for w in workers)
    affine = [w for w in workers if w.n_jobs <= least + slack
              and (w.n_jobs == 0 or any(j.latent_hw == job.latent_hw for j in w.ahead()))]
    return affine or workers


# Size affinity's slack (jobs; module docstring): the service's; the mixed-sizes benchmark varies it.
ROUTING_SIZE_SLACK = 8.0


def cache_steps_setting() -> int:
    """``STENCIL_CACHE_STEPS``: steps a template cache stores (its fetch moves that many), for the
    UNets cost models describe (``UNetArch``)."""
    from app.settings import Settings

    return Settings.from_env().cache_steps_for("sd")


def fetched_steps(steps: int, cache_steps: int) -> int:
    """Steps a cold template's cache fetch moves: what its cache stores (``cache_steps``; 0 = all)."""
    return min(steps, cache_steps) if cache_steps > 0 else steps


class RoutingPolicy(Protocol):
    name: str

    def choose(self, job: JobDemand, view: WorkerView) -> str:
        """The worker id for ``job``."""
        ...


Router = RoutingPolicy  # the name the dispatcher used before policies saw worker state


class _Rotation:
    """Deterministic tie-breaking that spreads ties (a rotating start index)."""

    def __init__(self) -> None:
        self._n = 0

    def order(self, workers: Sequence[WorkerState]) -> list[WorkerState]:
        k = self._n % len(workers)
        self._n += 1
        return list(workers[k:]) + list(workers[:k])


class RoundRobinRouter:
    name = "round_robin"

    def __init__(self) -> None:
        self._n = 0

    def choose(self, job: JobDemand, view: WorkerView) -> str:
        workers = view.candidates()
        w = workers[self._n % len(workers)]
        self._n += 1
        return w.worker_id


class LeastRequestsRouter:
    name = "least_requests"

    def __init__(self, *, size_slack: float = 0.0) -> None:
        self._rot = _Rotation()
        self.size_slack = size_slack

    def choose(self, job: JobDemand, view: WorkerView) -> str:
        return min(self._rot.order(size_affine(view.candidates(), job, self.size_slack)),
                   key=lambda w: (w.n_jobs, len(w.missing_addons(job.addons)))).worker_id


class LeastMaskedTokensRouter:
    """Balances masked tokens; with a cost model counts real per-level tokens, else ratios."""

    name = "least_masked_tokens"

    def __init__(self, model: CostModel | None = None, *, size_slack: float = 0.0) -> None:
        self.model = model
        self.size_slack = size_slack
        self._rot = _Rotation()
        self._full = float(sum(model.arch.level_tokens())) if model else 1.0
        self._memo: dict[float, float] = {}

    def tokens(self, job: JobLoad | JobDemand) -> float:
        if not job.cached or job.mask_ratio >= 1.0:
            return self._full
        if self.model is None:
            return job.mask_ratio
        if job.masked_tokens is not None:
            return float(sum(job.masked_tokens))
        value = self._memo.get(job.mask_ratio)
        if value is None:
            value = float(sum(self.model.arch.tokens_from_ratio(job.mask_ratio)))
            if len(self._memo) > 100_000:
                self._memo.clear()
            self._memo[job.mask_ratio] = value
        return value

    def _load(self, job: JobLoad) -> float:
        if job.token_load is None:
            job.token_load = self.tokens(job)
        return job.token_load

    def choose(self, job: JobDemand, view: WorkerView) -> str:
        def load(w: WorkerState) -> tuple[float, int]:
            return sum(self._load(j) for j in w.ahead()), w.n_jobs

        return min(self._rot.order(size_affine(view.candidates(), job, self.size_slack)), key=load).worker_id


class MaskAwareRouter:
    """The paper's Algorithm 2 with a cache-affinity term (module docstring)."""

    name = "mask_aware"

    def __init__(self, model: CostModel, *, fetch_tier: str = "local", externality: float = 0.0,
                 cold_price: str = "loaded",
                 size_slack: float = 0.0, cache_steps: int = 0) -> None:
        self.model = model
        self.size_slack = size_slack
        self.cache_steps = cache_steps  # steps a template cache stores (STENCIL_CACHE_STEPS; 0 = all)
        self.fetch_tier = fetch_tier
        self._step = model.step_function()  # None: the linear step, intercept + sum(job seconds)
        # Weight of the delay the new job adds to the worker's other jobs (0 = the paper's cost).
        self.externality = externality
        # Cold start priced (ablations: ``make_policy``) as ``cold_start_cost``, without its later
        # arrivals' delay ("unloaded") or as the warm finish + the whole fetch ("fetch").
        if cold_price not in COLD_PRICES:
            raise ValueError(f"cold_price must be one of {COLD_PRICES}, got {cold_price!r}")
        self.cold_price = cold_price
        self._rot = _Rotation()
        self._by_job: dict[tuple[object, ...], float] = {}
        self._profiles: dict[str, tuple[int, tuple[float, list[tuple[float, int]]]]] = {}
        self._templates: dict[str, tuple[int, frozenset[str]]] = {}
        self._bounds: dict[str, tuple[int, int, float]] = {}  # worker -> (stamp, steps, work ahead)
        self._rates: dict[str, tuple[int, float, int]] = {}  # worker -> (stamp, jobs done per second, free slots)

    def job_seconds(self, job: JobLoad) -> float:
        """A job's marginal step seconds, memoized per job (a job's cost is fixed for its life and
        the same job is re-parsed from worker state at every refresh)."""
        sec = job.step_seconds
        if sec is None:
            key = (job.job_id, job.cached, job.mask_ratio, job.masked_tokens, job.refresh_share)
            sec = self._by_job.get(key)
            if sec is None:
                sec = self.model.job_seconds(mask_ratio=job.mask_ratio, masked_tokens=job.masked_tokens,
                                             cached=job.cached)
                if job.cached and job.refresh_share > 0:  # refresh steps run at full cost
                    full = self.model.job_seconds(mask_ratio=job.mask_ratio, masked_tokens=job.masked_tokens,
                                                  cached=False)
                    sec = (1 - job.refresh_share) * sec + job.refresh_share * full
                if len(self._by_job) > 200_000:
                    self._by_job.clear()
                self._by_job[key] = sec
            job.step_seconds = sec
        return sec

    def profile(self, w: WorkerState) -> tuple[float, list[tuple[float, int]]]:
        """(seconds until a slot frees for a new job, jobs alive then), cached per worker state."""
        hit = self._profiles.get(w.worker_id)
        if hit is not None and hit[0] == w.stamp:
            return hit[1]
        js = self.job_seconds
        running = [(js(j), j.remaining) for j in w.running if j.remaining > 0]
        queued = [(js(j), j.remaining) for j in w.on_time_waiting()] + [(js(j), j.remaining) for j in w.inflight]
        prof = admission_profile(running, queued, w.max_batch, self.model.intercept, self._step)
        self._profiles[w.worker_id] = (w.stamp, prof)
        return prof

    def _job_templates(self, w: WorkerState) -> frozenset[str]:
        """Templates of the worker's jobs (running, waiting, in flight), cached per worker state."""
        hit = self._templates.get(w.worker_id)
        if hit is not None and hit[0] == w.stamp:
            return hit[1]
        tpl = frozenset(j.template_id for j in w.jobs())
        self._templates[w.worker_id] = (w.stamp, tpl)
        return tpl

    def lower_bound(self, w: WorkerState, mine_s: float, steps: int) -> float:
        """A cheap bound below ``cost``: the new job runs ``steps`` steps, and every job ahead of it
        (running, on-time waiting or in flight) runs at least ``min(its remaining, steps)`` steps before the
        new job finishes (it either ends first or is still running when the new job ends); each of
        those steps costs that job's step seconds. Exact when the worker has a free slot. On a curved
        step (convex, increasing, positive at no work) the same work spread evenly over ``steps`` steps
        is the least those steps can cost (Jensen), and more steps only cost more."""
        hit = self._bounds.get(w.worker_id)
        if hit is not None and hit[0] == w.stamp and hit[1] == steps:
            ahead = hit[2]
        else:
            js = self.job_seconds
            ahead = 0.0
            for j in w.ahead():
                r = j.remaining
                if r > 0:
                    ahead += js(j) * (r if r < steps else steps)
            self._bounds[w.worker_id] = (w.stamp, steps, ahead)
        if self._step is not None:
            return steps * self._step(mine_s + ahead / steps) * w.step_time_factor
        return (steps * (self.model.intercept + mine_s) + ahead) * w.step_time_factor

    def cost(self, job: JobLoad, w: WorkerState, fetch_s: float, addon_bytes: dict[str, int] | None = None,
             load: ClusterLoad = ClusterLoad()) -> float:
        """Predicted seconds until ``job`` finishes on ``w``, compute at ``w``'s measured pace
        (``step_time_factor``); on a worker without its template, the cold start's price
        (``cold_start_cost``, with the cluster's ``load``) instead; + the fetch of cold add-ons."""
        mine_s, mine_r = self.job_seconds(job), job.remaining
        t_admit, alive = self.profile(w)
        if self.is_cold(job, w, fetch_s) and self.cold_price != "fetch":
            t = self.cold_start_cost(job, w, t_admit, alive, fetch_s,
                                     load if self.cold_price == "loaded" else ClusterLoad())
        else:
            t = finish_after_admission(t_admit, alive, mine_s, mine_r, self.model.intercept, self._step)
            t *= w.step_time_factor  # compute runs at the worker's measured pace; fetches do not
            if self.cold_price == "fetch" and self.is_cold(job, w, fetch_s):
                t += fetch_s
        if self.externality:
            # Others' extra time while sharing steps with the new job.
            t += self.externality * self._shared_extra(alive, mine_s, mine_r) * w.step_time_factor
        if addon_bytes and job.addons:
            cold = sum(addon_bytes.get(a, 0) for a in w.missing_addons(job.addons))
            if cold:
                t += self.model.load_seconds(cold, self.fetch_tier) if self.fetch_tier in self.model.tiers else 0.0
        return t

    def is_cold(self, job: JobLoad, w: WorkerState, fetch_s: float) -> bool:
        """Whether ``w`` would fetch the job's template cache (module docstring)."""
        return bool(fetch_s and job.template_id and job.cached and w.templates is not None
                    and job.template_id not in w.templates and job.template_id not in self._job_templates(w))

    def cold_start_cost(self, job: JobLoad, w: WorkerState, t_admit: float, alive: Sequence[tuple[float, int]],
                        fetch_s: float, load: ClusterLoad) -> float:
        """A cold start's price (``app/coldstart.py``): the job's finish computing in full until its
        cache lands, + the delay its full steps add to their batch-mates, + the delay to later arrivals:
        the completion rate per worker (``cluster_load``; in steady state jobs leave as fast as they
        come) x each step's end, x ``1 / (1 - rho)`` as for an M/G/1 busy period, ``1 - rho`` read as
        the share of slots free. Without that last term 64 workers win but 8 at saturation lose
        deadlines; charging the whole fetch instead (``mask_aware_fetch``) kept each template on a few
        queued workers (docs/bench/dispatch_gpu.md)."""
        pace = w.step_time_factor  # compute runs at the worker's measured pace, the fetch does not
        full_s = self.model.job_seconds(mask_ratio=job.mask_ratio, masked_tokens=job.masked_tokens, cached=False)
        cs = cold_start(t_admit, alive, self.job_seconds(job), full_s, fetch_s / pace, job.remaining,
                        self.model.intercept, self._step)
        # exposure is (seconds added) x (time), both at the worker's pace
        return (cs.finish + cs.mates_delay) * pace + cs.later_arrivals(load) * pace * pace

    def cluster_load(self, workers: Sequence[WorkerState], steps: int) -> ClusterLoad:
        """Jobs a worker completes per second (its running jobs / (``steps`` x its step), averaged) and
        the share of slots free (queued jobs take slots). At least one slot per worker counts as free:
        a snapshot in a burst shows none though each worker frees one within steps, and the price
        would explode (8 H200 workers, 90% load, seed 2: P95 2.00 s unbounded, 1.67 s bounded)."""
        rate, free, slots = 0.0, 0, 0
        for w in workers:
            hit = self._rates.get(w.worker_id)
            if hit is None or hit[0] != w.stamp:
                run = [self.job_seconds(j) for j in w.running if j.remaining > 0][: w.max_batch]
                sec = self.model.step_seconds(run) * w.step_time_factor if run else 0.0
                hit = (w.stamp, len(run) / sec if sec > 0 else 0.0, max(0, w.max_batch - w.n_jobs))
                self._rates[w.worker_id] = hit
            rate += hit[1]
            free += hit[2]
            slots += w.max_batch
        return ClusterLoad(rate / (max(steps, 1) * len(workers)), max(free, len(workers)) / slots)

    def _shared_extra(self, alive: Sequence[tuple[float, int]], mine_s: float, steps: int) -> float:
        """Seconds the new job adds to the steps of the alive jobs it runs with (summed over them)."""
        if self._step is None:
            return mine_s * sum(min(rem, steps) for _, rem in alive)
        extra, done, in_step = 0.0, 0, sum(g for g, _ in alive)
        left = len(alive)
        for g, r in sorted(alive, key=lambda a: a[1]):
            end = min(r, steps)
            if end > done:
                extra += (end - done) * left * (self._step(in_step + mine_s) - self._step(in_step))
                done = end
            in_step -= g
            left -= 1
        return extra

    def template_fetch_s(self, job: JobDemand) -> float:
        """Predicted fetch of the job's template cache from the store: the steps it stores."""
        if not job.template_id:
            return 0.0
        return self.model.template_fetch_seconds(fetched_steps(job.steps, self.cache_steps), self.fetch_tier)

    def choose(self, job: JobDemand, view: WorkerView) -> str:
        """The lowest (cost, jobs), first in the rotating order among equals.

        Same choice as evaluating ``cost`` on every worker, cheaper after a view refresh: workers
        whose state changed get ``lower_bound`` first (no queue simulation), exact costs are
        computed in increasing bound order, and a worker whose bound exceeds the best exact cost
        so far cannot win or tie, so it is skipped.
        """
        load = JobLoad.from_demand(job)
        mine_s, steps = self.job_seconds(load), load.remaining
        fetch_s = self.template_fetch_s(job)
        addon_bytes = dict(zip(job.addons, job.addon_bytes)) if job.addons else None
        candidates = view.candidates()
        load_now = self.cluster_load(candidates, steps)
        order = self._rot.order(size_affine(candidates, job, self.size_slack))
        bounds: list[tuple[float, int]] = []
        for i, w in enumerate(order):
            hit = self._profiles.get(w.worker_id)
            warm = hit is not None and hit[0] == w.stamp
            bounds.append((-1.0 if warm else self.lower_bound(w, mine_s, steps), i))  # warm: exact is cheap
        bounds.sort()
        best_cost = math.inf
        keys: dict[int, tuple[float, int]] = {}
        for bound, i in bounds:
            if bound > best_cost * (1.0 + 1e-9):
                break  # this bound and all later ones exceed the best exact cost
            w = order[i]
            keys[i] = (self.cost(load, w, fetch_s, addon_bytes, load_now), w.n_jobs)
            best_cost = min(best_cost, keys[i][0])
        return order[min(keys, key=lambda i: (keys[i], i))].worker_id


POLICIES = ("round_robin", "least_requests", "least_masked_tokens", "mask_aware")
# Ablations, not settings: ``mask_aware_marginal`` also charges the delay the new job inflicts on
# the jobs it shares steps with (marginal cost = own finish time + others' extra time).
POLICY_VARIANTS = ("mask_aware_marginal", "mask_aware_fetch", "mask_aware_unloaded")
COLD_PRICES = ("loaded", "unloaded", "fetch")


def make_policy(name: str, model: CostModel | None = None, *, size_slack: float | None = None) -> RoutingPolicy:
    """A policy by name (``mask_aware`` needs a cost model); ``size_slack`` None = ``ROUTING_SIZE_SLACK``."""
    slack = ROUTING_SIZE_SLACK if size_slack is None else size_slack
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_requests":
        return LeastRequestsRouter(size_slack=slack)
    if name == "least_masked_tokens":
        return LeastMaskedTokensRouter(model, size_slack=slack)
    if name == "mask_aware":
        if model is None:
            raise ValueError("mask_aware routing needs a cost model (run `python -m ops.bench.profile`)")
        return MaskAwareRouter(model, size_slack=slack, cache_steps=cache_steps_setting())
    if name in POLICY_VARIANTS:
        if model is None:
            raise ValueError("mask_aware routing needs a cost model (run `python -m ops.bench.profile`)")
        variant = name.removeprefix("mask_aware_")
        router = MaskAwareRouter(model, externality=1.0 if variant == "marginal" else 0.0,
                                 cold_price=variant if variant in COLD_PRICES else "loaded", size_slack=slack,
                                 cache_steps=cache_steps_setting())
        router.name = name
        return router
    raise ValueError(f"unknown routing policy {name!r}; known: {list(POLICIES)}")


def make_router(policy: str, worker_ids: list[str], model: CostModel | None = None, *,
                size_slack: float | None = None) -> RoutingPolicy:
    """Kept for callers of the old API: validates the worker list, then ``make_policy``."""
    if not worker_ids:
        raise ValueError("no GPU workers configured (STENCIL_GPU_WORKERS)")
    return make_policy(policy, model, size_slack=size_slack)


__all__ = [
    "JobDemand", "JobLoad", "LeastMaskedTokensRouter", "LeastRequestsRouter", "MaskAwareRouter", "POLICIES",
    "POLICY_VARIANTS", "RoundRobinRouter", "Router", "RoutingPolicy", "WorkerState", "WorkerView", "make_policy",
    "make_router",
]
