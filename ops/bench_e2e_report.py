"""Tables, claims and plots of ``ops.bench_e2e`` results (also re-runnable on a saved e2e.json)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def _summary(report: dict, system: str, rate_key: str) -> dict[str, float]:
    return report["results"][system][rate_key]["summary"]


def sustained(report: dict, system: str) -> str | None:
    """Highest rate the system sustains: it completes the offered load (throughput >= 85% of
    the rate) without its queue growing (mean queueing below the mean service time x 4). For the
    stock baseline also at most its measured closed-loop capacity: above it the queue grows without
    bound, which a short run at that rate can hide."""
    best = None
    limit = float(report.get("capacity_stock", float("inf"))) if system == "stock" else float("inf")
    for key in sorted(report["results"][system], key=float):
        if float(key) > limit * 1.0001:
            continue
        s = _summary(report, system, key)
        service = s["mean"] - s["queueing"]
        if s["done"] == s["jobs"] and s["throughput"] >= 0.85 * float(key) and s["queueing"] <= 4 * max(service, 1e-6):
            best = key
    return best


def claims(report: dict) -> list[str]:
    lines = []
    systems = report["results"]
    if "stock" not in systems:
        return lines
    base_key = sustained(report, "stock") or min(systems["stock"], key=float)
    base = _summary(report, "stock", base_key)
    lines.append(f"- Highest rate the stock baseline sustains: {float(base_key):.3f} jobs/s "
                 f"(throughput {base['throughput']:.3f}/s, P95 {base['p95']:.2f} s, mean {base['mean']:.2f} s).")
    for name in systems:
        if name == "stock" or base_key not in systems[name]:
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, per_rate in report["results"].items():
        keys = sorted(per_rate, key=float)
        x = [float(k) for k in keys]
        axes[0].plot(x, [per_rate[k]["summary"]["mean"] for k in keys], marker="o", label=name)
        axes[1].plot(x, [per_rate[k]["summary"]["p95"] for k in keys], marker="o", label=name)
    for ax, what in zip(axes, ("mean latency (s)", "P95 latency (s)")):
        ax.set_xlabel("request rate (jobs/s)")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_rate.png", dpi=110)
    files.append("latency_vs_rate.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("stock", "stencil"):
        if name not in report["results"]:
            continue
        keys = sorted(report["results"][name], key=float)
        rows = report["results"][name][keys[0]]["rows"]  # lowest rate: little queueing
        ax.scatter([r["ratio"] for r in rows], [r["latency"] - r["queueing"] for r in rows], label=name, s=12)
    ax.set_xlabel("mask ratio")
    ax.set_ylabel("service time (s, lowest rate)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_vs_mask_ratio.png", dpi=110)
    files.append("latency_vs_mask_ratio.png")
    plt.close(fig)

    curve = report.get("batch_curve")
    if curve:
        fig, ax = plt.subplots(figsize=(6, 4))
        for engine in dict.fromkeys(r["engine"] for r in curve):
            points = sorted((r["batch"], r["jobs_per_s"]) for r in curve if r["engine"] == engine)
            ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=engine)
        ax.set_xlabel("batch size (jobs)")
        ax.set_ylabel("throughput (jobs / s of denoising)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_batch.png", dpi=110)
        files.append("throughput_vs_batch.png")
        plt.close(fig)
    return files


def write_report(report: dict, out: Path) -> Path:
    files = plots(report, out)
    args = report["args"]
    cmd = "python -m ops.bench_e2e" + (" --quick" if args.get("quick") else "") + f" --trace {args['trace']}"
    from ops.bench_e2e import FULL_JOBS, QUICK_JOBS

    defaults = {"systems": None, "rates": "", "jobs": QUICK_JOBS if args.get("quick") else FULL_JOBS, "size": 256,
                "unet_hidden": "64,128", "batch_curve": "1,2,4"}  # systems: always shown
    for flag, default in defaults.items():
        if flag in args and args[flag] != default:
            cmd += f" --{flag.replace('_', '-')} {shlex.quote(str(args[flag]))}"
    text = [f"# End-to-end benchmark ({args['trace']} trace)\n",
            f"Command: `{cmd} --out {args['out']}` on {report['machine']}, "
            f"{args['workers']} workers per system, max batch {args['max_batch']}, {args['steps']} steps, "
            f"guidance {args['guidance']}, {args['size']}x{args['size']} images, {args['jobs']} jobs per rate; "
            f"took {report['elapsed_s']:.0f} s. Stock capacity (closed loop): {report['capacity_stock']:.3f} jobs/s.\n",
            "## Results\n", table(report), "\n## Claims\n", "\n".join(claims(report)) + "\n",
            "\n## Plots\n", "\n".join(f"![{f}]({f})" for f in files) + "\n"]
    if report.get("batch_curve"):
        from ops.bench_batch_curve import curve_table

        text += ["\n## Throughput vs batch size (in process, same model and size)\n",
                 "Jobs per second of denoising (`ops/bench_batch_curve.py`; the stock pipeline's call includes "
                 "its text encoding and VAE work). The gain column says what a step of B jobs saves over B steps "
                 "of one job; continuous batching can only beat static batching by what batching saves plus the "
                 "waiting it avoids.\n", curve_table(report["batch_curve"]) + "\n"]
    if report.get("overheads"):
        text += ["\n## Overheads\n", "\n".join(f"- {k}: {v}" for k, v in report["overheads"].items()) + "\n"]
    path = out / "README.md"
    path.write_text("\n".join(text))
    return path


if __name__ == "__main__":
    src = Path(sys.argv[1])
    write_report(json.loads(src.read_text()), src.parent)
