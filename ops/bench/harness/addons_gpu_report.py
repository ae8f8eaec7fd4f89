"""The Markdown report of ``ops.bench.addons_gpu`` from its JSON record (a run cut short renders
what it measured), with the issue's targets marked met or not."""

from __future__ import annotations

from typing import Any

# Issue 41: Stencil's added latency at most 10% of the stock path's; long-tail throughput at least 1.5x.
TARGETS = {"added_ratio": 0.10, "trace_speedup": 1.5}


def _setup(report: dict[str, Any]) -> str:
    s, nan = report.get("setup", {}), float("nan")
    text = f"Set-up {report.get('setup_s', nan):.0f} s: model saved in {s.get('model_save_s', nan):.1f} s"
    if s.get("adapters"):
        text += (f"; {s['adapters']} adapters (the first through PEFT in {s.get('first_adapter_s', nan):.1f} s, the "
                 f"others derived from it and converted as `stencil lora add` converts, in "
                 f"{report['args']['processes']} processes) made in {s.get('adapters_s', nan):.1f} s, the models "
                 f"loaded meanwhile ({s.get('loads_s', nan):.1f} s)")
    return text + "."


def _stencil_lora(r: dict[str, Any]) -> str:
    how = ("merged or as per-row terms, by its cost model" if r["merges_allowed"] else
           "as per-row terms every step (half precision never merges: PEFT's unfused roundings)")
    return (f"Stencil applied the adapters {how}: per job with adapters, {r['term_host_s_per_job'] * 1e3:.0f} ms of "
            f"host time adding terms, {r['merge_sync_s_per_job'] * 1e3:.0f} ms merging on the critical path, "
            f"{r['merge_staged_s_per_job'] * 1e3:.0f} ms merging in the background.")


def render(report: dict[str, Any]) -> list[str]:
    """The Markdown report of what ran (a run cut short renders what it measured)."""
    a = report["args"]
    lines = [f"# LoRA adapters and ControlNets on {report['hardware']}", "",
             f"Command: `{report['command']}`", "",
             f"{report['model']} at {report['side']} px in {a['dtype']}, {a['steps']} steps, guidance 7.5, random "
             f"weights; adapters rank {a['rank']} on every attention projection of the UNet; Stencil's GPU-worker "
             f"defaults (max batch {a['max_batch']}, adapter bank {report['bank_mib']} MiB). {_setup(report)} "
             f"Total {report.get('elapsed_s', float('nan')):.0f} s of a {a['budget_s']:.0f} s budget.", ""]
    parts = report["parts"]
    graphs = [r["stencil_graphs"] for r in parts.values() if r.get("stencil_graphs")]
    if graphs:  # the GPU worker's SD runner replays a step as a CUDA graph when nothing rules it out
        lines += [f"Stencil's steps over the run: {graphs[-1]['replays']} replayed as CUDA graphs "
                  f"({graphs[-1]['captures']} captures), the others eager.", ""]
    if "latency" in parts:
        r = parts["latency"]
        lines += ["## Latency adapters add to one job", "",
                  f"Fresh adapters ({r['adapter_mib']:.2f} MiB each) for every request, {r['rounds']} interleaved "
                  f"rounds; added: median over rounds of the difference to the same round's job without adapters. "
                  f"A job without adapters: stock {r['none']['stock_s']:.3f} s, Stencil {r['none']['stencil_s']:.3f} "
                  f"s. The stock path's LoRA calls (load, set, fuse; unfuse, unload) took "
                  f"{r['stock_lora_s'] * 1e3:.0f} ms per request (median). {_stencil_lora(r['stencil_lora'])}", "",
                  "| adapters | stock latency | stock added | Stencil latency | Stencil added | "
                  f"Stencil added / stock added (target <= {TARGETS['added_ratio']:.2f}) |",
                  "|---|---|---|---|---|---|"]
        for n, row in sorted(r["rows"].items()):
            met = "met" if row["added_ratio"] <= TARGETS["added_ratio"] else "not met"
            lines.append(f"| {n} | {row['stock_s']:.3f} s | {row['stock_added_s'] * 1e3:.0f} ms | "
                         f"{row['stencil_s']:.3f} s | {row['stencil_added_s'] * 1e3:.0f} ms | "
                         f"{row['added_ratio']:.3f} ({met}) |")
        shares = r.get("graph_replayed_share")
        if shares:  # steps with adapter terms are never graph-replayed: part of what adapters add on a GPU
            lines += ["", "Stencil's steps replayed as CUDA graphs, by adapters per job: "
                      + ", ".join(f"{n}: {float(v):.0%}" for n, v in sorted(shares.items(), key=lambda kv: int(kv[0])))
                      + " (a step with adapter terms runs eagerly)."]
        lines.append("")
    if "trace" in parts:
        r = parts["trace"]
        met = "met" if r["speedup"] >= TARGETS["trace_speedup"] else "not met"
        lines += ["## Long-tail trace", "",
                  f"{r['jobs']} jobs, {a['pool']} adapters with Zipf({a['zipf']}) popularity ({r['distinct_adapters']} "
                  f"distinct), 1-2 per job, scales in [0.5, 1]; stock one request at a time, Stencil all submitted "
                  "at once.", "", "| system | seconds | jobs/s | vs stock |", "|---|---|---|---|",
                  f"| stock per-request path | {r['stock_s']:.2f} | {r['stock_jobs_per_s']:.3f} | 1.00x |",
                  f"| Stencil | {r['stencil_s']:.2f} | {r['stencil_jobs_per_s']:.3f} | {r['speedup']:.2f}x "
                  f"(target >= {TARGETS['trace_speedup']}x: {met}) |", ""]
    if "controlnet" in parts:
        r = parts["controlnet"]
        lat = r["latency"]
        lines += ["## One ControlNet", "",
                  f"A ControlNet of the model's size (`ControlNetModel.from_unet`, random weights), conditioning scale "
                  f"0.8, canny control "
                  f"images; latency: one job alone, median of {r['rounds']} interleaved rounds; batch: {r['jobs']} "
                  f"jobs (stock in calls of {a['max_batch']}, Stencil all submitted at once), median of "
                  f"{r['batch_rounds']} interleaved rounds. ControlNet made, "
                  f"saved, loaded and made resident in {r['setup_s']:.1f} s.", "",
                  "| ControlNets | stock latency | Stencil latency | Stencil / stock |", "|---|---|---|---|"]
        for k in (0, 1):
            s, o = lat[f"stock-{k}"], lat[f"stencil-{k}"]
            lines.append(f"| {k} | {s:.3f} s | {o:.3f} s | {o / s:.2f}x |")
        lines += ["", f"| {r['jobs']} jobs with 1 ControlNet | seconds | jobs/s |", "|---|---|---|"]
        for name, s in r["batch_s"].items():
            lines.append(f"| {name} | {s:.2f} | {r['jobs_per_s'][name]:.3f} |")
        lines += ["", f"Stencil against the faster stock way: {r['speedup_vs_best_stock']:.2f}x.", ""]
    if report["notes"]:
        lines += ["Notes: " + "; ".join(report["notes"]) + ".", ""]
    return lines
