"""Routing decision latency with many workers: the policy alone, and the dispatcher's view refresh.

A realistic busy cluster: every worker runs a nearly full batch (trace mask ratios, random
remaining steps), has a short waiting queue and a job in flight, and holds some templates.
``policy_latency`` times ``choose`` on fresh worker states (published state is re-parsed at every
refresh, so per-job memos start cold, as in the dispatcher). ``refresh_latency`` times
``LiveWorkerView.refresh`` (one pipelined HGETALL of all worker hashes + parsing) on a real Redis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np

from app.costmodel import CostModel
from app.routing import JobDemand, JobLoad, WorkerState, WorkerView, make_policy
from ops.sim.traces import load_trace


def _jobs(rng: np.random.Generator, trace: np.ndarray, n: int, steps: int, prefix: str) -> list[JobLoad]:
    return [JobLoad(f"{prefix}{k}", int(rng.integers(1, steps + 1)), float(trace[rng.integers(0, len(trace))]),
                    cached=bool(rng.random() > 0.05), template_id=f"t{int(rng.integers(0, 200))}") for k in range(n)]


def busy_view(workers: int, rng: np.random.Generator, *, max_batch: int = 8, steps: int = 30,
              trace: str = "controlnet") -> WorkerView:
    ratios = load_trace(trace)
    states = []
    for w in range(workers):
        states.append(WorkerState(
            str(w), running=_jobs(rng, ratios, max_batch - int(rng.integers(0, 2)), steps, f"r{w}."),
            waiting=_jobs(rng, ratios, int(rng.integers(0, 3)), steps, f"w{w}."),
            inflight=_jobs(rng, ratios, int(rng.integers(0, 2)), steps, f"i{w}."),
            templates=frozenset(f"t{int(t)}" for t in rng.integers(0, 200, 16)), max_batch=max_batch,
            updated=time.time()))
    return WorkerView(states)


def reparsed(view: WorkerView, rng: np.random.Generator) -> WorkerView:
    """The same cluster a few steps later, as a refresh re-parses it: new objects (no per-object
    memos), same jobs with fewer remaining steps, a few replaced by newly routed ones."""
    def again(jobs: list[JobLoad]) -> list[JobLoad]:
        out = []
        for j in jobs:
            if rng.random() < 0.1:
                j = JobLoad(f"{j.job_id}+", int(rng.integers(20, 31)), float(rng.uniform(0.001, 0.999)),
                            cached=j.cached, template_id=j.template_id)
            out.append(JobLoad(j.job_id, max(1, j.remaining - int(rng.integers(0, 3))), j.mask_ratio,
                               cached=j.cached, template_id=j.template_id))
        return out

    return WorkerView(WorkerState(w.worker_id, again(w.running), again(w.waiting), again(w.inflight), w.templates,
                                  max_batch=w.max_batch, updated=w.updated) for w in view.workers.values())


def quantiles(samples: list[float], cpu: list[float] | None = None) -> dict[str, float]:
    """Wall-time quantiles (ms); with ``cpu``, the thread-CPU-time quantiles too (a loaded
    machine preempts the process: CPU time shows the decision's own cost)."""
    xs = np.array(samples) * 1e3
    out = {"p50_ms": float(np.percentile(xs, 50)), "p99_ms": float(np.percentile(xs, 99)),
           "max_ms": float(xs.max()), "n": float(len(xs))}
    if cpu:
        cs = np.array(cpu) * 1e3
        out.update(cpu_p50_ms=float(np.percentile(cs, 50)), cpu_p99_ms=float(np.percentile(cs, 99)))
    return out


def policy_latency(model: CostModel, policy: str, *, workers: int = 64, decisions: int = 2000,
                   seed: int = 0, fresh_every: int = 20) -> dict[str, float]:
    """Seconds per ``choose``; the view is rebuilt every ``fresh_every`` decisions (cold memos)."""
    rng = np.random.default_rng(seed)
    router = make_policy(policy, model)
    ratios = load_trace("controlnet")
    for r in ratios:  # jobs at the workers were routed (and their costs memoized) by this dispatcher
        model.job_seconds(mask_ratio=float(r))
    samples, cpu = [], []
    base = busy_view(workers, rng)
    view = base
    for i in range(decisions):
        if i % fresh_every == 0:
            view = reparsed(base, rng)
        # A new job: a ratio never seen before (its cost is computed inside the decision).
        job = JobDemand(f"n{i}", 30, float(rng.uniform(0.001, 0.999)), template_id=f"t{i % 200}")
        c0, start = time.thread_time(), time.perf_counter()
        router.choose(job, view)
        samples.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - c0)
    return quantiles(samples, cpu)


def publish_view(client: object, view: WorkerView) -> None:
    """Write ``view`` as the engines would (``RedisEngineHooks._state`` fields)."""
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]

    def enc(jobs: list[JobLoad]) -> str:
        return json.dumps([{"job_id": j.job_id, "mask_ratio": j.mask_ratio, "remaining": j.remaining,
                            "cached": j.cached, "template_id": j.template_id} for j in jobs])

    for w in view.workers.values():
        pipe.hset(f"stencil:worker:{w.worker_id}", mapping={
            "running": enc(w.running), "waiting": enc(w.waiting), "updated": repr(time.time()),
            "last_step_seconds": "0.5", "max_batch": str(w.max_batch), "templates": json.dumps(sorted(w.templates))})
    pipe.execute()


def refresh_latency(client: object, workers: int = 64, rounds: int = 300, seed: int = 0,
                    make_view: Callable[..., object] | None = None) -> dict[str, float]:
    """Seconds per forced ``LiveWorkerView.refresh`` of ``workers`` hashes on a real Redis."""
    from app.dispatcher import LiveWorkerView

    publish_view(client, busy_view(workers, np.random.default_rng(seed)))
    live = (make_view or LiveWorkerView)(client, [str(w) for w in range(workers)], max_batch=8)
    samples, cpu = [], []
    for _ in range(rounds):
        c0, start = time.thread_time(), time.perf_counter()
        live.refresh(force=True)
        samples.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - c0)
    return quantiles(samples, cpu)
