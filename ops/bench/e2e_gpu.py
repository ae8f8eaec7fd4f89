"""End to end on one GPU: Stencil's whole stack against the stock diffusers pipeline on the same card.

One bounded command (the defaults fit about 190 s on an H100 or H200, model save, loads and
warm-ups included; ``--budget-s`` shares the time among the systems and cuts what would not fit)
runs, one after the other on ``--device``:

1. ``stock-inprocess``: ``StableDiffusion(XL)InpaintPipeline`` in process, in batches of
   ``--max-batch``, on a burst of ``--burst`` edits (``ops.bench.harness.burst.run_stock``);
2. ``stencil-full``: Stencil's whole stack in full compute (``STENCIL_MASK_AWARE=false``) on the
   same burst: Redis, the dispatcher, the GPU worker on the device, the GPU host's stage pool
   (``STENCIL_STAGE_PLACEMENT=gpu_host``: text encoders and VAE on the same device). Its jobs/s
   against 1. is the service overhead (target: within 10%); the job records' phases say where it goes;
3. ``stock``: the stock pipeline worker (``workers/stock_worker.py``: static batches, on
   ``STENCIL_DEVICE``) behind its round-robin router, same Redis and job records: the burst (its
   capacity C), then Poisson arrivals at ``--rates`` x C with mask ratios from the public trace
   (``ops/data/mask_ratios``) and shapes from ``app.maskgen``; ``--stock-compile MODE`` adds
   ``stock-compiled`` (its UNet through ``torch.compile``), and the faster is the baseline;
4. ``stencil``: the whole stack, mask-aware, its templates warmed, at the same rates.

Reported (``--out`` Markdown, ``--json`` every job): the service overhead, throughput at equal P95
and mean latency at the stock's highest sustained rate (``harness.openloop``'s rules), the GPU's busy
share (``nvidia-smi`` utilization over each run; the GPU worker's own busy seconds), and time per
phase (queue, prepare, slot wait, denoise, finalize) from the job records' timestamps. The model is
a true-size one with random weights written by ``stencil model save`` (SD 1.5 inpainting at 512 px
in bfloat16; ``--model sdxl``: SDXL at 1024 px, with fewer jobs or a larger budget). ``--quick``:
the tiny embedded model at 64 px on whatever device, a few jobs (the test suite's smoke run).

    python -m ops.bench.e2e_gpu --out gpu-out/e2e_gpu.md --json gpu-out/e2e_gpu.json
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.demo import demo_templates
from ops.bench.harness import load_trace
from ops.bench.harness.burst import Edits, run_stock
from ops.bench.harness.cli import parser, start
from ops.bench.harness.e2e_gpu_report import render
from ops.bench.harness.gpu import DTYPES, UtilSampler, device_of, hardware
from ops.bench.harness.openloop import Workload, busy_seconds, make_workload, run_rate, summarize
from ops.bench.harness.phases import mean_phases
from ops.bench.harness.report import Stopped, log_digest, stop_on_sigterm, write_run
from ops.bench.harness.saved_models import MODELS, save_model

log = logging.getLogger(__name__)

# What each system runs: a stack (stock worker or Stencil with these settings), the burst, the rates.
SYSTEMS: dict[str, dict[str, Any]] = {
    "stock-inprocess": {},
    "stencil-full": {"stencil": {"mask_aware": False}, "burst": True},
    "stock": {"stock": True, "burst": True, "rates": True},
    "stock-compiled": {"stock": True, "compile": True, "burst": True, "rates": True},
    "stencil": {"stencil": {"mask_aware": True}, "warm": True, "rates": True},
}
# Shares of the time left that each system may take (the stock and Stencil run several rates).
SHARE = {"stock-inprocess": 1.0, "stencil-full": 1.5, "stock": 2.0, "stock-compiled": 2.0, "stencil": 2.0}


def burst_workload(edits: Edits) -> Workload:
    """The in-process baseline's edits, all arriving at once (template 0 is ``edits.template``)."""
    jobs = [{"template": 0, "mask": edits.masks[i], "prompt": p.prompt, "seed": p.seed, "steps": p.steps}
            for i, p in enumerate(edits.params)]
    return [0.0] * len(jobs), jobs


def capacity(report: dict[str, Any]) -> tuple[float, str] | None:
    """The rate the Poisson runs are multiples of: the stock worker's burst (closed loop), else the
    in-process stock's, else Stencil full compute's."""
    systems = report["systems"]
    for name, pick in (("stock", lambda s: s["runs"]["burst"]["summary"]["throughput"]),
                       ("stock-inprocess", lambda s: s["jobs_per_s"]),
                       ("stencil-full", lambda s: s["runs"]["burst"]["summary"]["throughput"])):
        try:
            value = float(pick(systems[name]))
        except (KeyError, TypeError):
            continue
        if value > 0:
            return value, name
    return None


def measure(stack: Any, client: Any, tids: list[str], templates: list[Any], workload: Workload,
            args: argparse.Namespace, until: float, sampler: UtilSampler) -> dict[str, Any]:
    """One open-loop run: summary (latency, throughput, engine busy share, GPU utilization), mean
    seconds per phase of the jobs done, and every job's row."""
    busy0, t0 = busy_seconds(stack), time.time()
    rows = run_rate(client, False, tids, templates, workload, args.guidance, args.timeout, until)
    summary = summarize(rows, busy_seconds(stack) - busy0, 1)
    summary["gpu_util"] = sampler.mean(t0, time.time())
    done = [r for r in rows if r["status"] == "done"]
    summary["masked_share"] = sum(r["masked_steps"] for r in done) / (len(done) * args.steps) if done else math.nan
    # steps replayed from CUDA graphs: a batch whose jobs change every few steps runs eagerly
    summary["graph_share"] = (sum(r.get("graph_replayed_steps", 0) for r in done) / (len(done) * args.steps)
                              if done else math.nan)
    return {"summary": summary, "phases": mean_phases(r for r in rows if r["status"] == "done"), "rows": rows}


def run_stack(name: str, out: dict[str, Any], report: dict[str, Any], args: argparse.Namespace, device: torch.device,
              model_dir: Path, edits: Edits, templates: list[Any], until: float, sampler: UtilSampler) -> None:
    """Start the system's stack, warm it, run its burst and rates into ``out`` (in ``report``); then
    copy its processes' warnings and errors into this run's log (the stack's own logs stay in its
    work folder, which a GPU machine does not send back)."""
    try:
        _drive_stack(name, out, report, args, device, model_dir, edits, templates, until, sampler)
    finally:
        log.info("%s: what its processes logged at WARNING and above, and how each log ends:\n%s", name,
                 log_digest(Path(args.workdir) / name / "logs"))


def _drive_stack(name: str, out: dict[str, Any], report: dict[str, Any], args: argparse.Namespace,
                 device: torch.device, model_dir: Path, edits: Edits, templates: list[Any], until: float,
                 sampler: UtilSampler) -> None:
    from app.client import StencilClient
    from app.embedded import EmbeddedStack

    spec = SYSTEMS[name]
    overrides: dict[str, object] = dict(model_dir=str(model_dir), max_batch=args.max_batch, device=str(device),
                                        dtype=args.dtype)
    if "stencil" in spec:  # the GPU host's stage pool on the same device, as a GPU deployment runs it
        overrides.update(stage_placement="gpu_host", stage_device=str(device), batching="continuous",
                         **spec["stencil"])
    worker_env = {"STENCIL_COMPILE": args.stock_compile} if spec.get("compile") else {}
    t0 = time.monotonic()
    with EmbeddedStack.start(Path(args.workdir) / name, gpu_workers=1, stock=bool(spec.get("stock")),
                             worker_env=worker_env, **overrides) as stack:
        out["start_s"] = time.monotonic() - t0
        client = StencilClient(stack.settings)
        tids = [client.add_template(img, f"e2e-{i}") for i, img in enumerate(templates)]
        t1 = time.monotonic()
        if spec.get("warm"):
            for tid in tids:
                rec = client.warm_template(tid, steps=args.steps, guidance=args.guidance).wait(args.timeout)
                if rec.status.value != "done":
                    raise RuntimeError(f"{name}: warm-up of {tid} {rec.status.value}: {rec.error}")
        # Every process's lazy loads, kernels and graphs, outside the measurement: a batch's worth.
        warm = make_workload(1000.0, args.max_batch, report["ratios"], templates, args.steps, seed=1)
        run_rate(client, False, tids, templates, warm, args.guidance, args.timeout, until)
        out["warm_s"] = time.monotonic() - t1
        if spec.get("burst") and time.monotonic() > until:
            out["notes"].append("burst not run: time budget spent")
        elif spec.get("burst"):
            out["runs"]["burst"] = measure(stack, client, tids, templates, burst_workload(edits), args, until, sampler)
            log.info("%s burst: %s", name, _brief(out["runs"]["burst"]["summary"]))
        if not spec.get("rates"):
            return
        cap = capacity(report)
        if cap is None:
            out["notes"].append("no rates: nothing measured a capacity to take multiples of")
            return
        report["capacity"] = {"jobs_per_s": cap[0], "source": cap[1]}
        for k, multiple in enumerate(report["multiples"]):
            rate = multiple * cap[0]
            if time.monotonic() > until:
                out["notes"].append(f"rates from {rate:.3f}/s on not run: time budget spent")
                break
            workload = make_workload(rate, args.jobs, report["ratios"], templates, args.steps, seed=100 + k)
            out["runs"][f"{rate:.4f}"] = run = measure(stack, client, tids, templates, workload, args, until, sampler)
            log.info("%s at %.3f/s: %s", name, rate, _brief(run["summary"]))


def run_inprocess(out: dict[str, Any], args: argparse.Namespace, device: torch.device, model_dir: Path, edits: Edits,
                  sampler: UtilSampler) -> None:
    row = run_stock(model_dir, edits, args, device)
    end = time.time()
    out.update(row, gpu_util=sampler.mean(end - row["total_s"], end))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("stock in process: %.3f jobs/s", row["jobs_per_s"])


def _brief(summary: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in summary.items())


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The Markdown report and the JSON (after every system: a run cut short keeps what it measured)."""
    write_run(args.out, args.json, render(report), {k: v for k, v in report.items() if k != "ratios"})


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, out="docs/bench/e2e_gpu.md", threads=0)
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--model", choices=list(MODELS), default="sd15")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--size", type=int, default=0, help="image side in px (0 = the model's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--burst", type=int, default=32, help="edits of the service-overhead burst")
    p.add_argument("--jobs", type=int, default=20, help="jobs per Poisson rate")
    p.add_argument("--rates", default="0.5,1,2,3", help="comma-separated multiples of the stock's capacity")
    p.add_argument("--templates", type=int, default=2, help="templates of the Poisson runs (1-4)")
    p.add_argument("--trace", default="spring", choices=["spring", "controlnet", "adetailer"])
    p.add_argument("--systems", default="stock-inprocess,stencil-full,stock,stencil",
                   help=f"any of {', '.join(SYSTEMS)} (stock-compiled: with --stock-compile)")
    p.add_argument("--stock-compile", default="", choices=["", "default", "reduce-overhead", "max-autotune"],
                   help="also run stock-compiled: the stock worker's UNet through torch.compile in this mode "
                        "(compilation adds minutes: raise --budget-s)")
    p.add_argument("--budget-s", type=float, default=185.0, help="wall-time budget of the whole run (s)")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for one job (s)")
    p.add_argument("--workdir", default="", help="model and stacks' state (default: a new temporary folder)")
    p.add_argument("--json", default="docs/bench/e2e_gpu.json")
    # --quick: one stack (its start is most of the time on a small CPU); every system with --systems.
    run = start(p, argv, __file__, quick=dict(dtype="float32", steps=3, max_batch=2, burst=3, jobs=3, rates="2",
                                              templates=1, systems="stock-inprocess,stencil", budget_s=240.0,
                                              timeout=120.0, json=""))
    args = run.args
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.stock_compile and "stock-compiled" not in systems:
        systems.insert(systems.index("stock") + 1 if "stock" in systems else len(systems), "stock-compiled")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or ("stock-compiled" in systems and not args.stock_compile):
        p.error(f"--systems: unknown {unknown}" if unknown else "stock-compiled needs --stock-compile MODE")
    device = device_of(args)
    side = args.size or (64 if args.quick else MODELS[args.model][2])
    until = run.t0 + args.budget_s
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="stencil-e2e-gpu-")
    report: dict[str, Any] = {
        "command": run.command, "hardware": hardware(device), "args": vars(args), "side": side,
        "multiples": [float(x) for x in args.rates.split(",")], "ratios": load_trace(args.trace),
        "systems": {}, "notes": []}
    t0 = time.monotonic()
    model_dir = save_model(args, Path(args.workdir))
    report["model"] = {"dir": str(model_dir), "save_s": time.monotonic() - t0}
    edits = Edits(side, args.burst, args.steps, args.seed)
    templates = [img for _name, img in demo_templates(side)][:max(1, min(4, args.templates))]
    sampler = UtilSampler(device)
    # A stage limit's SIGTERM (ops/gpu_checks.sh) unwinds like Ctrl-C: the stacks stop their
    # processes (their own sessions, out of the signal's reach) and the report keeps what ran.
    stop_on_sigterm()
    try:
        for k, name in enumerate(systems):
            left = until - time.monotonic()
            share = SHARE[name] / sum(SHARE[s] for s in systems[k:])
            if left < 10:
                report["notes"].append(f"{name} not run: time budget spent")
                continue
            out: dict[str, Any] = {"runs": {}, "notes": []}
            report["systems"][name] = out
            t0 = time.monotonic()
            try:  # one system's failure costs its rows only: the others still run
                if name == "stock-inprocess":
                    run_inprocess(out, args, device, model_dir, edits, sampler)
                else:
                    run_stack(name, out, report, args, device, model_dir, edits, templates,
                              time.monotonic() + left * share, sampler)
            except Exception as exc:  # noqa: BLE001 - reported in its notes and the log
                log.exception("%s failed", name)
                out["notes"].append(f"failed: {type(exc).__name__}: {str(exc)[-2000:]}")
            out["wall_s"] = time.monotonic() - t0
            report["elapsed_s"] = run.elapsed()
            write(report, args)
    except Stopped as exc:
        report["notes"].append(f"stopped by {exc} after {run.elapsed():.0f} s")
        return 143
    finally:
        sampler.close()
        report["elapsed_s"] = run.elapsed()
        write(report, args)
    log.info("done in %.0f s", run.elapsed())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
