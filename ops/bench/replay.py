"""Replay a mask-ratio trace on a real embedded stack (2 GPU workers on this machine) per policy.

    python -m ops.bench.replay --trace controlnet --jobs 48 --rate 1.5 \
        --cost-model ops/sim/costmodels/<tiny model>.json --out docs/bench/dispatch.md

Every policy gets the same arrivals (Poisson, seeded), the same masks (``app.maskgen`` shapes at
the trace's ratios) and the same warmed templates, on a fresh ``EmbeddedStack(gpu_workers=2)``:
real Redis, Celery CPU worker, dispatcher and two engines running the embedded model with
mask-aware inference. Latency = ``ts_done - ts_queued`` from the job records. Torch runs one
thread per process (``OMP_NUM_THREADS=1``) so that four processes share two cores predictably.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.client import StencilClient
from app.demo import demo_templates
from app.embedded import EmbeddedStack
from app.maskgen import SHAPES, make_mask
from app.routing import POLICIES
from ops.bench.harness import cli, load_trace
from ops.bench.harness.report import replace_section

log = logging.getLogger(__name__)


def schedule(args: argparse.Namespace, seed: int) -> "Plan":
    """(arrival offset s, mask ratio, template index, mask shape, seed) per job, seeded."""
    rng = np.random.default_rng(seed)
    trace = load_trace(args.trace)
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.jobs))
    ratios = np.clip(trace[rng.integers(0, len(trace), args.jobs)], 0.01, 0.99)
    return [(float(arrivals[i]), float(ratios[i]), int(rng.integers(0, args.templates)),
             SHAPES[int(rng.integers(0, 2))], int(rng.integers(0, 1 << 30))) for i in range(args.jobs)]


Plan = list[tuple[float, float, int, str, int]]


def replay_policy(policy: str, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"stencil-replay-{policy}-"))
    with EmbeddedStack.start(workdir, gpu_workers=2, routing_policy=policy, max_batch=args.max_batch) as stack:
        client = StencilClient(stack.settings)
        images = demo_templates(args.size)
        ids = [client.add_template(img, template_id=f"tpl{k}") for k, (_, img) in enumerate(images[: args.templates])]
        warm = [client.warm_template(t, steps=args.steps) for t in ids]
        for h in warm:
            rec = h.wait(600)
            if rec.status.value != "done":
                raise RuntimeError(f"warm-up of {h.id} ended {rec.status.value}: {rec.error}")
        time.sleep(1.0)  # let the engines publish idle state
        handles = []
        t0 = time.monotonic()
        for offset, ratio, tpl, shape, seed in plan:
            delay = t0 + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            mask = make_mask(ratio, (args.size, args.size), shape, seed=seed)
            handles.append((client.submit(template=ids[tpl % len(ids)], mask=mask, prompt="a hat", steps=args.steps,
                                          seed=seed), ratio))
        rows = []
        for h, ratio in handles:
            rec = h.wait(args.timeout)
            done = rec.ts("done")
            rows.append({"status": rec.status.value, "ratio": ratio, "worker": rec.worker,
                         "latency": (done - rec.ts("queued")) if done else None,
                         "cache_mode": rec.fields.get("cache_mode", "")})
    lat = np.array([r["latency"] for r in rows if r["latency"] is not None])
    out = {"policy": policy, "done": int(len(lat)), "jobs": len(rows),
           "mean_s": float(lat.mean()) if len(lat) else float("nan"),
           "p95_s": float(np.percentile(lat, 95)) if len(lat) else float("nan"),
           "per_worker": {w: sum(1 for r in rows if str(r["worker"]) == w)
                          for w in sorted({str(r["worker"]) for r in rows})},
           "masked": sum(1 for r in rows if r["cache_mode"] == "masked")}
    log.info("%s: %s", policy, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/dispatch.md", threads=None, seed=None)
    p.add_argument("--trace", default="controlnet")
    p.add_argument("--jobs", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--templates", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--cost-model", default="", help="STENCIL_COST_MODEL for mask_aware (fitted on this machine)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per policy and seed")
    run = cli.start(p, argv, __file__, quick=dict(jobs=2, rate=5.0, steps=2, size=64, templates=1,
                                                  policies=["least_requests"], timeout=300.0))
    args = run.args
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.cost_model:
        os.environ["STENCIL_COST_MODEL"] = str(Path(args.cost_model).resolve())
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policies}
    for seed in args.seeds:
        plan = schedule(args, seed)
        for policy in args.policies:  # interleaved, so drifting machine load hits every policy
            runs[policy].append(replay_policy(policy, plan, args))
    results = []
    for policy, rs in runs.items():
        results.append({"policy": policy, "done": sum(r["done"] for r in rs), "jobs": sum(r["jobs"] for r in rs),
                        "mean_s": float(np.mean([r["mean_s"] for r in rs])),
                        "p95_s": float(np.mean([r["p95_s"] for r in rs])),
                        "per_seed_p95": [round(r["p95_s"], 3) for r in rs],
                        "per_worker": [r["per_worker"] for r in rs], "masked": sum(r["masked"] for r in rs)})
    if args.out:
        lines = ["## Real replay on this machine (2 engines, embedded model)", "", "```", run.command, "```", "",
                 f"{args.jobs} jobs per run from the `{args.trace}` trace, Poisson at {args.rate}/s, {args.steps} "
                 f"steps, {args.size}x{args.size} px, {args.templates} warmed templates, max batch {args.max_batch}; "
                 f"same arrivals and masks for every policy; seeds {args.seeds} (mean and P95 averaged over seeds).",
                 "", "| policy | done | mean s | P95 s | P95 per seed | jobs per worker | masked-compute jobs |",
                 "|---|---|---|---|---|---|---|"]
        for r in results:
            lines.append(f"| {r['policy']} | {r['done']}/{r['jobs']} | {r['mean_s']:.3f} | {r['p95_s']:.3f} | "
                         f"{r['per_seed_p95']} | {r['per_worker']} | {r['masked']} |")
        replace_section(Path(args.out), "replay", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
