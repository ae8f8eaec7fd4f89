"""Continuous vs static batching as a function of how sublinear a batched step is (simulated).

Why: on this CPU a denoising step of B jobs costs about B single steps (``ops/bench/batch_curve.py``:
a batch of 4 saves 3-9%), and the end-to-end benchmark finds continuous batching only 1-9% below
static batching in P95. This asks the production ``BatchScheduler`` (in ``ops/sim/cluster.py``, both
modes) what the gap is when a batched step is cheaper, so the measured number can be placed: the
step cost of B full-compute jobs is ``intercept + B ** exponent * job seconds`` (exponent 1: linear,
as fitted here; 0: a batch costs one job, the ideal GPU regime). Arrival rates are fractions of the
static-batching capacity at the largest batch under the same exponent, so both modes see the same
load. Deterministic for its seeds.

    python -m ops.bench.batching_sim --out docs/bench/batching_sim.md
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable

import numpy as np

from app.costmodel import CostModel
from app.routing import make_policy
from ops.bench.harness import cli
from ops.sim import gpu_costs
from ops.sim.cluster import Cluster, ClusterConfig
from ops.sim.workload import WorkloadSpec, capacity, generate

log = logging.getLogger(__name__)


def cpu_exponent(gain_at_b: float, batch: int) -> float:
    """The exponent whose batch of ``batch`` is ``gain_at_b`` times cheaper than ``batch`` single steps."""
    return 1.0 - math.log(gain_at_b) / math.log(batch)


def p95_of(model: CostModel, *, trace: str, workers: int, max_batch: int, steps: int, jobs: int, load: float,
           exponent: float, batching: str, seed: int, curve: Callable[[float], float] | None = None
           ) -> dict[str, float]:
    """P95 and mean latency of GPU-bound jobs (empty masks never reach a worker) after a 10% warm-up;
    ``curve``: a measured step time by job count in place of the exponent's cost (every job full compute)."""
    spec = WorkloadSpec(trace=trace, load=1.0, workers=workers, jobs=jobs, steps=steps, max_batch=max_batch,
                        uncached_fraction=1.0, seed=seed)
    static_capacity = (workers * max_batch / (steps * curve(max_batch)) if curve is not None
                       else capacity(model, spec, batch_exponent=exponent))
    spec.load = load * static_capacity / capacity(model, spec)
    sim_jobs = generate(model, spec)
    cfg = ClusterConfig(workers=workers, max_batch=max_batch, noise=0.03, seed=seed, batching=batching,
                        batch_exponent=exponent,
                        step_cost=(lambda batch: curve(len(batch))) if curve is not None else None)
    Cluster(model, cfg, make_policy("least_requests", model)).run(sim_jobs)
    lat = np.array([j.finish - j.arrival for j in sim_jobs[len(sim_jobs) // 10:]  # type: ignore[operator]
                    if j.ratio > 0 and j.finish is not None])
    return {"p95": float(np.percentile(lat, 95)), "mean": float(lat.mean())}


def table(model: CostModel, args: argparse.Namespace) -> str:
    exps: list[tuple[str, float, Callable[[float], float] | None]] = [
        (f"{e:.2f} (this CPU)" if i == 0 else f"{e:.2f}", e, None) for i, e in enumerate(args.exponents)]
    if args.gpu_costs:
        measured = gpu_costs.load(args.gpu_costs)
        exps.append((f"measured: {measured.label}", 1.0, measured.step_seconds))
    lines = ["| step cost exponent | batch of 4 vs 4 single steps | load | static P95 s | continuous P95 s "
             "| continuous vs static P95 | static mean s | continuous mean s |", "|---|---|---|---|---|---|---|---|"]
    for label, e, curve in exps:
        for load in args.loads:
            res = {mode: [p95_of(model, trace=args.trace, workers=args.workers, max_batch=args.max_batch,
                                 steps=args.steps, jobs=args.jobs, load=load, exponent=e, batching=mode, seed=s,
                                 curve=curve)
                          for s in args.seeds] for mode in ("static", "continuous")}
            st = {k: float(np.mean([r[k] for r in res["static"]])) for k in ("p95", "mean")}
            co = {k: float(np.mean([r[k] for r in res["continuous"]])) for k in ("p95", "mean")}
            cut = 1 - co["p95"] / st["p95"]
            log.info("%s, load %.1f: static P95 %.2f s, continuous %.2f s (%.0f%% lower)",
                     label, load, st["p95"], co["p95"], cut * 100)
            b = args.max_batch
            gain = curve(b) / (b * curve(1)) if curve else b ** e / b
            lines.append(f"| {label} | {gain:.2f}x | {load:.1f} | {st['p95']:.2f} | "
                         f"{co['p95']:.2f} | {cut * 100:.0f}% lower | {st['mean']:.2f} | {co['mean']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/batching_sim.md", threads=None, seed=None)
    p.add_argument("--cost-model", default="ops/sim/costmodels/tiny-sd-inpaint--cpu-1t.json")
    p.add_argument("--trace", default="spring_festival")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--cpu-gain", type=float, default=1.07,
                   help="measured: stencil-full jobs/s at batch 4 over batch 1 (docs/bench/e2e)")
    p.add_argument("--exponents", type=float, nargs="*", default=None,
                   help="step cost exponents after this CPU's (default 0.75 0.5 0.25 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--gpu-costs", default=str(gpu_costs.DEFAULT_FILE.relative_to(gpu_costs.COSTMODELS.parents[2])),
                   help="also a row on a GPU step curve measured on the card (ops/sim/gpu_costs.py; '' = none): its "
                        "seconds replace the cost model's, so its latencies are the GPU's")
    run = cli.start(p, argv, __file__, quick=dict(jobs=200, loads=[0.9], seeds=[0], exponents=[0.0]))
    args = run.args
    args.exponents = [cpu_exponent(args.cpu_gain, args.max_batch)] + (
        args.exponents if args.exponents is not None else [0.75, 0.5, 0.25, 0.0])
    text = table(CostModel.load(args.cost_model), args)
    run.write(
        "# Continuous vs static batching by batch-cost shape (simulated)\n\n"
        f"Command: `{run.command}`. Production `BatchScheduler` in both modes, full compute, {args.workers} workers, "
        f"max batch {args.max_batch}, {args.steps} steps, least-requests routing, mask ratios of the `{args.trace}` "
        "trace; load = fraction of the static-batching capacity at the largest batch under the same cost "
        f"shape; mean of {len(args.seeds)} seeds of {args.jobs} jobs. The first row's exponent is this CPU's, "
        f"from its measured batch-of-4 gain ({args.cpu_gain}x)."
        + (" The last row's step is the GPU curve measured on the card, full compute "
           f"({gpu_costs.describe(gpu_costs.load(args.gpu_costs))}): its latencies are that GPU's seconds."
           if args.gpu_costs else "") + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
