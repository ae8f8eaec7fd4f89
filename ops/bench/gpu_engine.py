"""The engine in process on one device: Stencil's continuous-batching engine, mask-aware with warm
caches and in full compute, against the stock diffusers pipeline in batches, on a burst of edits.

A true-size model with random weights (``workers/models/true_size.py``; SD 1.5 inpainting at 512 px
by default, SDXL inpainting at 1024 px with ``--model sdxl``) is saved in ``--dtype`` and loaded as
the service loads it, everything on ``--device`` (stages too). A template is warmed (its cache
recorded and committed, then resident in host RAM, as after prefetch) and ``--jobs`` edits of it
arrive at once, with mask ratios drawn from the spring trace (``ops/data/mask_ratios``), blob
masks, the ``fast`` policy's refresh steps. Systems, measured in one run:

- ``stock``: ``StableDiffusion(XL)InpaintPipeline`` in batches of ``--max-batch`` (in process);
- ``stencil-full``: the engine without mask-aware compute;
- ``stencil-maskaware``: the engine with mask-aware compute.

For Stencil, a job's time counts its prepare (text and VAE encode), its steps in the engine and
its decode, run one after the other (the service overlaps them across workers). Reported: jobs/s,
mean and P95 latency, and where a steady mask-aware step's time goes (``torch.profiler`` over one
step: the runner's phases as ranges, host and device time). ``--quick``: the shrunk model, a few
jobs, on whatever device (the test suite's smoke run on the CPU).

``--loads L,..`` adds the mask-aware engine under Poisson arrivals, as a running service sees them:
the same edits arrive at L x the burst's engine throughput (jobs/s over its steps), each into the
batch as it runs, so the batch's signature churns and steps run eagerly where no graph fits;
reported per load: jobs/s, the engine's latency (arrival to last step), steps replayed / captured /
eager. ``--growth G,..`` (an ablation of ``workers/maskaware/buckets.GROWTH``) runs each load with
token buckets growing by G, ``--widen L,..`` (of ``workers/engine/graph_calls.WIDEN_LIMIT``; 1 = off)
with steps padded by at most L x to replay a wider batch's graph: both replay more steps
(``ops.bench.graph_churn``) for padded tokens; which serves more jobs/s only the device's timing
says. The report is written after every part (a run cut short keeps what it measured).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.fidelity import policy_schedule
from app.jobs import JobParams
from app.storage.local import LocalStore
from ops.bench.harness.ablations import add_options, bucket_growth, floats, widen_limit
from ops.bench.harness.burst import Edits, row, run_stock
from ops.bench.harness.cli import parser, start
from ops.bench.harness.gpu import DTYPES, device_of, hardware, sync
from ops.bench.harness.report import Stopped, stop_on_sigterm
from workers.engine import graph_calls
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.engine.sd_runner import SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware import buckets
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey, recorded_layout
from workers.maskaware.unet import MaskAwareUNet
from workers.models import true_size
from workers.models.loader import load_cpu_pipeline, load_unet, scheduler_config
from workers.sd_inputs import decode_latents, prepare_job_tensors

log = logging.getLogger(__name__)

MODELS = {"sd15": ("sd15-inpaint", 512), "sdxl": ("sdxl-inpaint", 1024)}
# staging: _groups, _stage_ahead; settle: the read of the step before (waits for the device)
PHASES = ("_groups", "_plan_groups", "_forward", "_stage_ahead", "_after_step", "settle")


def save_model(key: str, quick: bool, dtype: str, workdir: Path) -> Path:
    model_id, _ = MODELS[key]
    return true_size.save_true_size(model_id, workdir / model_id, dtype=dtype, small=quick)


class Stencil:
    """The service's GPU-worker objects in process: stages, runner, engine, provider, recorder."""

    def __init__(self, folder: Path, args: Any, device: torch.device, maskaware: bool, workdir: Path) -> None:
        dtype = DTYPES[args.dtype]
        self.device, self.folder = device, folder
        self.pipe = load_cpu_pipeline(folder, str(device), dtype=dtype)
        self.unet = load_unet(folder, str(device), dtype)
        self.cfg = scheduler_config(folder)
        options: dict[str, Any] = {}
        if maskaware:
            acts = ActivationStore(LocalStore(workdir / "activations"))
            provider = StepCacheProvider(acts, 1 << 36, device=str(device))
            provider.dtype = dtype
            options = {"maskaware": MaskAwareUNet(self.unet), "caches": provider, "recorder": CacheRecorder(acts),
                       "prefetch_steps": 64}
        self.runner = SDRunner(self.unet, self.cfg, str(device), **options)

    def prepare(self, image: Image.Image, mask: Image.Image, params: JobParams, side: int) -> tuple[dict, dict]:
        prep = prepare_job_tensors(self.pipe, self.cfg, image, mask, params, side, side)
        return dict(prep.tensors), dict(prep.meta)

    def warm(self, edits: Edits) -> TemplateCacheKey:
        """The template's warm-up (prompt "", seed 0), committed and resident in host RAM."""
        empty = Image.fromarray(np.zeros((edits.side, edits.side), np.uint8))
        tensors, meta = self.prepare(edits.template, empty, JobParams(prompt="", seed=0, steps=edits.steps), edits.side)
        key = TemplateCacheKey("bench", "tpl", edits.side, edits.side, str(self.cfg["_class_name"]), edits.steps, 1.0,
                               "cfg2", recorded_layout("kv+y", self.runner.dtype))
        engine = Engine(self.runner, BatchScheduler(max_batch=1))
        (handle,), _ = _drive(engine, [(tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))],
                              edits.steps)
        handle.future.result()["commit"].result(600)
        for step in range(edits.steps):
            assert self.runner.caches.wait(key, step, 120) is not None  # type: ignore[union-attr]
        return key

    def edit_jobs(self, edits: Edits, key: TemplateCacheKey | None,
                  count: int | None = None) -> list[tuple[dict, dict]]:
        """Every edit prepared (tensors, meta), or the first ``count``; with ``key``, masked on that
        template's cache with the ``fast`` policy's refresh steps."""
        jobs = []
        for i, params in enumerate(edits.params[:count]):
            tensors, meta = self.prepare(edits.template, edits.mask_image(i), params, edits.side)
            if key is not None:
                meta = dict(meta, cache_mode="masked", cache_key=key.to_dict(),
                            refresh_steps=policy_schedule("fast", edits.steps))
            jobs.append((tensors, meta))
        return jobs

    def burst(self, edits: Edits, args: Any, key: TemplateCacheKey | None) -> dict[str, Any]:
        # One job first, untimed, as the stock pipeline's warm-up call: kernels' lazy state, cuBLAS
        # handles and the allocator's first blocks are then not in the burst's time.
        warm_up = Engine(self.runner, BatchScheduler(max_batch=args.max_batch))
        _drive(warm_up, self.edit_jobs(edits, key, 1), edits.steps)
        sync(self.device)
        t0 = time.perf_counter()
        jobs = self.edit_jobs(edits, key)
        sync(self.device)
        prepared = time.perf_counter()
        engine = Engine(self.runner, BatchScheduler(max_batch=args.max_batch))
        handles, done_at = _drive(engine, jobs, edits.steps)
        stepped = time.perf_counter()
        results = [h.future.result() for h in handles]
        for out in results:
            decode_latents(self.pipe, out["latents"])
        sync(self.device)
        total = time.perf_counter() - t0
        prep_s, decode_s = prepared - t0, time.perf_counter() - stepped
        # a job's latency: all prepares (the burst is prepared first), its steps, one decode each before it
        per_decode = decode_s / len(results)
        latencies = [(d - t0) + per_decode * (k + 1) for k, d in enumerate(sorted(done_at))]
        system = "stencil-maskaware" if key is not None else "stencil-full"
        extra = {"prepare_s": prep_s, "engine_s": stepped - prepared, "decode_s": decode_s,
                 "steps": engine.stats.steps}
        # steps replayed from CUDA graphs (the burst's jobs step together: few signatures)
        extra["graph_replayed_share"] = sum(r["graph_replayed_steps"] for r in results) / (len(results) * edits.steps)
        if key is not None:
            extra["masked_steps"] = sum(r["masked_steps"] for r in results)
            extra["fallback_steps"] = sum(r["fallback_steps"] for r in results)
            extra["refresh_steps"] = sum(r["refresh_steps"] for r in results)
        return row(system, total, latencies, **extra)

    def poisson(self, edits: Edits, args: Any, key: TemplateCacheKey, rate: float) -> dict[str, Any]:
        """The edits arriving at ``rate`` jobs/s (Poisson, seeded) into the mask-aware engine, from no
        graph captured; prepared beforehand and decoded after (as in the burst, not part of the latency)."""
        jobs = self.edit_jobs(edits, key)
        at = np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / rate, len(jobs)))
        graphs = self.runner.graphs
        if graphs is not None:
            graphs.clear()
            graphs.reset_counts()
        sync(self.device)
        engine = Engine(self.runner, BatchScheduler(max_batch=args.max_batch))
        ran_as: list[str] = []
        t0 = time.perf_counter()
        handles, done_at = _drive(engine, jobs, edits.steps, list(at),
                                  lambda: ran_as.append(self.runner.last_step_graph))
        for h in handles:
            h.future.result()
        done = [d - t0 for d in done_at]
        latencies = [d - a for d, a in zip(done, at)]
        second = ran_as[len(ran_as) // 2:]
        widened = graphs.widened if graphs is not None else 0
        return {"rate": rate, "jobs_per_s": len(jobs) / max(done), "mean_s": float(np.mean(latencies)),
                "p95_s": float(np.quantile(latencies, 0.95)), "steps": len(ran_as), "widened": widened / len(ran_as),
                **{k: ran_as.count(k) / len(ran_as) for k in ("replayed", "captured", "eager")},
                **{f"steady_{k}": second.count(k) / max(len(second), 1) for k in ("replayed", "captured", "eager")}}


def under_load(stencil: Stencil, edits: Edits, args: Any, key: TemplateCacheKey, report: "Report") -> None:
    """The Poisson runs into ``report``: each load at each bucket growth and widening limit
    (``--loads``, ``--growth``, ``--widen``; the engine's first)."""
    for load in args.loads:
        for growth in args.growth:
            for widen in args.widen:
                with bucket_growth(growth), widen_limit(widen):
                    r = stencil.poisson(edits, args, key, load * report.capacity)
                report.loaded.append({"load": load, "growth": growth, "widen": widen, **r})
                report.write()
                log.info("load %g growth %g widen %g: %.2f jobs/s, mean %.2f s, replayed %.2f", load, growth, widen,
                         r["jobs_per_s"], r["mean_s"], r["replayed"])


def _shares(r: dict[str, Any], prefix: str) -> str:
    """Replayed / captured / eager shares of a Poisson run's steps, or "graphs off" (no step graphs here)."""
    shares = [r[f"{prefix}{k}"] for k in ("replayed", "captured", "eager")]
    return " / ".join(f"{v:.0%}" for v in shares) if sum(shares) else "graphs off"


def _drive(engine: Engine, jobs: list[tuple[dict, dict]], steps: int, arrivals: Sequence[float] | None = None,
           on_step: Callable[[], None] | None = None) -> tuple[list[Any], list[float]]:
    """Submit the prepared ``jobs`` (job i once ``arrivals[i]`` seconds have passed; all at once
    without) and step the engine until every one is done (``on_step`` after each step that ran):
    their handles and finishing times (perf_counter)."""
    start = time.perf_counter()
    handles: list[Any] = []
    done: dict[int, float] = {}
    while len(done) < len(jobs):
        while len(handles) < len(jobs) and (arrivals is None
                                            or arrivals[len(handles)] <= time.perf_counter() - start):
            tensors, meta = jobs[len(handles)]
            handles.append(engine.submit(f"j{len(handles)}", tensors, meta, total_steps=steps))
        engine._drain_inbox(block=False)
        progressed = engine.step_once()
        if progressed and on_step is not None:
            on_step()
        now = time.perf_counter()
        for i, h in enumerate(handles):
            if i not in done and h.future.done():
                done[i] = now
        if not progressed and len(done) < len(jobs):
            time.sleep(0.0005)
    return handles, [done[i] for i in range(len(jobs))]


def phase_profile(stencil: Stencil, edits: Edits, args: Any, key: TemplateCacheKey) -> list[dict[str, Any]]:
    """One steady mask-aware step of a full batch under the profiler, the runner's phases as ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner = stencil.runner
    originals = {name: getattr(runner, name) for name in PHASES}

    def ranged(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with record_function(f"stencil.{name.strip('_')}"):
                return fn(*a, **k)
        return call

    jobs = []
    for i in range(args.max_batch):
        tensors, meta = stencil.prepare(edits.template, edits.mask_image(i), edits.params[i], edits.side)
        jobs.append((tensors, dict(meta, cache_mode="masked", cache_key=key.to_dict(), refresh_steps=[])))
    engine = Engine(runner, BatchScheduler(max_batch=args.max_batch))
    for i, (t, m) in enumerate(jobs):
        engine.submit(f"p{i}", t, m, total_steps=edits.steps)
    engine._drain_inbox(block=False)
    for _ in range(max(1, min(3, edits.steps - 1))):  # steady: staged ahead, graphs captured
        engine.step_once()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if stencil.device.type == "cuda" else [])
    for name in PHASES:
        setattr(runner, name, ranged(name, originals[name]))
    try:
        with profile(activities=activities) as prof:
            with record_function("stencil.step"):
                engine.step_once()
            sync(stencil.device)
    finally:
        for name in PHASES:
            delattr(runner, name)
    while engine.step_once():
        pass
    rows = []
    for ev in prof.key_averages():
        if ev.key.startswith("stencil."):
            device_us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0))
            rows.append({"phase": ev.key, "host_ms": ev.cpu_time_total / 1e3, "device_ms": device_us / 1e3})
    return rows


class Report:
    """What the run has measured so far, written after every part: a stage cut short by its time
    limit (``ops/gpu_checks.sh``) keeps its finished parts."""

    def __init__(self, run: Any, hw: str, edits: Edits, side: int) -> None:
        self.run, self.hw, self.edits, self.side = run, hw, edits, side
        self.rows: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.loaded: list[dict[str, Any]] = []
        self.capacity = 0.0

    def write(self) -> None:
        args = self.run.args
        self.run.write(self.lines() + [""])
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"hardware": self.hw, "command": self.run.command, "rows": self.rows,
                           "phases": self.phases, "loaded": self.loaded}, fh, indent=1)

    def lines(self) -> list[str]:
        args, edits = self.run.args, self.edits
        base = {r["system"]: r["jobs_per_s"] for r in self.rows}
        lines = [f"# The engine in process on {self.hw}", "", f"Command: `{self.run.command}`", "",
                 f"{MODELS[args.model][0]} at {self.side} px in {args.dtype}, {args.jobs} edits at once, "
                 f"{args.steps} steps, guidance 7.5, max batch {args.max_batch}; mask ratios from the spring trace "
                 f"(mean {np.mean(edits.ratios):.3f}), blob masks; mask-aware: the template warmed and resident, "
                 f"policy fast (refresh steps {policy_schedule('fast', args.steps)}). Each system runs one "
                 "edit untimed first (the stock pipeline one call, Stencil one job through its engine).", "",
                 "| system | jobs/s | vs stock | vs stencil-full | mean latency s | P95 s | notes |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            notes = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                              if k not in ("system", "jobs_per_s", "mean_s", "p95_s"))
            ratios = [f"{r['jobs_per_s'] / base[b]:.2f}x" if b in base else "-" for b in ("stock", "stencil-full")]
            lines.append(f"| {r['system']} | {r['jobs_per_s']:.2f} | {ratios[0]} | {ratios[1]} | {r['mean_s']:.2f} | "
                         f"{r['p95_s']:.2f} | {notes} |")
        if self.phases:
            lines += ["", "A steady mask-aware step of a full batch, by phase (torch.profiler ranges):", "",
                      "| phase | host ms | device ms |", "|---|---|---|"]
            lines += [f"| {ph['phase']} | {ph['host_ms']:.2f} | {ph['device_ms']:.2f} |" for ph in self.phases]
        if self.loaded:
            lines += ["", f"The mask-aware engine under Poisson arrivals: the same {args.jobs} edits arriving at a "
                      f"load x the burst's engine throughput ({self.capacity:.2f} jobs/s), from no graph captured; "
                      "latency: arrival to the job's last step (prepare and decode apart). Steps by how their denoiser "
                      f"call ran (whole run; steady: its second half). The engine's bucket growth is {buckets.GROWTH} "
                      f"and it widens steps by at most {graph_calls.WIDEN_LIMIT} (1: off); widened: the steps that "
                      "replayed a wider batch's graph.", "",
                      "| load | bucket growth | widen | offered jobs/s | jobs/s | mean latency s | P95 s | "
                      "engine steps | replayed / captured / eager | steady: replayed / captured / eager | widened |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['load']:g} | {r['growth']:g} | {r['widen']:g} | {r['rate']:.2f} | {r['jobs_per_s']:.2f} | "
                      f"{r['mean_s']:.2f} | {r['p95_s']:.2f} | {r['steps']} | {_shares(r, '')} | "
                      f"{_shares(r, 'steady_')} | {r['widened']:.0%} |" for r in self.loaded]
        return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, out="docs/bench/gpu_engine.md", threads=0)
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--model", choices=list(MODELS), default="sd15")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--systems", default="stock,stencil-full,stencil-maskaware")
    p.add_argument("--json", default="docs/bench/gpu_engine.json")
    p.add_argument("--loads", type=floats, default=[],
                   help="Poisson arrivals at these x the mask-aware burst's engine throughput (module doc)")
    add_options(p, "with --loads: ")
    run = start(p, argv, __file__, quick=dict(jobs=3, steps=3, max_batch=2, dtype="float32", threads=1, json="",
                                                        loads=[1.0]))
    if run.args.loads and "stencil-maskaware" not in run.args.systems.split(","):
        p.error("--loads needs the stencil-maskaware system (its burst sets the arrival rate)")
    args = run.args
    device = device_of(args)
    side = 64 if args.quick else MODELS[args.model][1]
    edits = Edits(side, args.jobs, args.steps, args.seed)
    report = Report(run, hardware(device), edits, side)
    stop_on_sigterm()
    try:
        measure_systems(args, device, edits, report)
    except Stopped:
        log.warning("stopped by SIGTERM: the report holds the systems measured so far")
        report.write()
        return 143
    report.write()
    return 0


def measure_systems(args: Any, device: torch.device, edits: Edits, report: Report) -> None:
    """Each system named in ``--systems`` in turn, the report written after each."""
    with tempfile.TemporaryDirectory(prefix="stencil-gpu-engine-") as tmp:
        workdir = Path(tmp)
        folder = save_model(args.model, args.quick, args.dtype, workdir)
        systems = args.systems.split(",")
        if "stock" in systems:
            report.rows.append(run_stock(folder, edits, args, device))
            report.write()
        if "stencil-full" in systems:
            report.rows.append(Stencil(folder, args, device, False, workdir).burst(edits, args, None))
            report.write()
        if "stencil-maskaware" in systems:
            stencil = Stencil(folder, args, device, True, workdir)
            key = stencil.warm(edits)
            report.rows.append(stencil.burst(edits, args, key))
            report.write()
            try:  # the process's first profiler session, over graphs captured before it: never the rows' loss
                report.phases = phase_profile(stencil, edits, args, key)
            except Exception:  # noqa: BLE001 - reported, and the run goes on without the phases
                log.exception("the phase profile failed; the report goes without it")
            report.write()
            report.capacity = len(edits.params) / report.rows[-1]["engine_s"]
            under_load(stencil, edits, args, key, report)
            stencil.runner.caches.close()  # type: ignore[union-attr]


if __name__ == "__main__":
    raise SystemExit(main())
