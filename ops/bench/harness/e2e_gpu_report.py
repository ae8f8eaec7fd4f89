"""The report of ``ops.bench.e2e_gpu``: service overhead, Poisson runs, phases, claims, from its
report dict (as its JSON holds it, minus the trace)."""

from __future__ import annotations

import math
from typing import Any

from ops.bench.harness.openloop import claims, sustained
from ops.bench.harness.phases import phase_table

OVERHEAD_TARGET = 0.9  # Stencil full compute through the stack >= 90% of the stock pipeline's in-process jobs/s
TARGETS = {"throughput": 3.0, "latency": 10.0}  # at equal P95 / at the stock's highest sustained rate (FlashPS)


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def baseline(report: dict[str, Any]) -> str | None:
    """The faster stock worker (eager or compiled) by burst jobs/s: the Poisson runs' baseline."""
    speed = {n: report["systems"][n]["runs"].get("burst", {}).get("summary", {}).get("throughput", 0.0)
             for n in ("stock", "stock-compiled") if n in report["systems"]}
    return max(speed, key=lambda n: speed[n]) if speed else None


def poisson_view(report: dict[str, Any], base: str | None) -> dict[str, Any]:
    """``ops.bench.e2e``'s shape (results per system and rate, the baseline's capacity)."""
    results = {name: {k: {"summary": r["summary"]} for k, r in s["runs"].items() if k != "burst"}
               for name, s in report["systems"].items() if name != "stock-inprocess"}
    results = {name: runs for name, runs in results.items() if runs}
    cap = float("inf") if base is None else \
        report["systems"][base]["runs"].get("burst", {}).get("summary", {}).get("throughput", float("inf"))
    return {"results": results, "capacity_stock": cap}


def versus(view: dict[str, Any], base: str, name: str) -> tuple[float, float]:
    """(mean latency of ``base`` / ``name`` at the base's highest sustained rate, throughput of
    ``name`` at P95 <= the base's there / the base's): NaN where not measured."""
    results = view["results"]
    key = sustained(view, base, base)
    if key is None or name not in results or key not in results[name]:
        return math.nan, math.nan
    b, at = results[base][key]["summary"], results[name][key]["summary"]
    ok = [r["summary"]["throughput"] for r in results[name].values()
          if r["summary"]["p95"] <= b["p95"] and r["summary"]["done"] == r["summary"]["jobs"]]
    return b["mean"] / at["mean"], (max(ok) / b["throughput"]) if ok else math.nan


def overhead(report: dict[str, Any]) -> list[str]:
    systems = report["systems"]
    args = report["args"]
    lines = ["## Service overhead", "",
             f"A burst of {args['burst']} edits (one template, mask ratios from the {args['trace']} trace, "
             "blob masks), "
             f"batches of up to {args['max_batch']}. Stock in process: the pipeline called per batch, timed after a "
             "warm-up call; the others through their stacks (Redis, router or dispatcher, workers), from the first "
             "job queued to the last done. Engine busy: the GPU worker's busy seconds over the span (Stencil: its "
             "denoising steps; stock: its pipeline calls); GPU util: nvidia-smi's utilization.gpu over the run.", "",
             "| system | jobs/s | vs stock in process | mean latency s | P95 s | engine busy | GPU util |",
             "|---|---|---|---|---|---|---|"]
    base = systems.get("stock-inprocess", {}).get("jobs_per_s")
    if base:
        s = systems["stock-inprocess"]
        lines.append(f"| stock-inprocess | {s['jobs_per_s']:.3f} | 1.00x | {s['mean_s']:.2f} | {s['p95_s']:.2f} | - | "
                     f"{_f(s.get('gpu_util'))} |")
    phases = {}
    for name, s in systems.items():
        burst = s["runs"].get("burst")
        if burst is None:
            continue
        b = burst["summary"]
        rel = f"{b['throughput'] / base:.2f}x" if base else "-"
        lines.append(f"| {name} | {b['throughput']:.3f} | {rel} | {_f(b['mean'])} | {_f(b['p95'])} | "
                     f"{_f(b['gpu_busy'])} | {_f(b.get('gpu_util'))} |")
        phases[name] = burst["phases"]
    full = systems.get("stencil-full", {}).get("runs", {}).get("burst")
    if base and full:
        ratio = full["summary"]["throughput"] / base
        verdict = "met" if ratio >= OVERHEAD_TARGET else "not met"
        lines += ["", f"Stencil in full compute through the whole stack: {ratio:.2f}x the stock pipeline's in-process "
                      f"jobs/s (target >= {OVERHEAD_TARGET:.2f}x: {verdict})."]
    if phases:
        lines += ["", "Mean seconds per job in each phase of the burst (job records; stock: `denoise` is its whole "
                      "pipeline call, encodes and decode included):", "", *phase_table(phases)]
    return lines + [""]


def poisson(report: dict[str, Any]) -> list[str]:
    base = baseline(report)
    view = poisson_view(report, base)
    if not view["results"]:
        return []
    cap = report.get("capacity", {})
    args = report["args"]
    lines = ["## Poisson arrivals", "",
             f"{args['jobs']} jobs per rate, rates {', '.join(f'{m:g}' for m in report['multiples'])} x "
             f"{_f(cap.get('jobs_per_s'), 3)} jobs/s (the capacity of `{cap.get('source')}` on the burst); mask ratios "
             f"from the {args['trace']} trace, shapes from `app.maskgen`, templates: {args['templates']} (Stencil: "
             "warmed). Latency: queued to done, from the job records. Masked: the share of the done jobs' steps "
             "that ran mask-aware; graph: the share replayed from a captured CUDA graph (the rest ran eagerly or "
             "were captured).", "",
             "| system | rate /s | done | mean s | P50 s | P95 s | P99 s | throughput /s | engine busy | GPU util "
             "| masked | graph |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    phases = {}
    for name, per_rate in view["results"].items():
        for key in sorted(per_rate, key=float):
            s = per_rate[key]["summary"]
            lines.append(f"| {name} | {float(key):.3f} | {s['done']}/{s['jobs']} | {_f(s['mean'])} | {_f(s['p50'])} | "
                         f"{_f(s['p95'])} | {_f(s['p99'])} | {_f(s['throughput'], 3)} | {_f(s['gpu_busy'])} | "
                         f"{_f(s.get('gpu_util'))} | {_f(s.get('masked_share'))} | {_f(s.get('graph_share'))} |")
            phases[f"{name} @ {float(key):.3f}/s"] = report["systems"][name]["runs"][key]["phases"]
    lines += ["", "Mean seconds per job in each phase:", "", *phase_table(phases), "", "### Claims", ""]
    if base is None or base not in view["results"]:
        return lines + ["- None: no stock worker ran at these rates.", ""]
    if "stock-compiled" in report["systems"] and "stock" in report["systems"]:
        lines.append(f"- Stock baseline: `{base}` is the faster on the burst (eager and `torch.compile`d "
                     f"`{args['stock_compile']}` measured).")
    lines += claims(view, base)
    latency, throughput = versus(view, base, "stencil")
    if not math.isnan(latency):
        lines.append(f"- Targets (FlashPS): throughput at equal P95 {_f(throughput)}x (>= {TARGETS['throughput']:g}x: "
                     f"{'met' if throughput >= TARGETS['throughput'] else 'not met'}), mean latency at the stock's "
                     f"highest sustained rate {_f(latency, 1)}x lower (>= {TARGETS['latency']:g}x: "
                     f"{'met' if latency >= TARGETS['latency'] else 'not met'}).")
    return lines + [""]


def render(report: dict[str, Any]) -> list[str]:
    args = report["args"]
    lines = [f"# End to end on {report['hardware']}", "", f"Command: `{report['command']}`", "",
             f"Model: `{report.get('model', {}).get('dir', '?')}` (written by `stencil model save` in "
             f"{_f(report.get('model', {}).get('save_s'), 0)} s), {report['side']} px, {args['dtype']}, "
             f"{args['steps']} "
             f"steps, guidance {args['guidance']}, max batch {args['max_batch']}; one GPU worker, Stencil's stages in "
             f"the GPU host's stage pool on the same device. Took {_f(report.get('elapsed_s'), 0)} s of a "
             f"{args['budget_s']:.0f} s budget.", ""]
    lines += overhead(report) + poisson(report)
    notes = list(report["notes"])
    for name, s in report["systems"].items():
        timing = ", ".join(f"{k.removesuffix('_s')} {s[k]:.0f} s" for k in ("start_s", "warm_s", "wall_s") if k in s)
        notes.append(f"`{name}`: {timing}" + "".join(f"; {n}" for n in s.get("notes", [])))
    return lines + ["## Notes", "", *[f"- {n}" for n in notes]]
