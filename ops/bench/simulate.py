"""Cluster simulator for dispatch policies (8-64 GPU workers), from the fitted cost model.

    python -m ops.bench.simulate --cost-model ops/sim/costmodels/<model>--<device>.json \
        --workers 8 64 --loads 0.3 0.5 0.7 0.8 0.9 --out docs/bench/dispatch.md

Runs the production routing policies and ``BatchScheduler`` (ops/sim/cluster.py) on Poisson
arrivals whose mask ratios come from each public trace, at loads relative to the cluster's
capacity, and reports mean / P95 latency and SLO attainment per policy (tables and PNG plots
into the markdown report's ``sim`` section and ``docs/bench/``). ``--slo-study`` adds runs with
SLO-aware admission on; ``--decision-bench`` measures routing decision latency with 64 workers.
``--references ideal_pooled central_fcfs`` adds ideal reference clusters run on the same jobs
(``ops/sim/bounds.py``); ``--prepare-s`` and ``--view-refresh-ms`` model the CPU prepare stage and
the dispatcher's view refresh (the same for every policy).
Deterministic for a seed (step-time noise and arrivals are seeded; no wall clock is read by the
simulation itself).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from app.costmodel import CostModel
from app.routing import POLICIES, POLICY_VARIANTS, make_policy
from ops.bench.harness import TRACES, cli
from ops.bench.harness.report import finish_axes, pyplot, replace_section, save_figure
from ops.sim import gpu_dispatch
from ops.sim.bounds import REFERENCES, apply_reference
from ops.sim.cluster import Cluster, ClusterConfig
from ops.sim.gpu_dispatch import GpuDispatchCosts
from ops.sim.report import policy_table, summarize
from ops.sim.workload import WorkloadSpec, capacity, generate

log = logging.getLogger(__name__)


def case_costs(case: dict[str, Any]) -> tuple[CostModel, GpuDispatchCosts | None]:
    """The routing cost model of a case and, with ``gpu_costs``, the measured GPU step times (whose
    linear fit is then the routing model; ``ops/sim/gpu_dispatch.py``)."""
    if not case.get("gpu_costs"):
        return CostModel.load(case["cost_model"]), None
    gpu = gpu_dispatch.load(case["gpu_costs"], str(case["cost_model"]), case.get("masked_work", "tokens"),
                            case["max_batch"], case.get("router_step"))
    return gpu.model, gpu


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One simulation: (cost model, trace, workers, load, policy, slo_admission) -> stats."""
    model, gpu = case_costs(case)
    prepare_s = case.get("prepare_s", 0.0)
    spec = WorkloadSpec(trace=case["trace"], load=case["load"], workers=case["workers"], jobs=case["jobs"],
                        steps=case["steps"], max_batch=case["max_batch"], slo_factor=case["slo_factor"],
                        uncached_fraction=case["uncached_fraction"], prepare_s=prepare_s, seed=case["seed"])
    cap = capacity(model, spec) if gpu is None else gpu.capacity(spec.trace, spec.workers, spec.steps,
                                                                 spec.uncached_fraction, spec.seed)
    jobs = generate(model, spec, cluster_capacity=cap, alone_seconds=gpu.alone_seconds if gpu else None)
    start = time.perf_counter()
    if case["policy"] in REFERENCES:  # not a router: what an ideal cluster does with the same jobs
        if prepare_s:
            raise ValueError("reference clusters assume prepare_s = 0")
        apply_reference(case["policy"], jobs, case["workers"], case["max_batch"],
                        pooled_step=gpu.pooled_step if gpu else None)
        stats = summarize(jobs)
        stats["decision_p99_ms"], stats["utilization"], steps = 0.0, float("nan"), 0
    else:
        cfg = ClusterConfig(workers=case["workers"], max_batch=case["max_batch"], slo_admission=case["slo_admission"],
                            noise=case["noise"], host_templates=case["host_templates"], prepare_s=prepare_s,
                            view_refresh_s=case.get("view_refresh_s", 0.0), seed=case["seed"],
                            step_cost=gpu.step_cost if gpu else None, step_cost_fetch=gpu is not None)
        cluster = Cluster(model, cfg, make_policy(case["policy"], model))
        cluster.run(jobs)
        stats = summarize(jobs)
        decisions = sorted(cluster.decision_s)
        stats["decision_p99_ms"] = decisions[int(0.99 * (len(decisions) - 1))] * 1e3 if decisions else 0.0
        stats["utilization"] = sum(w.busy_s for w in cluster.workers) / (len(cluster.workers) * max(
            j.finish for j in jobs if j.finish is not None))  # type: ignore[type-var]
        steps = cluster.steps
    wall = time.perf_counter() - start
    stats["floor_p95_s"] = service_floor_p95(jobs)
    out = {k: case[k] for k in ("trace", "workers", "load", "policy", "slo_admission", "seed")}
    out.update(stats=stats, capacity_jobs_s=cap, wall_s=wall, steps=steps)
    log.info("%-11s %2d workers load %.0f%% %-20s slo=%d: mean %.2f s P95 %.2f s SLO %.1f%% expired %d (%.1f s)",
             case["trace"], case["workers"], case["load"] * 100, case["policy"], case["slo_admission"],
             stats["mean_s"], stats["p95_s"], stats["slo_attainment"] * 100, stats["expired"], wall)
    return out


def service_floor_p95(jobs: list[Any]) -> float:
    """P95 of the measured jobs' time alone on an idle worker: no policy's P95 can be lower."""
    measured = [j.alone_s if j.ratio > 0 else 0.0 for j in jobs if j.index >= int(len(jobs) * 0.1)]
    return float(np.percentile(measured, 95)) if measured else float("nan")


def jobs_for(args: argparse.Namespace, workers: int) -> int:
    """Jobs per run: at least ``--min-jobs`` (small clusters need more for a stable P95)."""
    return max(args.jobs_per_worker * workers, args.min_jobs)


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Average every statistic over the seeds of each (trace, workers, load, policy, slo) case."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["trace"], r["workers"], r["load"], r["policy"], r["slo_admission"]), []).append(r)
    out = []
    for rs in groups.values():
        merged = dict(rs[0])
        merged["stats"] = {k: sum(r["stats"][k] for r in rs) / len(rs) for k in rs[0]["stats"]}
        merged["seeds"] = [r["seed"] for r in rs]
        out.append(merged)
    return out


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [dict(c, seed=seed) for seed in args.seeds for c in _cases(args)]


def _cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {"cost_model": str(args.cost_model), "gpu_costs": args.gpu_costs, "masked_work": args.masked_work,
            "router_step": args.router_step, "steps": args.steps, "max_batch": args.max_batch,
            "slo_factor": args.slo_factor, "uncached_fraction": args.uncached_fraction, "noise": args.noise,
            "host_templates": args.host_templates, "prepare_s": args.prepare_s,
            "view_refresh_s": args.view_refresh_ms / 1000.0, "seed": 0}
    out = []
    for workers in args.workers:
        for trace in args.traces:
            for load in args.loads:
                for policy in list(args.policies) + list(args.references):
                    out.append(dict(base, trace=trace, workers=workers, load=load, policy=policy,
                                    slo_admission=False, jobs=jobs_for(args, workers)))
    if args.slo_study:
        for workers in args.workers:
            for trace in args.traces:
                for load in args.slo_loads:
                    for policy in ("least_requests", "mask_aware"):
                        for slo in (False, True):
                            case = dict(base, trace=trace, workers=workers, load=load, policy=policy,
                                        slo_admission=slo, jobs=jobs_for(args, workers))
                            if slo or case not in out:
                                out.append(case)
    return out


def shown_policies(args: argparse.Namespace) -> list[str]:
    """Policies in the canonical order, then variants and reference clusters as given."""
    known = [p for p in POLICIES if p in args.policies]
    return known + [p for p in args.policies if p not in known] + list(args.references)


def render(results: list[dict[str, Any]], args: argparse.Namespace, model: CostModel, plots: list[str]) -> str:
    policies = shown_policies(args)
    view_text = (f"worker state re-read at most every {args.view_refresh_ms:g} ms" if args.view_refresh_ms
                 else "every publish at once")
    if args.prepare_s:
        view_text += f", prepare stage {args.prepare_s:g} s (routed jobs are counted in flight meanwhile)"
    what = "projected" if model.meta.get("projected") else "fitted"
    gpu: GpuDispatchCosts | None = getattr(args, "gpu", None)
    title = (f"## Cluster simulation on the measured `{args.gpu_costs}` step costs ({args.masked_work})" if gpu
             else f"## Cluster simulation with the {what} `{model.model_id}` cost model")
    lines = [
        title, "",
        "Command (from the repo root):", "", "```", args.command, "```", "",
        f"- Step times: {gpu.describe()}. Masked work priced on `{args.cost_model}`'s architecture; template "
        "fetches from its load tiers." if gpu else
        f"- Cost model: `{args.cost_model}` ({model.model_id} on {model.device_kind}; step fit held-out "
        f"R^2 {model.step_report.r2_test:.3f}, MAPE {model.step_report.mape_test * 100:.1f}%)."
        if model.step_report else f"- Cost model: `{args.cost_model}` ({what}; see its section).",
        f"- Workload: Poisson arrivals, {args.jobs_per_worker} jobs per worker, at least {args.min_jobs} per run "
        f"(first 10% are warm-up and not counted), statistics averaged over seeds {args.seeds}, "
        f"{args.steps} steps per job, CFG, max batch {args.max_batch}, continuous batching, "
        f"{args.uncached_fraction:.0%} of jobs on templates without a cache (full compute), 200 templates "
        f"(Zipf 1.1), host-RAM LRU of {args.host_templates} templates per worker, step-time noise "
        f"lognormal sigma {args.noise}.",
        f"- Load = arrival rate / cluster capacity; capacity = jobs per second with every worker running "
        f"full batches of trace jobs. SLO: deadline = arrival + {args.slo_factor:g} x the job's time alone "
        "on an idle worker; attainment = share of jobs finished by their deadline.",
        f"- Dispatcher view: {view_text}; every policy sees the same view.",
        "- Cells: mean / P95 latency (arrival to denoised) / SLO attainment.",
        *(["- References (not routers; `ops/sim/bounds.py`, same jobs, each job's time alone): `ideal_pooled` = the "
           "cluster as one perfectly balanced " + (
               "pool with migration whose workers each run 1/workers of the present jobs (fractional, up to max "
               "batch) at the curve's step time for that share, every job one step per step" if gpu
               else "processor-sharing pool with migration (up to max batch jobs per worker") + ", "
           "no job faster than alone); `central_fcfs` = one central FCFS queue, one job per worker. Service floor "
           "P95 = P95 of each job's time alone on an idle worker."] if args.references else []), ""]
    for workers in args.workers:
        for trace in args.traces:
            lines += [f"### {trace}, {workers} workers", "", policy_table(results, workers, trace, policies), ""]
    for p in plots:
        lines += [f"![{Path(p).stem}]({Path(p).name})", ""]
    slo_rows = [r for r in results if r.get("slo_admission")]
    if slo_rows:
        lines += ["### SLO-aware admission (dispatcher expiry + engine admission control)", "",
                  "| trace | workers | load | policy | SLO admission | mean | P95 (completed) | SLO attainment | "
                  "expired |", "|---|---|---|---|---|---|---|---|---|"]
        keyed = {(r["trace"], r["workers"], r["load"], r["policy"], r["slo_admission"]): r for r in results}
        for (trace, workers, load, policy, slo), r in sorted(keyed.items()):
            if load not in args.slo_loads or policy not in ("least_requests", "mask_aware"):
                continue
            s = r["stats"]
            lines.append(f"| {trace} | {workers} | {load:.0%} | {policy} | {'on' if slo else 'off'} | "
                         f"{s['mean_s']:.2f} | {s['p95_s']:.2f} | {s['slo_attainment'] * 100:.1f}% | "
                         f"{int(s['expired'])} |")
        lines.append("")
    return "\n".join(lines)


def decision_bench(args: argparse.Namespace, model: CostModel) -> str:
    """Routing decision latency with 64 busy workers (policy only) and the view refresh from a
    private redis-server (one pipelined HGETALL of 64 worker hashes + parsing)."""
    import tempfile

    import redis

    from app.embedded import RedisServer
    from ops.sim.decision import policy_latency, refresh_latency

    rows = ["## Routing decision latency", "", "```", args.command, "```", "",
            f"{args.decision_workers} workers, each with a nearly full batch of `controlnet` jobs (random remaining "
            "steps), 0-2 waiting and 0-1 in flight; the view is re-parsed (fresh objects, cold per-object memos) "
            "every 5 decisions, as a dispatcher refreshing every 50 ms at 100 jobs/s would; each new job has a "
            "never-seen mask ratio. Wall time (this shared 2-core machine preempts the process) and thread CPU "
            "time.", "",
            "| what | p50 ms | p99 ms | max ms | CPU p50 ms | CPU p99 ms | n |", "|---|---|---|---|---|---|---|"]
    for policy in args.policies:
        q = policy_latency(model, policy, workers=args.decision_workers, decisions=5000, fresh_every=5)
        rows.append(f"| `{policy}`.choose | {q['p50_ms']:.3f} | {q['p99_ms']:.3f} | {q['max_ms']:.2f} | "
                    f"{q['cpu_p50_ms']:.3f} | {q['cpu_p99_ms']:.3f} | {int(q['n'])} |")
        log.info("decision %s: %s", policy, q)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            q = refresh_latency(redis.Redis.from_url(server.url), workers=args.decision_workers, rounds=1000)
        finally:
            server.stop()
    rows.append(f"| view refresh (Redis) | {q['p50_ms']:.3f} | {q['p99_ms']:.3f} | {q['max_ms']:.2f} | "
                f"{q['cpu_p50_ms']:.3f} | {q['cpu_p99_ms']:.3f} | {int(q['n'])} |")
    log.info("view refresh: %s", q)
    return "\n".join(rows) + "\n"


def plot_p95(results: list[dict[str, Any]], workers: int, traces: Sequence[str], policies: Sequence[str],
             out: Path, metric: str = "p95_s", ylabel: str = "P95 latency (s)") -> None:
    """One panel per trace: ``metric`` vs load per policy (reference clusters dotted)."""
    fig, axes = pyplot().subplots(1, len(traces), figsize=(4.2 * len(traces), 3.6), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        for p in policies:
            pts = sorted((r["load"], r["stats"][metric]) for r in results
                         if r["workers"] == workers and r["trace"] == trace and r["policy"] == p
                         and not r.get("slo_admission"))
            if pts:
                ref = p in ("ideal_pooled", "central_fcfs")
                ax.plot([x * 100 for x, _ in pts], [y for _, y in pts], marker="" if ref else "o", ms=3, label=p,
                        linestyle=":" if ref else "-", color="0.4" if p == "ideal_pooled" else
                        "0.7" if ref else None)
        ax.set_title(f"{trace}, {workers} workers", fontsize=9)
        finish_axes(ax, "load (% of capacity)", ylabel)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/dispatch.md", threads=None, seed=None)
    p.add_argument("--cost-model", type=Path, default=Path("ops/sim/costmodels/sd-arch-320-640--cpu-1t.json"),
                   help="the fitted cost model (routing and step times; with --gpu-costs: the architecture)")
    p.add_argument("--gpu-costs", default="", metavar="NAME",
                   help="step times from a measured GPU cost file, ops/sim/gpucosts/NAME.json (e.g. "
                        "sd15-inpaint-512--h200-bf16); --cost-model then only gives the architecture that prices "
                        "masked work and the fetch tiers, and routing uses the curve (--router-step)")
    p.add_argument("--masked-work", default="tokens", choices=gpu_dispatch.MASKED_WORK,
                   help="with --gpu-costs: a masked job's work by its share of tokens, or a full job with the step "
                        "stretched by the measured host-bound mask-aware speed")
    p.add_argument("--router-step", default=None, choices=gpu_dispatch.ROUTER_STEPS,
                   help="with --gpu-costs: routing and SLO admission price a step on the measured curve (tokens "
                        "only; its default) or on a linear fit to it (host-bound's default; ops/sim/gpu_dispatch.py)")
    p.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    p.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.8, 0.9])
    p.add_argument("--traces", nargs="+", default=sorted(TRACES))
    p.add_argument("--policies", nargs="+", default=list(POLICIES),
                   help=f"routing policies ({', '.join(POLICIES + POLICY_VARIANTS)})")
    p.add_argument("--references", nargs="*", default=[], choices=sorted(REFERENCES),
                   help="ideal reference clusters run on the same jobs (ops/sim/bounds.py)")
    p.add_argument("--prepare-s", type=float, default=0.0, help="CPU prepare stage before a job reaches its worker")
    p.add_argument("--view-refresh-ms", type=float, default=0.0,
                   help="dispatcher re-reads worker state at most this often (0 = sees every publish)")
    p.add_argument("--jobs-per-worker", type=int, default=150)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--slo-factor", type=float, default=10.0)
    p.add_argument("--uncached-fraction", type=float, default=0.05)
    p.add_argument("--host-templates", type=int, default=32)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="statistics are averaged over seeds")
    p.add_argument("--min-jobs", type=int, default=0, help="at least this many jobs per run")
    p.add_argument("--slo-study", action="store_true")
    p.add_argument("--slo-loads", type=float, nargs="+", default=[0.8, 0.9])
    p.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--plots", type=Path, default=None, help="folder for PNG plots (default: next to --out)")
    p.add_argument("--results", type=Path, default=None, help="raw results JSON")
    p.add_argument("--no-plots", action="store_true", help="tables only (no PNG next to the report)")
    p.add_argument("--tag", default="", help="suffix of plot names (several cost models in one report)")
    p.add_argument("--decision-bench", action="store_true", help="only measure routing decision latency")
    p.add_argument("--render-from", type=Path, default=None,
                   help="raw results JSON of an earlier run (--results): only render the report from it")
    p.add_argument("--decision-workers", type=int, default=64)
    run = cli.start(p, argv, __file__, hide=("--render-from",),  # cite the command that produced the results
                    quick=dict(workers=[8], loads=[0.9], traces=["spring_festival"], jobs_per_worker=25,
                               policies=["least_requests", "mask_aware"], processes=1, decision_workers=8))
    args = run.args
    args.command = run.command
    args.out = Path(args.out) if args.out else None
    try:
        model, gpu = case_costs({"cost_model": args.cost_model, "gpu_costs": args.gpu_costs,
                                 "masked_work": args.masked_work, "max_batch": args.max_batch,
                                 "router_step": args.router_step})
    except ValueError as exc:
        p.error(str(exc))
    args.gpu = gpu
    if args.decision_bench:
        text = decision_bench(args, model)
        if args.out:
            replace_section(args.out, "decision", text)
        return 0
    todo = cases(args)
    log.info("%d simulation runs on %d processes", len(todo), args.processes)
    if args.render_from:
        results = json.loads(args.render_from.read_text())
    elif args.processes > 1:
        with ProcessPoolExecutor(args.processes) as pool:
            results = list(pool.map(run_case, todo))
    else:
        results = [run_case(c) for c in todo]
    if args.results and not args.render_from:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1))
    results = aggregate(results)
    plots: list[str] = []
    if args.out and not args.no_plots:
        folder = args.plots or args.out.parent
        policies = shown_policies(args)
        for workers in args.workers:
            path = folder / f"dispatch_p95_{workers}w{args.tag}.png"
            plot_p95(results, workers, args.traces, policies, path)
            plots.append(str(path))
    if args.out:
        replace_section(args.out, f"sim{args.tag}", render(results, args, model, plots))
        log.info("wrote %s and %d plots", args.out, len(plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
