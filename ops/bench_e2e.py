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
5. ``stencil``: all of Stencil (4 + mask-aware routing + prefetch at routing time).

Latency, queueing time and phases come from the job records (server timestamps). Writes
``BENCHMARKS-e2e.md`` (tables) and PNG plots into ``--out``.

    python -m ops.bench_e2e --quick --out docs/bench/e2e
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ops.sim.traces import load_trace

log = logging.getLogger("bench_e2e")


SYSTEMS: dict[str, dict[str, object]] = {
    "stock": {"stock": True},
    "full-static": {"mask_aware": False, "batching": "static", "prefetch_steps": 0},
    "full-continuous": {"mask_aware": False, "batching": "continuous"},
    "maskaware": {"mask_aware": True, "batching": "continuous", "routing_policy": "round_robin",
                  "prefetch_steps": 2},
    "stencil": {"mask_aware": True, "batching": "continuous", "routing_policy": "mask_aware",
                "prefetch_steps": 64},
}


# Defaults of the two modes (the report prints only what a run changed from them).
QUICK_JOBS, FULL_JOBS = 20, 60
QUICK_RATES, FULL_RATES = [0.9, 2.0], [0.3, 0.6, 0.9, 1.2, 2.0, 3.0, 4.0]


@dataclass
class Workload:
    """Jobs of one run: arrival offsets, templates, masks, prompts, seeds."""

    arrivals: list[float]
    jobs: list[dict[str, object]] = field(default_factory=list)


def make_workload(rate: float, n: int, ratios: np.ndarray, templates: list[Image.Image], steps: int,
                  seed: int) -> Workload:
    from app.maskgen import SHAPES, make_mask

    rng = random.Random(seed)
    t, arrivals, jobs = 0.0, [], []
    size = templates[0].size
    for i in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
        ratio = float(ratios[rng.randrange(len(ratios))])
        mask = make_mask(ratio, size, rng.choice(SHAPES), seed=rng.randrange(1 << 30))
        jobs.append({"template": rng.randrange(len(templates)), "mask": mask,
                     "prompt": rng.choice(["a red scarf", "a hat", "flowers", "a cat", "sunglasses"]),
                     "seed": rng.randrange(1 << 31), "steps": steps})
    return Workload(arrivals, jobs)


def bench_templates(size: int) -> list[Image.Image]:
    from app.demo import demo_templates

    return [img for _name, img in demo_templates(size)]


def run_rate(client, stock: bool, template_ids: list[str], templates: list[Image.Image],  # type: ignore[no-untyped-def]
             workload: Workload, guidance: float, timeout: float) -> list[dict[str, float]]:
    """Open-loop replay: submit at the arrival times, then wait for every job."""
    start = time.monotonic()
    handles = []
    for offset, job in zip(workload.arrivals, workload.jobs):
        delay = start + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        tpl = templates[job["template"]] if stock else template_ids[job["template"]]  # type: ignore[index]
        handles.append((client.submit(template=tpl, mask=job["mask"], prompt=job["prompt"], seed=job["seed"],
                                      steps=job["steps"], guidance=guidance), float(job["mask"].mean())))
    rows = []
    for handle, ratio in handles:
        rec = handle.wait(timeout)
        queued = rec.ts("queued") or 0.0
        end = rec.ts("done") or rec.ts(rec.status) or time.time()
        started = rec.ts("denoising") or end
        rows.append({"status": rec.status.value, "latency": end - queued, "queueing": max(0.0, started - queued),
                     "ratio": ratio, "queued": queued, "end": end,
                     "worker": str(rec.fields.get("worker") or ""),
                     "masked_steps": float(rec.fields.get("masked_steps") or 0),
                     "fallback_steps": float(rec.fields.get("fallback_steps") or 0)})
    return rows


def busy_seconds(stack) -> float:  # type: ignore[no-untyped-def]
    r = stack.redis()
    total = 0.0
    for wid in stack.settings.gpu_worker_ids:
        value = r.hget(f"stencil:worker:{wid}", "busy_seconds")
        total += float(value) if value else 0.0
    return total


def summarize(rows: list[dict[str, float]], busy: float, workers: int) -> dict[str, float]:
    done = [r for r in rows if r["status"] == "done"]
    lat = np.array([r["latency"] for r in done]) if done else np.array([np.nan])
    span = max(r["end"] for r in rows) - min(r["queued"] for r in rows)
    return {
        "jobs": len(rows), "done": len(done),
        "mean": float(lat.mean()), "p50": float(np.percentile(lat, 50)), "p95": float(np.percentile(lat, 95)),
        "p99": float(np.percentile(lat, 99)),
        "queueing": float(np.mean([r["queueing"] for r in done])) if done else float("nan"),
        "throughput": len(done) / span if span > 0 else float("nan"),
        "gpu_busy": busy / (span * workers) if span > 0 else float("nan"),
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


def measure_capacity(args: argparse.Namespace, model_dir: Path, ratios: np.ndarray,
                     templates: list[Image.Image]) -> float:
    """Closed-loop throughput of the stock baseline (a burst of jobs), in jobs/s."""
    res = run_system("stock-capacity", SYSTEMS["stock"], [1000.0], args, model_dir, ratios, templates)
    return float(next(iter(res.values()))["summary"]["throughput"])  # type: ignore[index]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="finish within ~10 minutes on 2 cores")
    p.add_argument("--trace", default="spring", choices=["spring", "controlnet", "adetailer"])
    p.add_argument("--out", default="docs/bench/e2e")
    p.add_argument("--workdir", default="/tmp/stencil-bench-e2e")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--size", type=int, default=256, help="image side (latent = size / 8)")
    p.add_argument("--jobs", type=int, default=0, help=f"jobs per rate (default: {QUICK_JOBS} quick, {FULL_JOBS} full)")
    p.add_argument("--rates", default="", help="comma-separated multiples of the stock capacity")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--unet-hidden", default="64,128", help="block_out_channels of the benchmark UNet")
    p.add_argument("--batch-curve", default="1,2,4", help="batch sizes of the in-process curve ('' = skip)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker process: one core's worth
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.jobs = args.jobs or (QUICK_JOBS if args.quick else FULL_JOBS)
    multiples = [float(x) for x in args.rates.split(",")] if args.rates else (QUICK_RATES if args.quick else FULL_RATES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from workers.models.tiny_sd import save_pipeline

    hidden = tuple(int(x) for x in args.unet_hidden.split(","))
    model_dir = Path(args.workdir) / f"model-{'-'.join(map(str, hidden))}"
    if not (model_dir / "model_index.json").is_file():
        save_pipeline(model_dir, unet_hidden=hidden, cross_dim=hidden[0])
    ratios = load_trace(args.trace)
    templates = bench_templates(args.size)
    t0 = time.monotonic()
    curve: list[dict[str, object]] = []
    if args.batch_curve:
        from ops.bench_batch_curve import batch_curve

        curve = batch_curve(model_dir, size=args.size, steps=min(args.steps, 4),
                            batches=[int(x) for x in args.batch_curve.split(",")], ratio=float(np.mean(ratios)))
    capacity = measure_capacity(args, model_dir, ratios, templates)
    rates = [m * capacity for m in multiples]
    log.info("stock capacity %.3f jobs/s; rates %s", capacity, [round(r, 3) for r in rates])
    results: dict[str, object] = {}
    for name in args.systems.split(","):
        results[name] = run_system(name, SYSTEMS[name], rates, args, model_dir, ratios, templates)
    elapsed = time.monotonic() - t0
    report = {"capacity_stock": capacity, "rates": rates, "batch_curve": curve, "multiples": multiples,
              "results": results,
              "args": vars(args), "elapsed_s": elapsed, "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    (out / "e2e.json").write_text(json.dumps(report, indent=1, default=float))
    from ops.bench_e2e_report import write_report

    write_report(report, out)
    log.info("done in %.0fs; report in %s", elapsed, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
