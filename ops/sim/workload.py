"""Simulated workload: Poisson arrivals, trace mask ratios, templates, deadlines.

Capacity is what a cluster of continuously batching workers completes per second at saturation
(every worker always running a full batch of jobs drawn from the trace): with the linear step
model a worker finishes ``B / (steps * (intercept + B * E[job step seconds]))`` jobs per second.
``load`` scales the arrival rate to that capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from app.costmodel import CostModel, min_service_seconds
from ops.sim.traces import load_trace


@dataclass
class WorkloadSpec:
    trace: str
    load: float  # fraction of cluster capacity
    workers: int
    jobs: int = 2000
    steps: int = 30
    max_batch: int = 8
    uncached_fraction: float = 0.05  # templates never warmed: full compute
    templates: int = 200
    zipf: float = 1.1
    slo_factor: float = 10.0  # deadline = arrival + factor * (job alone on an idle worker)
    prepare_s: float = 0.0  # CPU stage before the job reaches its GPU worker
    finalize_s: float = 0.0
    seed: int = 0


@dataclass
class SimJob:
    index: int
    arrival: float
    ratio: float
    steps: int
    cached: bool
    template_id: str
    masked_tokens: tuple[int, ...]
    deadline: float
    alone_s: float
    worker: str = ""
    finish: float | None = None
    expired: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    latent_hw: tuple[int, int] | None = None  # mixed sizes (None: the cost model's size)
    rows: int = 2
    hard_deadline: bool = True  # False: a default SLO deadline (soft: never expires the job)

    @property
    def job_id(self) -> str:
        return f"j{self.index}"


def job_step_seconds(model: CostModel, ratio: float, cached: bool) -> float:
    return model.job_seconds(mask_ratio=ratio, cached=cached)


def capacity(model: CostModel, spec: WorkloadSpec, samples: int = 20000, batch_exponent: float = 1.0) -> float:
    """Jobs per second of the whole cluster at saturation (module docstring); ``batch_exponent`` as
    ``ClusterConfig.batch_exponent`` (a full batch's step costs ``B ** exponent`` job steps)."""
    rng = np.random.default_rng(spec.seed + 17)
    trace = load_trace(spec.trace)
    ratios = trace[rng.integers(0, len(trace), samples)]
    cached = rng.random(samples) >= spec.uncached_fraction
    ratios = ratios[ratios > 0.0]  # empty masks never reach a GPU worker
    cached = cached[: len(ratios)]
    mean_g = float(np.mean([job_step_seconds(model, r, c) for r, c in zip(ratios, cached)]))
    per_worker = spec.max_batch / (spec.steps * (model.intercept + spec.max_batch ** batch_exponent * mean_g))
    return spec.workers * per_worker


def generate(model: CostModel, spec: WorkloadSpec, *, cluster_capacity: float | None = None,
             alone_seconds: Callable[[float, bool, int], float] | None = None) -> list[SimJob]:
    """Jobs with Poisson arrivals at ``load * capacity``; deterministic for a seed. When the step times
    are not the model's (a measured GPU curve), ``cluster_capacity`` (jobs/s) and ``alone_seconds(ratio,
    cached, steps)`` give the true ones; by default both come from ``model``."""
    rng = np.random.default_rng(spec.seed)
    rate = spec.load * (capacity(model, spec) if cluster_capacity is None else cluster_capacity)
    trace = load_trace(spec.trace)
    gaps = rng.exponential(1.0 / rate, spec.jobs)
    arrivals = np.cumsum(gaps)
    ratios = trace[rng.integers(0, len(trace), spec.jobs)]
    cached_draw = rng.random(spec.jobs) >= spec.uncached_fraction
    ranks = np.arange(1, spec.templates + 1, dtype=np.float64)
    popularity = ranks ** -spec.zipf
    popularity /= popularity.sum()
    templates = rng.choice(spec.templates, size=spec.jobs, p=popularity)
    jobs = []
    for i in range(spec.jobs):
        ratio = float(ratios[i])
        cached = bool(cached_draw[i]) and ratio < 1.0
        alone = (min_service_seconds(model, spec.steps, mask_ratio=ratio, cached=cached) if alone_seconds is None
                 else alone_seconds(ratio, cached, spec.steps))
        total_alone = alone + spec.prepare_s + spec.finalize_s
        jobs.append(SimJob(index=i, arrival=float(arrivals[i]), ratio=ratio, steps=spec.steps, cached=cached,
                           template_id=f"t{int(templates[i])}", masked_tokens=model.arch.tokens_from_ratio(ratio),
                           deadline=float(arrivals[i]) + spec.slo_factor * total_alone, alone_s=total_alone))
    return jobs


@dataclass(frozen=True)
class MixedArrival:
    """One job of a mixed-size trace: when it arrives, its size (width, height in pixels), its mask
    ratio and the seed of its mask's shape."""

    index: int
    arrival: float
    size: tuple[int, int]
    ratio: float
    seed: int


def mixed_arrivals(sizes: list[tuple[int, int]], weights: list[float], trace: str, rate: float, jobs: int,
                   seed: int) -> list[MixedArrival]:
    """Poisson arrivals at ``rate`` jobs/s; each job's size drawn from ``sizes`` with ``weights``, its
    mask ratio from the trace's non-empty masks (an empty mask never reaches a GPU worker: ``prepare``
    returns the template). Deterministic for a seed: the real run and the simulator replay the same."""
    rng = np.random.default_rng(seed)
    ratios = load_trace(trace)
    ratios = ratios[ratios > 0.0]
    p = np.asarray(weights, dtype=np.float64)
    p /= p.sum()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, jobs))
    picks = rng.choice(len(sizes), size=jobs, p=p)
    draws = ratios[rng.integers(0, len(ratios), jobs)]
    seeds = rng.integers(0, 1 << 30, jobs)
    return [MixedArrival(i, float(arrivals[i]), tuple(sizes[int(picks[i])]), float(draws[i]), int(seeds[i]))  # type: ignore[arg-type]
            for i in range(jobs)]
