"""End-to-end benchmark: Stencil against a stock diffusers server and its own baselines.

Replays Poisson arrivals at several request rates, with mask ratios drawn from the public traces
(``ops/data/mask_ratios``) and mask shapes drawn from ``app.maskgen`` (blobs, rectangles,
free-form strokes of the drawn ratio), against five systems on the same machine, one after the
other, each with 2 workers:

1. ``stock``: the diffusers inpainting pipeline called per batch in a plain worker loop (static
   batching, full compute, VAE and text encoder inside the loop), routed round-robin;
2. ``full-static``: Stencil, full compute, static batching;
3. ``full-continuous``: Stencil, full compute, continuous batching;
4. ``maskaware``: Stencil, mask-aware inference, continuous batching, round-robin routing;
5. ``stencil``: all of Stencil as it ships: mask-aware inference with the default routing
   (``mask_aware``; without a cost model fitted for the benchmark's model the dispatcher routes
   with ``least_requests`` and logs it) and the default prefetch from routing on.

Latency, queueing time and phases come from the job records (server timestamps). Writes
``README.md`` (tables, claims), ``e2e.json`` (every job) and PNG plots into ``--out``;
``--from-json`` re-renders them from a saved ``e2e.json``.

    python -m ops.bench.e2e --trace spring --rates 0.9,1.5,2.0 --jobs 20 --out docs/bench/e2e
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from app.demo import demo_templates
from ops.bench.harness import cli, load_trace
from ops.bench.harness.engine import batch_curve, curve_table
from ops.bench.harness.models import saved_sd_pipeline
from ops.bench.harness.openloop import busy_seconds, claims, make_workload, run_rate, summarize
from ops.bench.harness.report import finish_axes, pyplot, rounded, save_figure

log = logging.getLogger(__name__)


SYSTEMS: dict[str, dict[str, object]] = {
    "stock": {"stock": True},
    "full-static": {"mask_aware": False, "batching": "static", "prefetch_steps": 0},
    "full-continuous": {"mask_aware": False, "batching": "continuous"},
    "maskaware": {"mask_aware": True, "batching": "continuous", "routing_policy": "round_robin",
                  "prefetch_steps": 2},
    "stencil": {"mask_aware": True},  # every other setting at its default
}


def run_system(name: str, cfg: dict[str, object], rates: list[float], args: argparse.Namespace,
               model_dir: Path, ratios: np.ndarray, templates: list[Image.Image]) -> dict[str, object]:
    from app.client import StencilClient
    from app.embedded import EmbeddedStack

    cfg = dict(cfg)
    stock = bool(cfg.pop("stock", False))
    workdir = Path(args.workdir) / name
    overrides = dict(model_dir=str(model_dir), max_batch=args.max_batch, **cfg)
    log.info("system %s: starting (%s)", name, overrides)
    with EmbeddedStack.start(workdir, gpu_workers=args.workers, stock=stock, **overrides) as stack:
        client = StencilClient(stack.settings)
        template_ids = [client.add_template(img, f"bench-{i}") for i, img in enumerate(templates)]
        if not stock and stack.settings.mask_aware:
            for tid in template_ids:
                rec = client.warm_template(tid, steps=args.steps, guidance=args.guidance).wait(args.timeout)
                assert rec.status.value == "done", rec.error
        # Warm every process (lazy model loads) outside the measurement.
        warm = make_workload(100.0, 2 * args.workers, ratios, templates, args.steps, seed=1)
        run_rate(client, stock, template_ids, templates, warm, args.guidance, args.timeout)
        results = {}
        for k, rate in enumerate(rates):
            workload = make_workload(rate, args.jobs, ratios, templates, args.steps, seed=100 + k)
            busy0 = busy_seconds(stack)
            rows = run_rate(client, stock, template_ids, templates, workload, args.guidance, args.timeout)
            summary = summarize(rows, busy_seconds(stack) - busy0, args.workers)
            log.info("system %s rate %.3f/s: %s", name, rate, json.dumps({k: round(v, 3) for k, v in summary.items()}))
            results[f"{rate:.4f}"] = {"summary": summary, "rows": rows}
    return results


def table(report: dict) -> str:
    head = "| system | rate (jobs/s) | done | mean s | P50 s | P95 s | P99 s | queueing s | throughput /s | busy |\n"
    head += "|---|---|---|---|---|---|---|---|---|---|\n"
    rows = []
    for name, per_rate in report["results"].items():
        for key in sorted(per_rate, key=float):
            s = per_rate[key]["summary"]
            rows.append(f"| {name} | {float(key):.3f} | {s['done']}/{s['jobs']} | {s['mean']:.2f} | {s['p50']:.2f} | "
                        f"{s['p95']:.2f} | {s['p99']:.2f} | {s['queueing']:.2f} | {s['throughput']:.3f} | "
                        f"{s['gpu_busy']:.2f} |")
    return head + "\n".join(rows) + "\n"


def plots(report: dict, out: Path) -> list[str]:
    plt = pyplot()
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, per_rate in report["results"].items():
        keys = sorted(per_rate, key=float)
        x = [float(k) for k in keys]
        axes[0].plot(x, [per_rate[k]["summary"]["mean"] for k in keys], marker="o", label=name)
        axes[1].plot(x, [per_rate[k]["summary"]["p95"] for k in keys], marker="o", label=name)
    for ax, what in zip(axes, ("mean latency (s)", "P95 latency (s)")):
        ax.set_yscale("log")
        finish_axes(ax, "request rate (jobs/s)", what)
    axes[0].legend(fontsize=8)
    files.append(save_figure(fig, out / "latency_vs_rate.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("stock", "stencil"):
        if name not in report["results"]:
            continue
        keys = sorted(report["results"][name], key=float)
        rows = report["results"][name][keys[0]]["rows"]  # lowest rate: little queueing
        ax.scatter([r["ratio"] for r in rows], [r["latency"] - r["queueing"] for r in rows], label=name, s=12)
    finish_axes(ax, "mask ratio", "service time (s, lowest rate)", legend=0)
    files.append(save_figure(fig, out / "latency_vs_mask_ratio.png"))

    curve = report.get("batch_curve")
    if curve:
        fig, ax = plt.subplots(figsize=(6, 4))
        for engine in dict.fromkeys(r["engine"] for r in curve):
            points = sorted((r["batch"], r["jobs_per_s"]) for r in curve if r["engine"] == engine)
            ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=engine)
        finish_axes(ax, "batch size (jobs)", "throughput (jobs / s of denoising)", legend=8)
        files.append(save_figure(fig, out / "throughput_vs_batch.png"))
    return files


def write_report(report: dict, out: Path) -> Path:
    """``README.md`` and the plots of a run (``report`` as ``e2e.json`` holds it) in ``out``."""
    files = plots(report, out)
    args = report["args"]
    text = [f"# End-to-end benchmark ({args['trace']} trace)\n",
            f"Command: `{report['command']}` on {report['machine']}, "
            f"{args['workers']} workers per system, max batch {args['max_batch']}, {args['steps']} steps, "
            f"guidance {args['guidance']}, {args['size']}x{args['size']} images, {args['jobs']} jobs per rate; "
            f"took {report['elapsed_s']:.0f} s. Stock capacity (closed loop): {report['capacity_stock']:.3f} jobs/s.\n",
            "## Results\n", table(report), "\n## Claims\n", "\n".join(claims(report)) + "\n",
            "\n## Plots\n", "\n".join(f"![{f}]({f})" for f in files) + "\n"]
    if report.get("batch_curve"):
        text += ["\n## Throughput vs batch size (in process, same model and size)\n",
                 "Jobs per second of denoising (`ops/bench/batch_curve.py`; the stock pipeline's call includes "
                 "its text encoding and VAE work). The gain column says what a step of B jobs saves over B steps "
                 "of one job; continuous batching can only beat static batching by what batching saves plus the "
                 "waiting it avoids.\n", curve_table(report["batch_curve"]) + "\n"]
    path = out / "README.md"
    path.write_text("\n".join(text))
    return path


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/e2e", threads=None, seed=None)
    p.add_argument("--trace", default="spring", choices=["spring", "controlnet", "adetailer"])
    p.add_argument("--workdir", default="", help="stacks' state and the model (default: a new temporary folder)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--size", type=int, default=256, help="image side (latent = size / 8)")
    p.add_argument("--jobs", type=int, default=60, help="jobs per rate")
    p.add_argument("--rates", default="0.3,0.6,0.9,1.2,2.0,3.0,4.0", help="comma-separated multiples of the stock "
                   "capacity")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--unet-hidden", default="64,128", help="block_out_channels of the benchmark UNet")
    p.add_argument("--batch-curve", default="1,2,4", help="batch sizes of the in-process curve ('' = skip)")
    p.add_argument("--from-json", default="", help="measure nothing: re-render --out from a saved e2e.json")
    run = cli.start(p, argv, __file__, quick=dict(workers=1, steps=2, size=64, jobs=2, rates="2.0",
                                                  systems="stencil", unet_hidden="32,64", batch_curve="1",
                                                  timeout=300.0))
    args = run.args
    out = Path(args.out)
    if args.from_json:
        write_report(json.loads(Path(args.from_json).read_text()), out)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker process: one core's worth
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="stencil-bench-e2e-")
    multiples = [float(x) for x in args.rates.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    model_dir = saved_sd_pipeline(Path(args.workdir), tuple(int(x) for x in args.unet_hidden.split(",")))
    ratios = load_trace(args.trace)
    templates = [img for _name, img in demo_templates(args.size)]
    curve: list[dict[str, object]] = []
    if args.batch_curve:
        curve = batch_curve(model_dir, size=args.size, steps=min(args.steps, 4),
                            batches=[int(x) for x in args.batch_curve.split(",")], ratio=float(np.mean(ratios)))
    # The stock baseline's closed-loop capacity (a burst of jobs): the rates are multiples of it.
    burst = run_system("stock-capacity", SYSTEMS["stock"], [1000.0], args, model_dir, ratios, templates)
    capacity = float(next(iter(burst.values()))["summary"]["throughput"])  # type: ignore[index]
    rates = [m * capacity for m in multiples]
    log.info("stock capacity %.3f jobs/s; rates %s", capacity, [round(r, 3) for r in rates])
    results: dict[str, object] = {}
    for name in args.systems.split(","):
        results[name] = run_system(name, SYSTEMS[name], rates, args, model_dir, ratios, templates)
    report = {"command": run.command, "capacity_stock": capacity, "rates": rates, "batch_curve": curve,
              "multiples": multiples, "results": results, "args": vars(args), "elapsed_s": run.elapsed(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    # compact, floats to 6 significant digits: the size budget
    (out / "e2e.json").write_text(json.dumps(rounded(report), separators=(",", ":"), default=float))
    write_report(report, out)
    log.info("done in %.0fs; report in %s", run.elapsed(), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
