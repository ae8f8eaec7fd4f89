"""Mixed image sizes in one batch, and SLO-aware scheduling: four systems on one mixed-size trace.

Systems (the engine's parameters that select them; the service's are the defaults of the options):

- ``one``: one job at a time (``STENCIL_MAX_BATCH=1``);
- ``bucketed``: batches of one image size only (``STENCIL_BATCHING=bucketed``: when a batch drains,
  the next bucket is the first waiting job's size);
- ``mixed``: Stencil's continuous batching, every size in one batch (exact: one denoiser call per
  size, ``--mixed-size-calls``: in lockstep, transformer blocks packing
  all sizes' tokens, or one after the other), first come first served with
  size affinity (``--size-affinity-steps``: under a queue, free slots
  go first to sizes already in the batch, a job passed over that many steps goes first; 0 = strict FCFS)
  and the way the batch changes size (``--size-switch``: ``mix`` the new size
  into free slots, ``drain`` the batch first as a bucket does; ``auto`` resolves as the service does
  for the device each part models: drain for the real CPU run and the CPU-fitted simulation, mix for
  the GPU-shaped one);
- ``mixed-slo``: the same with SLO-aware admission (``STENCIL_SLO_ADMISSION=1``: jobs that can make
  their deadline first, in slack, arrival or deadline order, ``--slo-order``,
  ``auto``: slack for the CPU parts, deadline for the GPU-shaped one; admission refused when it would make a
  running job miss its deadline, late jobs last; a running job gives its slot back once it misses
  even alone or, ``--slo-yield``, once the batch's prediction misses it;
  predicted finishes stretched by ``--slo-margin``; ``auto``: alone and 0
  for the CPU parts, batch and 0.01 for the GPU-shaped one) fed by the
  resolution-aware batch step-time predictor (``app/steptime.py``, fitted by ``stencil profile --sizes``),
  corrected online by the engine's measured steps (``--step-time-calibration``, ``app/calibration.py``);
  in the simulations, engines publish which waiting jobs are late and routers leave those out of a
  worker's load (``app/routing.py``; ``--route-late count``: as engines that do not publish it).

Trace: Poisson arrivals; sizes drawn from ``--sizes`` (width x height : weight); mask ratios from a
public trace (``ops/data/mask_ratios``, non-empty masks) with mask shapes from ``app.maskgen``; every
job without a deadline gets the service's default, ``--slo-factor`` x its standalone time (alone on
an idle worker, predicted), as the dispatcher assigns it. Loads are fractions of the mixed system's
predicted capacity (full batches of jobs drawn from the trace).

Real run (this machine): the service's engine in process (``Engine``, ``BatchScheduler``,
``SDRunner`` with ``MaskAwareUNet``, the embedded trained SD model, a template cache warmed per size,
inputs prepared as ``prepare`` does), one engine as one GPU worker. Time is virtual: the clock
advances by each engine iteration's measured CPU time (``--clock cpu``, the process's CPU time with
one torch thread; lockstep threads compute one at a time) or wall time (``--clock wall``), and jobs
arrive on that clock, so other load on this shared machine does not change the result. Before the
measured loads, ``--warmup-jobs`` jobs go through every system unrecorded (one-off costs would
otherwise land on the first system measured). Not in it:
the CPU stages (decode, text and VAE encoding, which ``prepare`` runs before the engine) and the
Redis/Celery hand-offs; the end-to-end path of the SLO fields is covered by the service tests.

Simulation (``ops/sim/cluster.py``: the production router and ``BatchScheduler`` against simulated
workers; least-requests routing (``--sim-router``: another policy of ``app/routing.py``) with the
service's size affinity, ``app.routing.ROUTING_SIZE_SLACK``: a job goes to a worker idle or already
running its size when one is within that many jobs of the least loaded, for all four systems) of the
same trace with two step-cost models: the CPU-fitted batch predictor, and a GPU-shaped one whose
batch cost is sublinear: a step of work W (a job's work = its predicted standalone step time
relative to a full-compute 128x128 job, i.e. one SD-1.5 512x512 inpainting image) takes
``gpu_step_seconds(W)``, the A100 curve of diffusers' benchmark (``GPU_CURVE``), or, with ``--gpu-costs``
(default ``measured``), the curve measured on an H200 (``ops/sim/gpu_costs.py``; ``measured-host-bound``
prices masked jobs as the measured mask-aware step ran, not by their tokens). A batch mixing
sizes runs one UNet call per size (lockstep) whose transformer blocks pack every size's tokens, so
its step costs ``TRANSFORMER_SHARE`` x g(all the work) + the rest x the sum over sizes of g(that
size's work): each size's convolutions pay the GPU's small-batch floor again.

    python -m ops.bench.mixed_sizes --out docs/bench/mixed_sizes.md
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.calibration import STEP_TIME_CALIBRATION, calibrated
from app.costmodel import CostModel
from app.demo import demo_templates
from app.jobs import JobParams
from app.maskgen import SHAPES, make_mask
from app.routing import POLICIES, ROUTING_SIZE_SLACK, make_policy
from app.settings import Settings
from app.steptime import BatchPredictor, JobShape
from app.storage import LocalStore
from ops.bench.harness import cli
from ops.bench.harness.edits import load_pipeline
from ops.bench.harness.engine import record
from ops.bench.harness.report import finish_axes, pyplot, save_figure
from ops.bench.harness.timing import loadavg
from ops.sim import gpu_costs as gpu_cost_data
from ops.sim.cluster import Cluster, ClusterConfig
from ops.sim.mixed import ShapeJob, capacity, job_shape, parse_sizes, sim_jobs
from ops.sim.workload import MixedArrival, mixed_arrivals
from workers.engine.engine import Engine
from workers.engine.scheduler import (
    SIZE_AFFINITY_STEPS,
    SIZE_SWITCHES,
    SLO_ORDERS,
    SLO_YIELDS,
    BatchScheduler,
    parse_slo_margin,
    size_switch_for,
    slo_margin_for,
    slo_order_for,
    slo_yield_for,
)
from workers.engine.sd_runner import MIXED_SIZE_CALLS, SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.maskaware.unet import MaskAwareUNet
from workers.sd_inputs import prepare_job_tensors

log = logging.getLogger(__name__)

SYSTEMS = ("one", "bucketed", "mixed", "mixed-slo")
LETTERS = {"one": "a", "bucketed": "b", "mixed": "c", "mixed-slo": "d"}
LABELS = {"one": "(a) one job at a time", "bucketed": "(b) bucketed (one size per batch)",
          "mixed": "(c) Stencil mixed batches (continuous)", "mixed-slo": "(d) mixed batches, SLO-aware"}
PROMPTS = ["a red scarf", "a hat", "flowers", "a cat", "sunglasses"]

# The GPU-shaped batch cost: seconds of one denoising step of B SD-1.5 inpainting images at 512x512
# (classifier-free guidance, 2 UNet rows each) on an A100, from diffusers' PyTorch 2.0 benchmark
# (docs/source/en/optimization/torch2.0.mdx, "SD - inpaint", torch 2.0 without compile, fp16):
# 22.24 it/s at batch 1, 11.67 it/s at batch 4, 3.04 it/s at batch 16 -> 1 / (it/s) per step.
GPU_CURVE = ((1.0, 1 / 22.24), (4.0, 1 / 11.67), (16.0, 1 / 3.04))
# Transformer blocks' share of an SD-architecture UNet step (BENCHMARKS.md, ops/bench/maskaware_unet.py:
# f = 0.466 for block_out_channels (320, 640) at 4096 tokens, measured on this CPU): the part of a
# mixed-size step that is one packed computation; the rest (convolutions, ResNets) runs per size.
TRANSFORMER_SHARE = 0.466
# What the GPU-shaped step cost is (``--gpu-costs``): the sourced A100 curve above, or the curve measured
# on an H200 (``ops/sim/gpu_costs.py``) with masked work priced by its share of tokens (what a
# mask-aware step would cost if it paid as its tokens do) or as the measured mask-aware step ran.
GPU_COSTS = {"measured": "SD-1.5 inpainting batch curve measured on one H200 (bfloat16), masked work scaled by its "
                         "share of tokens (if the mask-aware step pays; not measured)",
             "measured-host-bound": "SD-1.5 inpainting batch curve measured on one H200 (bfloat16), masked jobs "
                                    "at full work with the step stretched by the measured (host-bound) mask-aware "
                                    "speed at its job count (ratio 0.2)",
             "sourced": "A100 SD-1.5 inpainting batch curve (diffusers' docs)"}
GPU_SOURCE = ("diffusers, `docs/source/en/optimization/torch2.0.mdx` (A100 tables, row \"SD - inpaint\", "
              "torch 2.0 without compile: 22.24 / 11.67 / 3.04 it/s at batch 1 / 4 / 16)")


def gpu_step_seconds(work: float) -> float:
    """Step seconds for ``work`` (in 512x512 full-compute images): piecewise linear through
    ``GPU_CURVE``, extended with its first and last slopes. A batch of 4 costs 1.9x one image, 16
    cost 7.3x: the sublinear batch cost of a GPU that one image leaves underused."""
    pts = GPU_CURVE
    if work <= pts[1][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif work <= pts[-1][0]:
        i = next(k for k in range(1, len(pts)) if work <= pts[k][0])
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    else:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return max(1e-4, y0 + (y1 - y0) * (work - x0) / (x1 - x0))


# -- real run: the engine in process on a virtual clock ------------------------------------------------


@dataclass
class RealJob:
    arrival: MixedArrival
    tensors: dict[str, Any]
    meta: dict[str, Any]
    shape: JobShape
    deadline: float
    alone: float


@dataclass
class Outcome:
    """One job's result in one run."""

    arrival: float
    deadline: float
    finish: float | None = None
    size: tuple[int, int] = (0, 0)
    start: float | None = None  # its first step
    alone: float = 0.0  # its predicted standalone time

    @property
    def met(self) -> bool:
        return self.finish is not None and self.finish <= self.deadline

    @property
    def missed_queued(self) -> bool:
        """Missed, and its first step came too late to make the deadline even alone: lost to the
        queue (admission order, refusals), not to the batch it ran in."""
        return not self.met and (self.start is None or self.start + self.alone > self.deadline)


@dataclass
class RunStats:
    outcomes: list[Outcome] = field(default_factory=list)
    steps: int = 0
    batch_jobs: int = 0
    step_pred: list[float] = field(default_factory=list)  # predicted vs measured step seconds (mixed batches)
    step_meas: list[float] = field(default_factory=list)
    step_mixes: list[bool] = field(default_factory=list)  # whether each of those steps mixed sizes
    mixed_steps: int = 0
    refused: int = 0
    yielded: int = 0
    calibration: float | None = None  # (d): the online correction factor at the end


def summarize(stats: RunStats) -> dict[str, float]:
    done = [o for o in stats.outcomes if o.finish is not None]
    lat = np.array([o.finish - o.arrival for o in done]) if done else np.array([np.nan])  # type: ignore[operator]
    span = max(o.finish for o in done) - min(o.arrival for o in stats.outcomes) if done else np.nan  # type: ignore[type-var]
    return {"jobs": len(stats.outcomes), "done": len(done), "throughput": len(done) / span if done else 0.0,
            "slo": float(np.mean([o.met for o in stats.outcomes])), "mean": float(lat.mean()),
            "missed_queued": float(np.mean([o.missed_queued for o in stats.outcomes])),
            "p95": float(np.percentile(lat, 95)), "batch": stats.batch_jobs / max(stats.steps, 1),
            "steps": stats.steps, "mixed_steps": stats.mixed_steps, "refused": stats.refused, "yielded": stats.yielded}


class RealBench:
    """The embedded trained SD model behind the service's runner, template caches per size."""

    def __init__(self, args: argparse.Namespace, sizes: list[tuple[int, int]]) -> None:
        self.args = args
        self.pipe = load_pipeline("sd", args.model)
        unet = self.pipe.unet.eval()
        self.sched_cfg = {**dict(self.pipe.scheduler.config), "_class_name": type(self.pipe.scheduler).__name__}
        store = ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-mixed-acts-")))
        self.runner = SDRunner(unet, self.sched_cfg, maskaware=MaskAwareUNet(unet),
                               caches=StepCacheProvider(store, 1 << 30), recorder=CacheRecorder(store),
                               prefetch_steps=args.steps, mixed_sizes=args.mixed_size_calls)
        base = demo_templates(256)
        self.templates = {}
        self.keys = {}
        params = JobParams(prompt="", seed=0, steps=args.steps, guidance=args.guidance)
        for k, (w, h) in enumerate(sizes):
            for t in range(args.templates_per_size):
                image = base[(k + t) % len(base)][1].resize((w, h))  # t = 0: as with one template per size
                tensors, meta = self.prepare(image, np.zeros((h, w), bool), params, (w, h))
                key = TemplateCacheKey(model_id="bench-mixed", template_id=f"t{w}x{h}" + (f"-{t}" if t else ""),
                                       height=h, width=w, scheduler=self.sched_cfg["_class_name"], steps=args.steps,
                                       strength=1.0, guidance="cfg2", layout=self.runner.maskaware.cache_layout)
                record(self.runner, tensors, meta, key, resident_steps=args.steps)
                self.templates[(w, h, t)], self.keys[(w, h, t)] = image, key
        log.info("warmed %d template cache(s) per size: %s", args.templates_per_size, sorted(self.keys))

    def prepare(self, image: Image.Image, mask: np.ndarray, params: JobParams, size: tuple[int, int]
                ) -> tuple[dict, dict]:
        w, h = size
        prep = prepare_job_tensors(self.pipe, self.sched_cfg, image, Image.fromarray(mask.astype(np.uint8) * 255),
                                   params, h, w)
        return dict(prep.tensors), dict(prep.meta)

    def jobs(self, arrivals: list[MixedArrival], predictor: BatchPredictor, cost: CostModel) -> list[RealJob]:
        """Each arrival prepared as ``prepare`` would (before the replay: not on its clock)."""
        out = []
        for a in arrivals:
            w, h = a.size
            mask = make_mask(a.ratio, (w, h), SHAPES[a.seed % len(SHAPES)], seed=a.seed)
            params = JobParams(prompt=PROMPTS[a.seed % len(PROMPTS)], seed=a.seed % 100_000, steps=self.args.steps,
                               guidance=self.args.guidance)
            template = (w, h, a.seed % self.args.templates_per_size)
            tensors, meta = self.prepare(self.templates[template], mask, params, (w, h))
            if a.ratio < 0.999 and mask.any() and not mask.all():
                meta = dict(meta, cache_mode="masked", cache_key=self.keys[template].to_dict())
            shape = job_shape(a, mask, predictor, cost) if meta.get("cache_mode") == "masked" else \
                JobShape(predictor.latent_hw(h, w), None, 2)
            alone = predictor.alone_seconds(shape, self.args.steps)
            out.append(RealJob(a, tensors, meta, shape, a.arrival + self.args.slo_factor * alone, alone))
        return out

    def replay(self, system: str, jobs: list[RealJob], predict: Any) -> RunStats:
        """Jobs through one engine on a virtual clock advanced by each iteration's measured time."""
        clock_fn = time.process_time if self.args.clock == "cpu" else time.perf_counter
        now = [0.0]
        slo = system == "mixed-slo"
        # (d)'s predictor as the service builds it (workers/gpu_tasks.py): corrected online by the engine's steps
        step_time = calibrated(predict, self.args.step_time_calibration) if slo else None
        sched = BatchScheduler(1 if system == "one" else self.args.max_batch,
                               "bucketed" if system == "bucketed" else "continuous",
                               step_time=step_time, clock=lambda: now[0],
                               size_affinity_steps=self.args.size_affinity_steps,
                               size_switch=size_switch_for(self.args.size_switch, str(self.runner.device)),
                               slo_order=slo_order_for(self.args.slo_order, str(self.runner.device)),
                               slo_yield=slo_yield_for(self.args.slo_yield, str(self.runner.device)),
                               slo_margin=slo_margin_for(self.args.slo_margin, str(self.runner.device)))
        engine = Engine(self.runner, sched, clock=clock_fn)  # steps measured on the run's clock
        inner, step_s = self.runner.step, [0.0]

        def timed_step(batch: list[Any]) -> None:  # the runner's step alone (the predictor's target)
            start = clock_fn()
            try:
                inner(batch)
            finally:
                step_s[0] = clock_fn() - start

        self.runner.step = timed_step  # type: ignore[method-assign]
        try:
            return self._replay(engine, sched, jobs, predict, clock_fn, now, step_s)
        finally:
            del self.runner.step

    def _replay(self, engine: Engine, sched: BatchScheduler, jobs: list[RealJob], predict: Any, clock_fn: Any,
                now: list[float], step_s: list[float]) -> RunStats:
        stats = RunStats([Outcome(j.arrival.arrival, j.deadline, size=j.arrival.size, alone=j.alone) for j in jobs])
        pending = list(range(len(jobs)))
        live: dict[int, Any] = {}
        while pending or live:
            arrived = []
            while pending and jobs[pending[0]].arrival.arrival <= now[0]:
                i = pending.pop(0)
                arrived.append((i, copy.deepcopy(jobs[i].tensors)))  # the bench's copy: not on the clock
            t0 = clock_fn()
            for i, tensors in arrived:
                j = jobs[i]
                live[i] = engine.submit(f"j{i}", tensors, dict(j.meta), total_steps=self.args.steps,
                                        deadline=j.deadline, hard_deadline=False, mask_ratio=j.arrival.ratio,
                                        template_id=f"t{j.arrival.size}")
            engine._drain_inbox(block=False)
            batch_before = list(sched.running)
            ran = engine.step_once()
            elapsed = clock_fn() - t0  # the iteration (new jobs' runner state, scheduling, the step)
            if not ran:  # an idle engine hands over what its last step finished (a GPU reads it late)
                _finished(live, stats, now[0] + elapsed)
                if pending:
                    now[0] = max(now[0] + elapsed, jobs[pending[0]].arrival.arrival)
                continue
            now[0] += elapsed
            rec = engine.stats.history[-1]
            stats.steps += 1
            stats.batch_jobs += len(rec.job_ids)
            for job_id in rec.job_ids:
                outcome = stats.outcomes[int(job_id[1:])]
                if outcome.start is None:
                    outcome.start = now[0] - elapsed
            batch = [j for j in sched.running + batch_before if j.job_id in rec.job_ids]
            batch = list({id(j): j for j in batch}.values())
            mixes = len({j.latent_hw for j in batch}) > 1
            stats.mixed_steps += mixes
            if predict is not None and batch:  # the predictor's error on this step alone
                stats.step_pred.append(predict(batch))
                stats.step_meas.append(step_s[0])
                stats.step_mixes.append(mixes)
            _finished(live, stats, now[0])
        stats.refused, stats.yielded = sched.refused, sched.yielded
        stats.calibration = getattr(sched.step_time, "factor", None)
        return stats


def _finished(live: dict[int, Any], stats: RunStats, now: float) -> None:
    """Record the jobs whose results were handed over (successful ones finish at ``now``)."""
    for i in [i for i, h in live.items() if h.future.done()]:
        handle = live.pop(i)
        if handle.future.exception() is None:
            stats.outcomes[i].finish = now


def run_real(args: argparse.Namespace, sizes: list[tuple[int, int]], weights: list[float], cost: CostModel
             ) -> dict[str, Any]:
    from app.costmodel import step_time_predictor

    predictor = cost.batch
    assert predictor is not None
    predict = step_time_predictor(cost)
    bench = RealBench(args, sizes)
    probe = mixed_arrivals(sizes, weights, args.trace, 1.0, 400, args.seed + 1000)
    cap = capacity(predictor.step_seconds, [job_shape(a, None, predictor, cost) for a in probe], args.max_batch,
                   args.steps, args.seed)
    log.info("real run: predicted capacity of the mixed system %.2f jobs/s", cap)
    if args.warmup_jobs:  # one-off costs (allocator, kernel setup per shape) off the record of the first system
        warm = bench.jobs(mixed_arrivals(sizes, weights, args.trace, cap, args.warmup_jobs, args.seed + 7), predictor,
                          cost)
        for system in args.systems:
            bench.replay(system, warm, predict)
        log.info("warm-up: %d jobs through each system, not recorded", args.warmup_jobs)
    results: dict[str, Any] = {"capacity": cap, "warmup_jobs": args.warmup_jobs, "loads": {}}
    for load in args.loads:
        arrivals = mixed_arrivals(sizes, weights, args.trace, load * cap, args.jobs, args.seed)
        jobs = bench.jobs(arrivals, predictor, cost)
        rounds: dict[str, list[dict[str, float]]] = {s: [] for s in args.systems}
        for r in range(args.rounds):  # the same prepared jobs for every system, one after the other
            order = args.systems if r % 2 == 0 else args.systems[::-1]  # drift of the machine hits both alike
            for system in order:
                rounds[system].append(_measured(bench.replay(system, jobs, predict)))
                log.info("real load %.2f %s round %d: %s", load, system, r,
                         {k: round(v, 3) for k, v in rounds[system][-1].items()})
        per = {s: _mean_of_rounds(rs) for s, rs in rounds.items()}
        results["loads"][str(load)] = per
    return results


def _measured(stats: RunStats) -> dict[str, float]:
    """One replay's summary, with the predictor's error on its steps and (d)'s calibration factor."""
    out = summarize(stats)
    if stats.step_meas:
        meas, pred = np.array(stats.step_meas), np.array(stats.step_pred)
        out["step_mape"] = float(np.mean(np.abs(pred - meas) / meas))
        out["step_bias"] = float(np.mean((pred - meas) / meas))  # < 0: steps slower than predicted
        out["step_points"] = len(meas)
        # the fit's bias on steps that mixed sizes and on steps of one size, apart (NaN: no such step)
        mixes = np.array(stats.step_mixes, dtype=bool)
        for name, sel in (("step_bias_mixed", mixes), ("step_bias_one_size", ~mixes)):
            out[name] = float(np.mean((pred[sel] - meas[sel]) / meas[sel])) if sel.any() else float("nan")
    if stats.calibration is not None:
        out["calibration"] = stats.calibration
    return out


def _mean_of_rounds(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Every number averaged over the rounds; each round's throughput, SLO satisfaction and predictor bias
    kept (paired ratios, and drift between replays shown beside them)."""
    out: dict[str, Any] = {k: float(np.mean([r[k] for r in rounds])) for k in rounds[0]}
    for key in ("throughput", "slo", "step_bias"):
        if all(key in r for r in rounds):
            out[f"{key}_rounds"] = [r[key] for r in rounds]
    return out


# -- simulation -----------------------------------------------------------------------------------


def sim_costs(cost: CostModel, gpu_costs: str = "measured") -> dict[str, tuple[Any, str]]:
    """Step-cost functions of engine jobs: the CPU-fitted batch predictor, and the GPU-shaped curve
    (``gpu_costs``: one of ``GPU_COSTS``)."""
    from app.costmodel import step_time_predictor
    from app.steptime import engine_job_shape

    predictor = cost.batch
    assert predictor is not None
    cpu = step_time_predictor(cost)
    ref = predictor.step_seconds([JobShape(predictor.latent_hw(128, 128), None, 2)])

    def work(j: Any) -> float:
        return cpu([j]) / ref

    def full_work(j: Any) -> float:
        shape = engine_job_shape(j, predictor.spec.levels, tuple(cost.arch.latent_hw))  # type: ignore[arg-type]
        return predictor.step_seconds([JobShape(shape.latent_hw, None, shape.rows)]) / ref

    measured = gpu_cost_data.load()
    curve = gpu_step_seconds if gpu_costs == "sourced" else measured.step_seconds
    gpu = gpu_cost_data.batch_step_cost(curve, work, TRANSFORMER_SHARE, full_work=full_work,
                                        costs=measured if gpu_costs == "measured-host-bound" else None)
    return {"cpu-fitted": (cpu, "batch step-time SVR fitted on this CPU (the real run's predictor)"),
            "gpu-shaped": (gpu, GPU_COSTS[gpu_costs] + "; each job's work = its CPU-fitted standalone "
                                "step time over a full 128x128 job's (= one 512x512 image)"
                                + (" computed in full" if gpu_costs == "measured-host-bound" else "")
                                + "; a step mixing k sizes: "
                                f"{TRANSFORMER_SHARE} x g(total work) + {1 - TRANSFORMER_SHARE:.3f} x sum of g(work of "
                                "each size) (transformer blocks packed, convolutions per size)")}


def gpu_curve_note(gpu_costs: str) -> str:
    """Where the GPU-shaped step cost's curve comes from, for the report."""
    if gpu_costs == "sourced":
        return (f" GPU curve: {GPU_SOURCE}; a step of W images costs W=1: "
                f"{gpu_step_seconds(1) * 1e3:.1f} ms, W=4: {gpu_step_seconds(4) * 1e3:.1f} ms, W=8: "
                f"{gpu_step_seconds(8) * 1e3:.1f} ms.")
    measured = gpu_cost_data.load()
    return (f" GPU curve (`--gpu-costs {gpu_costs}`): {gpu_cost_data.describe(measured)}; a step of W images costs "
            + ", ".join(f"W={w}: {measured.step_seconds(w) * 1e3:.1f} ms" for w in (1, 4, 8)) + ".")


def run_sim(args: argparse.Namespace, sizes: list[tuple[int, int]], weights: list[float], cost: CostModel
            ) -> dict[str, Any]:
    predictor = cost.batch
    assert predictor is not None
    out: dict[str, Any] = {}
    for name, (step_cost, text) in sim_costs(cost, args.gpu_costs).items():
        if name not in args.sim_costs.split(","):
            continue
        def shape_cost(shapes: list[JobShape], fn: Any = step_cost) -> float:
            return fn([ShapeJob(s) for s in shapes])

        probe = mixed_arrivals(sizes, weights, args.trace, 1.0, 400, args.seed + 1000)
        cap1 = capacity(shape_cost, [job_shape(a, None, predictor, cost) for a in probe], args.max_batch,
                        args.steps, args.seed)
        cap = cap1 * args.sim_workers
        device = sim_device(name)
        res: dict[str, Any] = {"capacity": cap, "text": text, "loads": {}}
        for load in args.sim_loads:
            per: dict[str, list[dict[str, float]]] = {s: [] for s in args.systems}
            for seed in args.sim_seeds:
                arrivals = mixed_arrivals(sizes, weights, args.trace, load * cap, args.sim_jobs, seed)
                for system in args.systems:
                    jobs = sim_jobs(arrivals, predictor, cost, args, step_cost)
                    cfg = ClusterConfig(workers=args.sim_workers, max_batch=1 if system == "one" else args.max_batch,
                                        slo_admission=system == "mixed-slo", noise=args.sim_noise, seed=seed,
                                        batching="bucketed" if system == "bucketed" else "continuous",
                                        step_cost=step_cost, step_time=_scaled(step_cost, args.sim_predictor_scale),
                                        host_templates=64, size_affinity_steps=args.size_affinity_steps,
                                        size_switch=size_switch_for(args.size_switch, device),
                                        slo_order=slo_order_for(args.slo_order, device),
                                        slo_yield=slo_yield_for(args.slo_yield, device),
                                        slo_margin=slo_margin_for(args.slo_margin, device),
                                        publish_late=args.route_late == "skip",
                                        step_time_calibration=args.step_time_calibration)
                    cluster = Cluster(cost, cfg, make_policy(args.sim_router, cost, size_slack=args.size_slack))
                    cluster.run(jobs)
                    stats = RunStats([Outcome(j.arrival, j.deadline, j.finish, j.latent_hw or (0, 0),
                                              j.extra.get("start"), j.alone_s) for j in jobs],
                                     steps=cluster.steps, batch_jobs=sum(j.steps for j in jobs if j.finish is not None))
                    per[system].append(summarize(stats))
            res["loads"][str(load)] = {s: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]}
                                       for s, rs in per.items()}
            log.info("sim %s load %.2f: %s", name, load, {s: (round(v["throughput"], 2), round(v["slo"], 3))
                                                         for s, v in res["loads"][str(load)].items()})
        out[name] = res
    return out


def sim_device(cost_name: str) -> str:
    """The device a simulated step cost stands for, as the service's ``auto`` settings resolve it."""
    return "cuda" if cost_name == "gpu-shaped" else "cpu"


def _scaled(fn: Any, scale: float) -> Any:
    """The SLO predictor as a fit that is off by ``scale`` (e.g. 0.85: steps 15% slower than predicted)."""
    if scale == 1.0:
        return fn
    return lambda jobs: scale * fn(jobs)


# -- report ---------------------------------------------------------------------------------------


def table(per_load: dict[str, Any], systems: list[str], with_mape: bool = False) -> list[str]:
    lines = ["| load | system | throughput jobs/s | x (a) | x (b) | SLO satisfaction | missed in the queue | mean s "
             "| P95 s | mean batch |" + (" steps mixing sizes | predictor MAPE on its steps |" if with_mape else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if with_mape else "")]
    for load, per in per_load.items():
        base = {k: per.get(k, {}).get("throughput") for k in ("one", "bucketed")}
        for s in systems:
            r = per[s]
            rel = [f"{r['throughput'] / base[k]:.2f}x" if base[k] else "-" for k in ("one", "bucketed")]
            extra = (f" {int(r['mixed_steps'])} / {int(r['steps'])} | "
                     + (f"{r['step_mape'] * 100:.1f}% |" if "step_mape" in r else "- |")) if with_mape else ""
            lines.append(f"| {float(load):.2f} | {LABELS[s]} | {r['throughput']:.3f} | {rel[0]} | {rel[1]} | "
                         f"{r['slo'] * 100:.1f}% | "
                         + (f"{r['missed_queued'] * 100:.1f}%" if "missed_queued" in r else "-")
                         + f" | {r['mean']:.2f} | {r['p95']:.2f} | {r['batch']:.2f} |" + extra)
    return lines


def claims(per_load: dict[str, Any], throughput_target: float, versus_b: bool = True) -> list[str]:
    """The issue's targets on one set of results: throughput at the highest load (against (a), and
    against (b) where ``versus_b``), SLO at every load where (c) satisfies 80% or fewer."""
    out = []
    loads = sorted(per_load, key=float)
    top = per_load[loads[-1]]
    if {"one", "bucketed", "mixed"} <= set(top):
        c, a, b = top["mixed"]["throughput"], top["one"]["throughput"], top["bucketed"]["throughput"]
        ok = c >= throughput_target * a and (c >= b or not versus_b)
        out.append(f"- Throughput at load {float(loads[-1]):.2f}: (c) {c:.3f} jobs/s = **{c / a:.2f}x (a)** "
                   f"(target >= {throughput_target:.2f}x) and **{c / b:.2f}x (b)**"
                   + (" (target >= 1.00x)" if versus_b else "") + ": " + ("**met**" if ok else "**not met**") + ".")
    if {"one", "bucketed", "mixed"} <= set(top):
        below = [ld for ld in loads if per_load[ld]["mixed"]["throughput"] >= per_load[ld]["bucketed"]["throughput"]]
        out.append(f"- (c) >= (b) in throughput at loads {', '.join(f'{float(ld):.2f}' for ld in below) or 'none'} "
                   f"of {', '.join(f'{float(ld):.2f}' for ld in loads)}; (c) > (a) at "
                   + (", ".join(f"{float(ld):.2f}" for ld in loads
                                if per_load[ld]["mixed"]["throughput"] > per_load[ld]["one"]["throughput"]) or "none")
                   + ".")
    hits = [ld for ld in loads if "mixed" in per_load[ld] and "mixed-slo" in per_load[ld]
            and per_load[ld]["mixed"]["slo"] <= 0.8]
    if not hits:
        out.append("- SLO: no load where (c) satisfies 80% or fewer in this run.")
    for k, ld in enumerate(hits):
        c, d = per_load[ld]["mixed"]["slo"], per_load[ld]["mixed-slo"]["slo"]
        gain = d / c - 1 if c > 0 else float("inf")
        out.append(f"- SLO satisfaction at load {float(ld):.2f}"
                   + (" (the first where (c) is at 80% or fewer)" if k == 0 else "")
                   + f": (c) {c * 100:.1f}%, (d) {d * 100:.1f}%: **{gain * 100:+.0f}% relative** (target >= +30%): "
                   + ("**met**" if gain >= 0.3 else "**not met**") + ".")
    return out


def paired_rounds(per_load: dict[str, Any]) -> list[str]:
    """With ``--rounds`` > 1: (c)/(b) throughput and (c)/(d) SLO satisfaction of each round (the same
    jobs, back to back, the order alternating), with each replay's predictor bias: drift of a shared
    machine between two replays (steps 10-15% slower in one of them) is not a difference of systems."""
    out = []
    for ld, per in per_load.items():
        b, c, d = per.get("bucketed", {}), per.get("mixed", {}), per.get("mixed-slo", {})
        if len(b.get("throughput_rounds", [])) >= 2 and "throughput_rounds" in c:
            ratios = [cr / br for cr, br in zip(c["throughput_rounds"], b["throughput_rounds"])]
            out.append(f"- Paired rounds at load {float(ld):.2f}: (c) / (b) = "
                       + ", ".join(f"{x:.3f}" for x in ratios)
                       + f" (order alternating); mean {np.mean(ratios):.3f}, min {min(ratios):.3f}, "
                       f"max {max(ratios):.3f}; "
                       f"(b)'s own spread over its rounds {min(b['throughput_rounds']):.3f}-"
                       f"{max(b['throughput_rounds']):.3f} jobs/s.")
        if len(c.get("slo_rounds", [])) >= 2 and "slo_rounds" in d:
            pairs = []
            for k, (cs, ds) in enumerate(zip(c["slo_rounds"], d["slo_rounds"])):
                bias = "".join(f", bias ({x}) {rs[k] * 100:+.0f}%" for x, rs in
                               (("c", c.get("step_bias_rounds")), ("d", d.get("step_bias_rounds"))) if rs)
                pairs.append(f"{cs * 100:.1f}% / {ds * 100:.1f}%{bias}")
            out.append(f"- SLO satisfaction by round at load {float(ld):.2f}, (c) / (d): " + "; ".join(pairs) + ".")
    return out


def plot(results: dict[str, Any], out: Path) -> str:
    parts = [("real run (this CPU)", results["real"])] if results.get("real") else []
    parts += [(f"simulated, {k}", v) for k, v in (results.get("sim") or {}).items()]
    fig, axes = pyplot().subplots(2, len(parts), figsize=(4.2 * len(parts), 6.5), squeeze=False)
    for col, (title, res) in enumerate(parts):
        loads = sorted(res["loads"], key=float)
        for s in res["loads"][loads[0]]:
            xs = [float(ld) for ld in loads]
            axes[0][col].plot(xs, [res["loads"][ld][s]["throughput"] for ld in loads], marker="o", label=LABELS[s])
            axes[1][col].plot(xs, [res["loads"][ld][s]["slo"] * 100 for ld in loads], marker="o", label=LABELS[s])
        axes[0][col].set_title(title, fontsize=9)
        finish_axes(axes[0][col], "load (x predicted capacity of (c))", "throughput jobs/s")
        finish_axes(axes[1][col], "load (x predicted capacity of (c))", "SLO satisfaction %",
                    legend=6 if col == 0 else None)
    return save_figure(fig, out)


def _bias_by_mixing(loads: dict[str, Any]) -> str:
    """The fit's bias on steps that mixed sizes and on one-size steps, per load and system ("" for
    runs that did not record it, e.g. an earlier run's numbers taken with ``--real-from``)."""
    parts = [f"{ld}: " + ", ".join(f"({LETTERS[s]}) {v['step_bias_mixed'] * 100:+.0f}% / "
                                   f"{v['step_bias_one_size'] * 100:+.0f}%"
                                   for s, v in per.items() if np.isfinite(v.get("step_bias_mixed", np.nan)))
             for ld, per in loads.items()
             if any(np.isfinite(v.get("step_bias_mixed", np.nan)) for v in per.values())]
    return ". The same bias on steps that mixed sizes / steps of one size: " + "; ".join(parts) if parts else ""


def render(results: dict[str, Any], args: argparse.Namespace, command: str, out: str) -> str:
    sizes = ", ".join(f"{w}x{h} ({wt:.0%})" for (w, h), wt in zip(*_sizes(args)))
    lines = ["# Mixed image sizes and SLO-aware scheduling", "",
             f"Command (from the repository root): `{command}`", "",
             f"Trace: {args.jobs if results.get('real') else args.sim_jobs} jobs per load, Poisson arrivals, sizes "
             f"{sizes} (width x height), mask ratios of the `{args.trace}` trace (non-empty masks; shapes from "
             f"`app.maskgen`), {args.steps} steps, guidance {args.guidance}, max batch {args.max_batch}; every job's "
             f"deadline = arrival + {args.slo_factor:g} x its predicted standalone time (the service's default, "
             "`STENCIL_SLO_FACTOR`); SLO satisfaction = share of all jobs done by their deadline; missed in the "
             "queue = share of all jobs that missed and whose first step came too late to make it even alone (lost "
             "to the queue, not to the batch they ran in). Load = arrival rate "
             "over the mixed system's predicted capacity. Cost model: "
             f"`{args.cost_model}` (`stencil profile --sizes`, report in `docs/bench/steptime.md`).", ""]
    if results.get("real"):
        r = results["real"]
        lines += ["## Real run on this machine", "",
                  f"The service's engine in process on the embedded `{args.model}` (one engine = one GPU worker), "
                  f"{'CPU time of the process (1 torch thread)' if args.clock == 'cpu' else 'wall time'} as the clock "
                  "(module docstring), all four systems on the same prepared jobs, one after the other"
                  + (f" ({args.rounds} rounds, the order reversed every other round; means over the rounds)"
                     if args.rounds > 1 else "") + ", after "
                  f"{r.get('warmup_jobs', 0)} warm-up jobs through each (not recorded); "
                  + (f"the real-run numbers are those `{results['real_from']}` held before this command "
                     "(`--real-from`: this command ran the simulations only; BENCHMARKS.md names the real run); "
                     if results.get("real_from") else "") + "predicted "
                  f"capacity of (c) {r['capacity']:.2f} jobs/s. Load average "
                  f"{tuple(results['loadavg_before'])} before, {tuple(results['loadavg_after'])} after; "
                  f"{results['real_seconds']:.0f} s. Predictor bias on each "
                  "system's steps (mean of (predicted - measured) / measured; < 0: slower than predicted): "
                  + "; ".join(f"{ld}: " + ", ".join(f"({LETTERS[s]}) {v['step_bias'] * 100:+.0f}%"
                                                    for s, v in per.items()
                                                    if 'step_bias' in v) for ld, per in r["loads"].items())
                  + _bias_by_mixing(r["loads"])
                  + f". (d)'s step-time predictor is corrected online (`--step-time-calibration` "
                  f"{args.step_time_calibration:g}; the bias above is the uncorrected fit's); its factor at the end "
                  "of each load: " + ", ".join(f"{ld}: {per['mixed-slo']['calibration']:.3f}"
                                              for ld, per in r["loads"].items()
                                              if "calibration" in per.get("mixed-slo", {})) + ".", "",
                  *table(r["loads"], args.systems, with_mape=True), "", *claims(r["loads"], 1.0),
                  *paired_rounds(r["loads"]), ""]
    for name, res in (results.get("sim") or {}).items():
        lines += [f"## Simulation, {name} step cost", "",
                  f"`ops/sim/cluster.py`, {args.sim_workers} workers, {args.sim_router} routing with size affinity "
                  f"(slack "
                  f"{args.size_slack:g} jobs, `--size-slack`), {args.sim_jobs} jobs per "
                  f"run, mean of seeds {args.sim_seeds}, step noise {args.sim_noise}; (d)'s order of a crowded "
                  f"queue: {slo_order_for(args.slo_order, sim_device(name))} "
                  f"(`--slo-order {args.slo_order}`), running jobs give their slot back when "
                  + ("the batch's prediction misses them" if slo_yield_for(args.slo_yield, sim_device(name)) == "batch"
                     else "they miss even alone")
                  + f" (`--slo-yield {args.slo_yield}`), finish margin "
                  f"{slo_margin_for(args.slo_margin, sim_device(name)):g} (`--slo-margin {args.slo_margin}`); "
                  + ("late jobs left out of a worker's load by the router; " if args.route_late == "skip"
                     else "late jobs counted in a worker's load (`--route-late count`); ")
                  + "(d)'s predictor: "
                  + ("the step cost" if args.sim_predictor_scale == 1
                     else f"{args.sim_predictor_scale:g} x the step cost")
                  + ", "
                  f"corrected online (weight {args.step_time_calibration:g}); step cost: {res['text']}; "
                  f"predicted capacity of (c) {res['capacity']:.2f} jobs/s."
                  + (gpu_curve_note(args.gpu_costs) if name == "gpu-shaped" else ""), "",
                  *table(res["loads"], args.systems), "",
                  *claims(res["loads"], 1.3 if name == "gpu-shaped" else 1.0, versus_b=False), ""]
    if results.get("plot"):
        lines += [f"![throughput and SLO satisfaction by load]({results['plot']})", ""]
    return "\n".join(lines)


def _sizes(args: argparse.Namespace) -> tuple[list[tuple[int, int]], list[float]]:
    sizes, weights = parse_sizes(args.sizes)
    total = sum(weights)
    return sizes, [w / total for w in weights]


def _slo_margin(value: str) -> str:
    """``--slo-margin``: auto or a number >= 0 (refused at parsing, before any run)."""
    try:
        parse_slo_margin(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/mixed_sizes.md")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="the real run's virtual clock: the process's CPU time (needs --threads 1) or wall time")
    p.add_argument("--model", default="tiny-sd-inpaint-trained")
    p.add_argument("--cost-model", default="ops/sim/costmodels/tiny-sd-inpaint-trained--cpu-1t-mixed.json",
                   help="a cost model with the resolution-aware batch predictor (stencil profile --sizes)")
    p.add_argument("--sizes", default="128x128:0.4,96x128:0.25,128x96:0.15,128x64:0.2",
                   help="WxH:weight,... (the sizes the cost model was profiled on)")
    p.add_argument("--trace", default="spring")
    p.add_argument("--templates-per-size", type=int, default=1,
                   help="real run: templates per image size (pictures of the demo set, up to 4 different), each "
                        "job's drawn uniformly; a template cache each")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--max-batch", type=int, default=Settings().max_batch)
    p.add_argument("--slo-factor", type=float, default=Settings().slo_factor)
    p.add_argument("--step-time-calibration", type=float, default=STEP_TIME_CALIBRATION,
                   help="(d)'s online predictor correction, EWMA weight per step (0 = off; default: the service's)")
    p.add_argument("--size-affinity-steps", type=int, default=SIZE_AFFINITY_STEPS,
                   help="continuous batching's size affinity (0 = strict FCFS; default: the service's)")
    p.add_argument("--size-switch", default="auto", choices=SIZE_SWITCHES,
                   help="how (c) changes a batch's size under a queue (auto, the service's: drain "
                        "on the CPU parts, mix on the GPU-shaped one)")
    p.add_argument("--slo-order", default="auto", choices=SLO_ORDERS,
                   help="(d)'s order of a crowded queue (auto, the service's: slack on the CPU parts, deadline "
                        "on the GPU-shaped one)")
    p.add_argument("--slo-yield", default="auto", choices=SLO_YIELDS,
                   help="when (d)'s running soft-deadline jobs give their slot back (auto, the service's: alone "
                        "on the CPU parts, batch on the GPU-shaped one)")
    p.add_argument("--slo-margin", default="auto", type=_slo_margin,
                   help="(d)'s stretch of predicted finish times (auto, the service's: 0 on the CPU parts, "
                        "0.01 on the GPU-shaped one)")
    p.add_argument("--sim-router", default="least_requests", choices=POLICIES,
                   help="simulation: the routing policy of every system (app/routing.py)")
    p.add_argument("--size-slack", type=float, default=ROUTING_SIZE_SLACK,
                   help="simulation: size affinity's slack in jobs (app/routing.py; 0 = no size affinity)")
    p.add_argument("--route-late", default="skip", choices=("skip", "count"),
                   help="simulation: whether routers leave jobs the engines published as late out of a worker's "
                        "load, as the service does (skip), or count them as an engine that does not publish them "
                        "(count)")
    p.add_argument("--mixed-size-calls", default="auto", choices=MIXED_SIZE_CALLS,
                   help="real run: how a step makes its per-size UNet calls (auto, the service's: lockstep on "
                        "CUDA, sequential elsewhere)")
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.7, 0.9, 1.1, 1.4])
    p.add_argument("--jobs", type=int, default=320, help="jobs per load (real run)")
    p.add_argument("--rounds", type=int, default=1,
                   help="real run: replay every system this many times per load, the order reversed every other "
                        "round (ABBA), and report the mean (and the paired (c)/(b) ratio of each round)")
    p.add_argument("--warmup-jobs", type=int, default=24,
                   help="jobs replayed through every system before the measured loads, not recorded")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--parts", default="real,sim", help="real, sim or both")
    p.add_argument("--sim-loads", type=float, nargs="+", default=[0.5, 0.7, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4])
    p.add_argument("--sim-jobs", type=int, default=1500)
    p.add_argument("--sim-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sim-workers", type=int, default=4)
    p.add_argument("--sim-noise", type=float, default=0.03)
    p.add_argument("--sim-predictor-scale", type=float, default=1.0,
                   help="(d)'s predictor = this x the simulated step cost (a biased fit; 1 = exact)")
    p.add_argument("--gpu-costs", default="measured", choices=tuple(GPU_COSTS),
                   help="simulation: the GPU-shaped step cost's curve: measured on an H200 with masked work by its "
                        "share of tokens, measured with the measured (host-bound) mask-aware step, or the sourced "
                        "A100 curve")
    p.add_argument("--sim-costs", default="cpu-fitted,gpu-shaped",
                   help="simulation: which step costs to simulate (cpu-fitted, gpu-shaped or both)")
    p.add_argument("--json", default="", help="also write every number (JSON)")
    p.add_argument("--real-from", default="",
                   help="take the real run from an earlier run's --json instead of running it (e.g. to re-run only "
                        "the simulations after a change that leaves the CPU path alone); the report says so")
    run = cli.start(p, argv, __file__, quick=dict(
        sizes="128x128:0.5,128x64:0.5", steps=2, loads=[1.2], jobs=10, warmup_jobs=2, sim_loads=[1.2], sim_jobs=60,
        sim_seeds=[0],
        sim_workers=2))
    args = run.args
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu measures the process's CPU time: use --threads 1")
    if args.templates_per_size < 1:
        p.error("--templates-per-size must be at least 1")
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}")
    sizes, weights = _sizes(args)
    cost = CostModel.load(args.cost_model)
    if cost.batch is None:
        p.error(f"{args.cost_model} has no batch step-time predictor: fit one with `stencil profile --sizes`")
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {"loadavg_before": loadavg()}
    parts = set(args.parts.split(","))
    if args.real_from:
        if "real" in parts:
            p.error("--real-from replaces the real run: use --parts sim")
        earlier = json.loads(Path(args.real_from).read_text())
        if "real" not in earlier:
            p.error(f"{args.real_from} holds no real run")
        results.update({k: earlier[k] for k in ("real", "real_seconds", "loadavg_before", "loadavg_after")},
                       real_from=args.real_from)
    t0 = time.monotonic()
    if "real" in parts:
        with torch.no_grad():
            results["real"] = run_real(args, sizes, weights, cost)
        results["real_seconds"] = time.monotonic() - t0
    if "sim" in parts:
        results["sim"] = run_sim(args, sizes, weights, cost)
    if not args.real_from:
        results["loadavg_after"] = loadavg()
    if args.out:
        results["plot"] = plot(results, Path(args.out).with_name(Path(args.out).stem + ".png"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, separators=(",", ":"), default=float))  # compact
    run.write(render(results, args, run.command, args.out))
    log.info("done in %.0f s", run.elapsed())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
