"""Open-loop load against a running stack (Poisson arrivals of edits, results from the job
records) and the rules that judge a run: which rate a system sustains, and each system against
the stock baseline there. Shared by the end-to-end benchmarks (``e2e``, ``e2e_gpu``)."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
from PIL import Image

from ops.bench.harness.phases import job_phases

Workload = tuple[list[float], list[dict[str, Any]]]  # arrival offsets; template, mask, prompt, seed of each job


def make_workload(rate: float, n: int, ratios: np.ndarray, templates: list[Image.Image], steps: int,
                  seed: int) -> Workload:
    """Poisson arrivals at ``rate``, mask ratios from the trace, shapes, templates, prompts, seeds."""
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
    return arrivals, jobs


def run_rate(client, stock: bool, template_ids: list[str], templates: list[Image.Image],  # type: ignore[no-untyped-def]
             workload: Workload, guidance: float, timeout: float,
             deadline: float | None = None) -> list[dict[str, Any]]:
    """Open-loop replay: submit at the arrival times, then wait for every job (until ``deadline``,
    a ``time.monotonic()`` value, at most: a job still running then counts as not done)."""
    start = time.monotonic()
    submit = client.submit
    handles = []
    for offset, job in zip(*workload):
        delay = start + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        tpl = templates[job["template"]] if stock else template_ids[job["template"]]
        handles.append((submit(template=tpl, mask=job["mask"], prompt=job["prompt"], seed=job["seed"],
                               steps=job["steps"], guidance=guidance), float(job["mask"].mean())))
    rows = []
    for handle, ratio in handles:
        try:
            rec = handle.wait(timeout if deadline is None else max(0.0, min(timeout, deadline - time.monotonic())))
        except TimeoutError:
            rec = handle.record()
        queued = rec.ts("queued") or 0.0
        end = (rec.ts("done") or rec.ts(rec.status) or time.time()) if rec.status.terminal else time.time()
        started = rec.ts("denoising") or end
        rows.append({"status": rec.status.value, "latency": end - queued, "queueing": max(0.0, started - queued),
                     "ratio": ratio, "queued": queued, "end": end,
                     "worker": str(rec.fields.get("worker") or ""),
                     "masked_steps": float(rec.fields.get("masked_steps") or 0),
                     "fallback_steps": float(rec.fields.get("fallback_steps") or 0),
                     "graph_replayed_steps": float(rec.fields.get("graph_replayed_steps") or 0),
                     "phases": job_phases(rec.fields)})
    return rows


def busy_seconds(stack) -> float:  # type: ignore[no-untyped-def]
    r = stack.redis()
    total = 0.0
    for wid in stack.settings.gpu_worker_ids:
        value = r.hget(f"stencil:worker:{wid}", "busy_seconds")
        total += float(value) if value else 0.0
    return total


def summarize(rows: list[dict[str, Any]], busy: float, workers: int) -> dict[str, float]:
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


def _summary(report: dict, system: str, rate_key: str) -> dict[str, float]:
    return report["results"][system][rate_key]["summary"]


def sustained(report: dict, system: str, base: str = "stock") -> str | None:
    """Highest rate the system sustains: it completes the offered load (throughput >= 85% of
    the rate) without its queue growing (mean queueing below the mean service time x 4). For the
    baseline (``base``) also at most its measured closed-loop capacity: above it the queue grows
    without bound, which a short run at that rate can hide."""
    best = None
    limit = float(report.get("capacity_stock", float("inf"))) if system == base else float("inf")
    for key in sorted(report["results"][system], key=float):
        if float(key) > limit * 1.0001:
            continue
        s = _summary(report, system, key)
        service = s["mean"] - s["queueing"]
        if s["done"] == s["jobs"] and s["throughput"] >= 0.85 * float(key) and s["queueing"] <= 4 * max(service, 1e-6):
            best = key
    return best


def claims(report: dict, stock: str = "stock") -> list[str]:
    """Each system against the baseline ``stock`` (its capacity: ``capacity_stock``)."""
    lines = []
    systems = report["results"]
    if not systems.get(stock):
        return lines
    base_key = sustained(report, stock, stock) or min(systems[stock], key=float)
    base = _summary(report, stock, base_key)
    lines.append(f"- Highest rate the stock baseline (`{stock}`) sustains: {float(base_key):.3f} jobs/s "
                 f"(throughput {base['throughput']:.3f}/s, P95 {base['p95']:.2f} s, mean {base['mean']:.2f} s).")
    for name in systems:
        if name == stock or base_key not in systems[name]:
            continue
        at = _summary(report, name, base_key)
        ok = [k for k in systems[name] if _summary(report, name, k)["p95"] <= base["p95"]
              and _summary(report, name, k)["done"] == _summary(report, name, k)["jobs"]]
        tput = max((_summary(report, name, k)["throughput"] for k in ok), default=float("nan"))
        equal_p95 = (f"{tput:.3f}/s ({tput / base['throughput']:.2f}x the stock's)" if ok
                     else "none (P95 above the stock's at every measured rate)")
        lines.append(f"- `{name}`: at that rate mean latency {at['mean']:.2f} s "
                     f"({base['mean'] / at['mean']:.1f}x lower), P95 {at['p95']:.2f} s; highest throughput "
                     f"with P95 <= the stock's: {equal_p95}.")
    if "full-static" in systems and "full-continuous" in systems:
        for key in sorted(systems["full-static"], key=float):
            if key in systems["full-continuous"]:
                a, b = _summary(report, "full-static", key), _summary(report, "full-continuous", key)
                lines.append(f"- rate {float(key):.3f}/s: continuous vs static batching P95 {b['p95']:.2f} s vs "
                             f"{a['p95']:.2f} s ({(1 - b['p95'] / a['p95']) * 100:.0f}% lower).")
    return lines
