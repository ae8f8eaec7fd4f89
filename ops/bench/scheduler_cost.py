"""What SLO-aware admission costs per scheduling pass, trying the queue a chunk at a time or whole.

Why: the engine schedules between steps on its own thread, so a scheduling pass is time the device
waits. SLO admission asks the step-time predictor whether each candidate would make a running job
miss its deadline; it used to ask about every waiting job at every admission of a pass, so under a
long queue a pass grew with the queue. ``AdmissionTrials`` (``workers/engine/scheduler.py``) asks
a chunk of candidates at a time, in the order admission walks them. This benchmark runs the same
overloaded trace through one simulated worker (``ops/sim/cluster.py``, the production
``BatchScheduler`` with the CPU-fitted resolution-aware predictor, mixed sizes) both ways, in
alternating order, times every ``schedule()`` call on the wall clock, and checks that both ways made
the same decisions (every job's finish time equal).
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import numpy as np

from app.calibration import STEP_TIME_CALIBRATION
from app.costmodel import CostModel, step_time_predictor
from app.routing import make_policy
from app.settings import Settings
from ops.bench.harness import cli
from ops.sim.cluster import Cluster, ClusterConfig
from ops.sim.mixed import ShapeJob, capacity, job_shape, parse_sizes, sim_jobs
from ops.sim.workload import mixed_arrivals
from workers.engine.scheduler import SIZE_AFFINITY_STEPS

log = logging.getLogger(__name__)
WAYS = {"chunked": None, "whole queue": 10**9}  # BatchScheduler.admission_chunk


def run_once(cost: CostModel, args: argparse.Namespace, load: float, chunk: int | None) -> dict[str, Any]:
    """One replay of the trace at ``load``; per-pass wall times, queue lengths and each job's finish."""
    sizes, weights = parse_sizes(args.sizes)
    step_cost = step_time_predictor(cost)  # the CPU-fitted resolution-aware predictor (as mixed_sizes' cpu-fitted)
    predictor = cost.batch
    assert predictor is not None
    probe = mixed_arrivals(sizes, weights, args.trace, 1.0, 400, args.seed + 1000)
    cap = capacity(lambda shapes: step_cost([ShapeJob(s) for s in shapes]),
                   [job_shape(a, None, predictor, cost) for a in probe], args.max_batch, args.steps, args.seed)
    arrivals = mixed_arrivals(sizes, weights, args.trace, load * cap, args.jobs, args.seed)
    jobs = sim_jobs(arrivals, predictor, cost, args, step_cost)
    cfg = ClusterConfig(workers=1, max_batch=args.max_batch, slo_admission=True, noise=0.03, seed=args.seed,
                        step_cost=step_cost, step_time=step_cost, host_templates=64,
                        size_affinity_steps=SIZE_AFFINITY_STEPS, size_switch="drain",
                        step_time_calibration=STEP_TIME_CALIBRATION)
    cluster = Cluster(cost, cfg, make_policy("least_requests", cost))
    passes: list[float] = []
    queue: list[int] = []
    scheduler = cluster.workers[0].sched
    inner = scheduler.schedule

    def timed() -> Any:
        start = time.perf_counter()
        out = inner()
        passes.append(time.perf_counter() - start)
        queue.append(len(scheduler.waiting))
        return out

    scheduler.schedule = timed  # type: ignore[method-assign]
    scheduler.admission_chunk = chunk
    cluster.run(jobs)
    return {"passes": passes, "queue": queue, "finish": [j.finish for j in jobs],
            "slo": float(np.mean([j.finish is not None and j.finish <= j.deadline for j in jobs]))}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/scheduler_cost.md")
    p.add_argument("--cost-model", default="ops/sim/costmodels/tiny-sd-inpaint-trained--cpu-1t-mixed.json")
    p.add_argument("--sizes", default="128x128:0.4,96x128:0.25,128x96:0.15,128x64:0.2")
    p.add_argument("--trace", default="spring")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-batch", type=int, default=Settings().max_batch)
    p.add_argument("--slo-factor", type=float, default=Settings().slo_factor)
    p.add_argument("--loads", type=float, nargs="+", default=[1.0, 1.4, 2.0])
    p.add_argument("--jobs", type=int, default=400, help="jobs per load (one worker)")
    p.add_argument("--rounds", type=int, default=3, help="replays per way and load, the order alternating")
    run = cli.start(p, argv, __file__, quick=dict(loads=[1.4], jobs=40, rounds=1))
    args = run.args
    cost = CostModel.load(args.cost_model)
    if cost.batch is None:
        p.error(f"{args.cost_model} has no batch step-time predictor: fit one with `stencil profile --sizes`")
    lines = ["# SLO admission: scheduling pass cost, trying the queue a chunk at a time or whole", "",
             f"Command (from the repository root): `{run.command}`", "",
             f"One simulated worker (`ops/sim/cluster.py`, production `BatchScheduler`, SLO admission on, the "
             f"CPU-fitted predictor `{args.cost_model}` as step cost and predictor), {args.jobs} jobs per load of "
             f"sizes {args.sizes}, {args.steps} steps, max batch {args.max_batch}, deadlines {args.slo_factor:g} x "
             f"standalone; load = arrival rate over one worker's predicted capacity. Wall time of every "
             f"`schedule()` call, {args.rounds} replays per way, the order alternating; both ways must decide the "
             "same (every job's finish time equal).", "",
             "| load | way | passes | waiting jobs mean / max | pass ms mean | P90 | max | SLO satisfaction | "
             "same decisions |", "|---|---|---|---|---|---|---|---|---|"]
    for load in args.loads:
        results: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
        for r in range(args.rounds):
            order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
            for way in order:
                results[way].append(run_once(cost, args, load, WAYS[way]))
        reference = results["whole queue"][0]["finish"]
        for way, runs in results.items():
            ms = np.concatenate([np.array(x["passes"]) * 1e3 for x in runs])
            queue = np.concatenate([np.array(x["queue"]) for x in runs])
            same = all(x["finish"] == reference for x in runs)
            lines.append(f"| {load:.2f} | {way} | {len(runs[0]['passes'])} | {queue.mean():.0f} / {queue.max()} | "
                         f"{ms.mean():.2f} | {np.percentile(ms, 90):.2f} | {ms.max():.1f} | "
                         f"{runs[0]['slo'] * 100:.1f}% | {'yes' if same else '**no**'} |")
            log.info("load %.2f %s: pass %.2f ms mean, same decisions %s", load, way, ms.mean(), same)
    run.write(lines + [""])
    log.info("done in %.0f s", run.elapsed())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
