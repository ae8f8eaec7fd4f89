"""Statistics and Markdown tables of simulation runs (plots and report files: ``ops.bench.simulate``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ops.sim.workload import SimJob


def summarize(jobs: Sequence[SimJob], *, warmup_fraction: float = 0.1) -> dict[str, float]:
    """Latency stats over completed jobs after warm-up; SLO attainment over all measured jobs."""
    measured = [j for j in jobs if j.index >= int(len(jobs) * warmup_fraction)]
    done = [j for j in measured if j.finish is not None]
    lat = np.array([j.finish - j.arrival for j in done]) if done else np.array([np.nan])  # type: ignore[operator]
    slowdown = np.array([(j.finish - j.arrival) / j.alone_s for j in done]) if done else np.array([np.nan])  # type: ignore[operator]
    met = sum(1 for j in done if j.finish <= j.deadline)  # type: ignore[operator]
    span = max(j.finish for j in done) - min(j.arrival for j in measured) if done else float("nan")  # type: ignore[type-var]
    return {
        "jobs": float(len(measured)), "completed": float(len(done)),
        "expired": float(sum(1 for j in measured if j.expired)),
        "mean_s": float(np.mean(lat)), "p50_s": float(np.percentile(lat, 50)),
        "p95_s": float(np.percentile(lat, 95)), "p99_s": float(np.percentile(lat, 99)),
        "mean_slowdown": float(np.mean(slowdown)), "p95_slowdown": float(np.percentile(slowdown, 95)),
        "slo_attainment": met / len(measured) if measured else float("nan"),
        "throughput": len(done) / span if done and span > 0 else float("nan"),
    }


def fmt_s(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 1 else f"{v * 1e3:.0f} ms"


def _vs(a: float, b: float) -> str:
    return f"{(1 - a / b) * 100:.1f}% lower" if a <= b else f"{(a / b - 1) * 100:.1f}% higher"


def policy_table(results: list[dict[str, Any]], workers: int, trace: str, policies: Sequence[str]) -> str:
    """One table: rows = load, columns = policy (mean / P95 / SLO), then P95 comparisons."""
    rows = [r for r in results if r["workers"] == workers and r["trace"] == trace and not r.get("slo_admission")]
    loads = sorted({r["load"] for r in rows})
    ideal = "ideal_pooled" in policies
    head = "| load | " + " | ".join(f"{p} mean / P95 / SLO" for p in policies) + " | mask_aware vs least_requests P95 |"
    if ideal:
        head += " ideal_pooled vs least_requests P95 | service floor P95 |"
    out = [head, "|" + "---|" * (len(policies) + 2 + 2 * ideal)]
    for load in loads:
        cells = []
        by = {r["policy"]: r for r in rows if r["load"] == load}
        for p in policies:
            s = by.get(p, {}).get("stats")
            cells.append(f"{fmt_s(s['mean_s'])} / {fmt_s(s['p95_s'])} / {s['slo_attainment'] * 100:.0f}%" if s else "-")
        lr = by.get("least_requests", {}).get("stats", {}).get("p95_s")
        gain = _vs(by["mask_aware"]["stats"]["p95_s"], lr) if "mask_aware" in by and lr else "-"
        line = f"| {load:.0%} | " + " | ".join(cells) + f" | {gain} |"
        if ideal:
            best = _vs(by["ideal_pooled"]["stats"]["p95_s"], lr) if "ideal_pooled" in by and lr else "-"
            floor = next((r["stats"]["floor_p95_s"] for r in by.values() if "floor_p95_s" in r["stats"]), None)
            line += f" {best} | {fmt_s(floor) if floor is not None else '-'} |"
        out.append(line)
    return "\n".join(out)
