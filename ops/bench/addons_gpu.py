"""LoRA adapters and ControlNets on one GPU: Stencil against diffusers' own add-on paths on the same card.

One bounded command (the defaults fit ``--budget-s`` 150 s on an H100 or H200: model save, loads,
adapter and ControlNet creation and warm-ups included; each part gets a share of the time left and
cuts rounds or jobs that would not fit, saying so in the report) runs on ``--device`` in ``--dtype``
with a true-size SD 1.5 inpainting model with random weights (written by ``stencil model save``) at
512 px, side by side in one process:

- ``latency``: the latency 1 and 2 adapters (rank ``--rank`` on every attention projection of the
  UNet) add to one job over the same job without adapters, every request with adapters no earlier
  request used (the long tail: nothing warm). Stock: ``ops.bench.lora``'s per-request path
  (``load_lora_weights`` per adapter, ``set_adapters``, ``fuse_lora``, the pipeline call,
  ``unfuse_lora``, ``unload_lora_weights``). Stencil: the service's job path in process
  (``ops/bench/harness/service.py`` on the device: routed, so the adapters are fetched from the
  object store; prepared; denoised by the engine on its thread, adapters as per-row terms in half
  precision; decoded). Configurations interleaved per round; medians of the differences to the same
  round's job without adapters. Target: Stencil's added latency at most 10% of stock's.
- ``trace``: a long-tail trace (``--pool`` adapters with Zipf(``--zipf``) popularity, 1 or 2 per
  job, scales in [0.5, 1]): jobs/s of the stock path one request at a time against Stencil with the
  whole trace submitted at once (continuous batching, max batch ``--max-batch``), on the same jobs.
  Target: at least 1.5x.
- ``controlnet``: one true-size ControlNet (``ControlNetModel.from_unet`` of the model, random zero
  convolutions): one job's latency with 0 and 1 ControlNet, and ``--cn-jobs`` jobs with it at once.
  Stock: ``StableDiffusionControlNetInpaintPipeline`` (the plain inpainting pipeline for none), its
  ControlNet loaded, one request at a time and in batches of ``--max-batch``; Stencil: the
  ControlNet resident in its bank (computed beside the UNet's down path), the batch submitted at once.

Timings are wall time of CUDA-synchronised regions (every call ends in a host image). Reported:
``--out`` Markdown, ``--json`` the numbers, with the GPU, driver, CUDA, torch, diffusers, peft and
transformers versions. ``--quick``: the tiny embedded model at 64 px on whatever device, a few jobs
(the test suite's smoke run on the CPU).

    python -m ops.bench.addons_gpu --out gpu-out/addons_gpu.md --json gpu-out/addons_gpu.json
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.jobs import JobParams
from app.settings import Settings
from app.storage import LocalStore
from ops.bench.harness.addons_gpu_report import render
from ops.bench.harness.cli import parser, start
from ops.bench.harness.controlnet_paths import Stock as ControlNetStock
from ops.bench.harness.controlnet_paths import add_controlnets
from ops.bench.harness.controlnet_paths import job_inputs as controlnet_inputs
from ops.bench.harness.gpu import DTYPES, device_of, hardware, sync
from ops.bench.harness.lora_paths import Adapters, trace_jobs
from ops.bench.harness.lora_paths import Stock as LoraStock
from ops.bench.harness.lora_paths import job_inputs as lora_inputs
from ops.bench.harness.report import Stopped, stop_on_sigterm, write_run
from ops.bench.harness.saved_models import MODELS, save_model
from ops.bench.harness.service import InProcess
from ops.bench.harness.timing import median

log = logging.getLogger(__name__)

PARTS = ("latency", "trace", "controlnet")
SHARE = {"latency": 1.0, "trace": 1.4, "controlnet": 1.0}  # of the time left after set-up
CONTROLNET = "edges"


@dataclass
class Bench:
    """What the parts share: options, the device, the model, Stencil in process, the store."""

    args: argparse.Namespace
    device: torch.device
    model_dir: Path
    work: Path
    store: LocalStore
    svc: InProcess
    side: int
    adapters: Adapters
    notes: list[str] = field(default_factory=list)
    _lora_stock: LoraStock | None = None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.args.dtype]

    @property
    def lora_stock(self) -> LoraStock:
        if self._lora_stock is None:
            self._lora_stock = LoraStock(self.model_dir, self.adapters, str(self.device), self.dtype)
        return self._lora_stock

    def params(self, loras: tuple[tuple[str, float], ...], seed: int) -> JobParams:
        return JobParams(prompt="a hat", steps=self.args.steps, guidance=7.5, seed=seed, loras=loras)


def _version(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def versions() -> str:
    """PEFT's and transformers' versions: diffusers' LoRA loading runs on them."""
    return f"peft {_version('peft')}, transformers {_version('transformers')}"


def lora_backend() -> str | None:
    """Why diffusers' LoRA loading cannot run here (it needs PEFT and transformers at least at its
    minimum versions), or None."""
    import diffusers
    from diffusers.utils import constants

    if constants.USE_PEFT_BACKEND:
        return None
    return (f"diffusers {diffusers.__version__}'s LoRA loading needs peft >= {constants.MIN_PEFT_VERSION} "
            f"and transformers >= {constants.MIN_TRANSFORMERS_VERSION}; found {versions()}")


def graph_counts(svc: InProcess) -> dict[str, int] | None:
    """Stencil's steps replayed as CUDA graphs so far (None: its runner has no graphs)."""
    graphs = svc.runner.graphs
    if graphs is None:
        return None
    return {"captures": graphs.captures, "replays": graphs.replays, "eager": graphs.eager}


def rounds_until(deadline: float, rounds: int, configs: Sequence[Any], measure: Callable[[Any, int], float],
                 rng: random.Random, label: str) -> tuple[dict[Any, list[float]], int]:
    """``timing.interleave`` with a deadline: every config once per round (``measure(config, round)``)
    in a new shuffled order, no new round after ``deadline`` (one round at least). Samples per
    config, rounds run."""
    samples: dict[Any, list[float]] = {c: [] for c in configs}
    done = 0
    for rnd in range(rounds):
        if done and time.monotonic() > deadline:
            break
        order = list(configs)
        rng.shuffle(order)
        for c in order:
            samples[c].append(measure(c, rnd))
        done += 1
        log.info("%s round %d/%d", label, done, rounds)
    return samples, done


def latency_ids(rnd: int) -> dict[int, tuple[str, ...]]:
    """Round ``rnd``'s adapters: one for the 1-adapter job, two others for the 2-adapter job; both
    systems get the same ones, each system sees each once (fresh to both)."""
    first = 3 * rnd + 1
    return {0: (), 1: (f"lat-{first}",), 2: (f"lat-{first + 1}", f"lat-{first + 2}")}


WARM_ID = "warm-1"


def adapter_ids(args: argparse.Namespace, parts: Sequence[str]) -> list[str]:
    """Every adapter the LoRA parts will use, in order of first use (made before the clock starts)."""
    ids = [WARM_ID]
    if "latency" in parts:
        ids += [i for rnd in range(args.latency_rounds) for n in (1, 2) for i in latency_ids(rnd)[n]]
    if "trace" in parts:
        ids += [i for s in trace_jobs(args.jobs, args.pool, args.zipf, args.seed) for i, _ in s]
    return list(dict.fromkeys(ids))


def part_latency(b: Bench, deadline: float) -> dict[str, Any]:
    args, svc, stock = b.args, b.svc, b.lora_stock
    image, mask = lora_inputs(b.side, 0)
    warm = b.params(((WARM_ID, 0.8),), 0)
    for p in (warm, b.params((), 0)):  # warm-up both (lazy inits, kernels; without adapters, graph captures)
        svc.job(image, mask, p)
        stock.job(image, mask, p)
    stock.lora_seconds.clear()
    configs = [(system, n) for system in ("stock", "stencil") for n in (0, 1, 2)]
    replayed: dict[int, list[float]] = {0: [], 1: [], 2: []}  # Stencil's steps replayed as CUDA graphs

    def measure(config: tuple[str, int], rnd: int) -> float:
        system, n = config
        p = b.params(tuple((i, 0.8) for i in latency_ids(rnd)[n]), rnd + 1)
        if system == "stock":
            return stock.job(image, mask, p)
        seconds = svc.job(image, mask, p)[1]
        replayed[n].append(svc.last_result.get("graph_replayed_steps", 0) / max(p.steps, 1))
        return seconds

    lora, weights = svc.lora, svc.lora.weights
    before = (lora.stats.term_seconds, weights.sync_seconds, weights.staged_seconds)
    samples, rounds = rounds_until(deadline, args.latency_rounds, configs, measure, random.Random(args.seed),
                                   "latency")
    if rounds < args.latency_rounds:
        b.notes.append(f"latency: {rounds} of {args.latency_rounds} rounds (time budget)")
    # Where Stencil's adapter work went, per job with adapters (host clock: a term's kernels are queued,
    # not waited for): terms added in the steps, merges on the critical path and in the background.
    jobs = 2 * rounds
    term_s, sync_s, staged_s = (now - then for now, then in
                                zip((lora.stats.term_seconds, weights.sync_seconds, weights.staged_seconds), before))
    out: dict[str, Any] = {"rounds": rounds, "stock_lora_s": median(stock.lora_seconds),
                           "stencil_lora": {"term_host_s_per_job": term_s / jobs, "merge_sync_s_per_job": sync_s / jobs,
                                            "merge_staged_s_per_job": staged_s / jobs,
                                            "merges_allowed": bool(lora.merge_allowed)},
                           "adapter_mib": b.adapters.get("lat-1").joinpath("pytorch_lora_weights.safetensors")
                           .stat().st_size / 2**20, "rows": {}}
    for n in (1, 2):
        # Paired per round (the same round's job without adapters): drifting load cancels out.
        added_stock = median(a - z for a, z in zip(samples[("stock", n)], samples[("stock", 0)]))
        added_ours = median(a - z for a, z in zip(samples[("stencil", n)], samples[("stencil", 0)]))
        out["rows"][n] = {"stock_s": median(samples[("stock", n)]), "stencil_s": median(samples[("stencil", n)]),
                          "stock_added_s": added_stock, "stencil_added_s": added_ours,
                          "added_ratio": added_ours / added_stock if added_stock > 0 else float("nan")}
    out["none"] = {"stock_s": median(samples[("stock", 0)]), "stencil_s": median(samples[("stencil", 0)])}
    out["graph_replayed_share"] = {n: sum(v) / len(v) if v else 0.0 for n, v in replayed.items()}
    out["samples"] = {f"{s}-{n}": v for (s, n), v in samples.items()}
    return out


def part_trace(b: Bench, deadline: float) -> dict[str, Any]:
    """Stock one request at a time until its share of the part's time, then Stencil on the same jobs."""
    args, svc, stock = b.args, b.svc, b.lora_stock
    sets = trace_jobs(args.jobs, args.pool, args.zipf, args.seed)
    jobs = [(*lora_inputs(b.side, k), b.params(s, k)) for k, s in enumerate(sets)]
    if not stock.lora_seconds:  # warm both (the latency part did not run)
        warm = b.params(((WARM_ID, 0.8),), 0)
        stock.job(jobs[0][0], jobs[0][1], warm)
        svc.job(jobs[0][0], jobs[0][1], warm)
    # Stock goes first and may take the part's time but for Stencil's share at the target speed-up
    # (stock's time / 1.5 = 0.4 of the part); Stencil then runs the jobs stock finished.
    stock_until = time.monotonic() + (deadline - time.monotonic()) * 0.6
    done, t0 = 0, time.perf_counter()
    for image, mask, p in jobs:
        stock.job(image, mask, p)
        done += 1
        if time.monotonic() > stock_until:
            break
    stock_s = time.perf_counter() - t0
    if done < len(jobs):
        b.notes.append(f"trace: {done} of {len(jobs)} jobs (time budget)")
    run = jobs[:done]
    t0 = time.perf_counter()
    for _image, _mask, p in run:
        svc.route(p)
    handles = [svc.submit(*svc.prepare(image, mask, p)) for image, mask, p in run]
    results = [h.future.result() for h in handles]
    for r in results:
        svc.decode(r["latents"])
    sync(b.device)
    ours_s = time.perf_counter() - t0
    distinct = len({i for s in sets[:done] for i, _ in s})
    # What Stencil's engine did with the adapters: jobs that applied theirs, steps as terms / merged.
    engine = {"jobs_applied": sum(r["lora_applied_step"] is not None for r in results),
              "term_steps": sum(r["lora_term_steps"] for r in results),
              "merged_steps": sum(r["lora_merged_steps"] for r in results)}
    return {"jobs": done, "distinct_adapters": distinct, "stock_s": stock_s, "stencil_s": ours_s,
            "stock_jobs_per_s": done / stock_s, "stencil_jobs_per_s": done / ours_s, "speedup": stock_s / ours_s,
            "stencil_engine": engine}


def part_controlnet(b: Bench, deadline: float) -> dict[str, Any]:
    args, svc = b.args, b.svc
    t0 = time.monotonic()
    folders = add_controlnets(b.model_dir, b.store, b.work, (CONTROLNET,), str(b.device), b.dtype)
    stock = ControlNetStock(b.model_dir, folders, str(b.device), b.dtype)
    svc.controlnets.prefetch([CONTROLNET])
    while not svc.controlnets.ready([CONTROLNET]):
        time.sleep(0.01)
    setup_s = time.monotonic() - t0
    inputs = [controlnet_inputs(b.side, k) for k in range(args.cn_jobs)]

    def params(n: int, seed: int) -> JobParams:
        return JobParams(prompt="a hat", steps=args.steps, guidance=7.5, seed=seed,
                         controls=((CONTROLNET, 0.8, 0.0, 1.0),) * n)

    def latency(config: tuple[str, int], _round: int = 0) -> float:
        system, n = config
        image, mask, control = inputs[0]
        if system == "stock":
            return stock.job(image, mask, control, n, args.steps, 0)
        return svc.job(image, mask, params(n, 0), [control] * n)[1]

    for config in (("stock", 1), ("stencil", 1)):  # warm-up
        latency(config)
    configs = [(s, n) for s in ("stock", "stencil") for n in (0, 1)]
    # A latency round costs about half a batch round: a third of the time for the latency rounds.
    lat, rounds = rounds_until(time.monotonic() + (deadline - time.monotonic()) / 3, args.cn_rounds, configs,
                               latency, random.Random(args.seed), "controlnet latency")
    if rounds < args.cn_rounds:
        b.notes.append(f"controlnet: {rounds} of {args.cn_rounds} latency rounds (time budget)")

    def stock_one_at_a_time() -> float:
        t = time.perf_counter()
        for k, (image, mask, control) in enumerate(inputs):
            stock.job(image, mask, control, 1, args.steps, k)
        return time.perf_counter() - t

    def stock_batched() -> float:
        t = time.perf_counter()
        for lo in range(0, len(inputs), args.max_batch):
            stock.batch(inputs[lo:lo + args.max_batch], args.steps, lo)
        return time.perf_counter() - t

    def stencil() -> float:
        t = time.perf_counter()
        handles = []
        for k, (image, mask, control) in enumerate(inputs):
            p = params(1, k)
            svc.route(p)
            handles.append(svc.submit(*svc.prepare(image, mask, p, [control])))
        for h in handles:
            svc.decode(h.future.result()["latents"])
        sync(b.device)
        return time.perf_counter() - t

    runs = {"stock one at a time": stock_one_at_a_time, "stock batched": stock_batched, "stencil": stencil}
    samples, batch_rounds = rounds_until(deadline, args.cn_rounds, list(runs), lambda name, _rnd: runs[name](),
                                         random.Random(args.seed + 1), "controlnet batch")
    if batch_rounds < args.cn_rounds:
        b.notes.append(f"controlnet: {batch_rounds} of {args.cn_rounds} batch rounds (time budget)")
    batch = {name: median(v) for name, v in samples.items()}
    n = len(inputs)
    best_stock = min(batch["stock one at a time"], batch["stock batched"])
    concurrent = svc.runner.concurrent
    return {"setup_s": setup_s, "rounds": rounds, "batch_rounds": batch_rounds, "jobs": n,
            "stencil_controlnet_s": concurrent.busy_seconds if concurrent is not None else float("nan"),
            "stencil_controlnet_waited_s": concurrent.waited_seconds if concurrent is not None else float("nan"),
            "latency": {f"{s}-{k}": median(lat[(s, k)]) for s, k in configs},
            "batch_s": batch, "jobs_per_s": {k: n / v for k, v in batch.items()},
            "speedup_vs_best_stock": best_stock / batch["stencil"]}


RUNS: dict[str, Callable[[Bench, float], dict[str, Any]]] = {
    "latency": part_latency, "trace": part_trace, "controlnet": part_controlnet}


def set_up(args: argparse.Namespace, parts: Sequence[str], device: torch.device, work: Path, side: int,
           report: dict[str, Any]) -> Bench:
    """The model saved, Stencil and the stock LoRA pipeline loaded on ``device``, and every adapter the
    LoRA parts will use made and stored meanwhile (in processes forked before CUDA is touched)."""
    t0 = time.monotonic()
    model_dir = save_model(args, work)
    report["setup"] = setup = {"model_save_s": time.monotonic() - t0}
    store = LocalStore(work / "store")
    adapters = Adapters(model_dir, work / "loras", store, args.rank, dtype=DTYPES[args.dtype], derive=True)
    missing = lora_backend()
    if missing:
        report["notes"].append(f"LoRA parts not run: {missing}")
    lora_parts = not missing and bool({"latency", "trace"} & set(parts))
    t1 = time.monotonic()
    ids = adapter_ids(args, parts) if lora_parts else []
    adapters_ready = adapters.prefill(ids, args.processes)
    setup["first_adapter_s"] = time.monotonic() - t1
    report["hardware"] = f"{hardware(device)}, {versions()}"  # CUDA from here on
    settings = Settings()
    svc = InProcess(model_dir, store, max_batch=args.max_batch, lora_cache_bytes=settings.lora_cache_bytes,
                    controlnet_cache_bytes=settings.controlnet_cache_bytes, dtype=DTYPES[args.dtype],
                    device=str(device))
    bench = Bench(args, device, model_dir, work, store, svc, side, adapters, report["notes"])
    try:
        if lora_parts:
            bench.lora_stock  # noqa: B018 (loaded while the adapters are made)
        setup["loads_s"] = time.monotonic() - t1
        adapters_ready()
    except BaseException:
        svc.close()
        raise
    setup.update(adapters=len(ids), adapters_s=time.monotonic() - t1)
    report["setup_s"] = time.monotonic() - t0
    return bench


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The Markdown report and the JSON (after every part: a run cut short keeps what it measured)."""
    write_run(args.out, args.json, render(report), report)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, out="docs/bench/addons_gpu.md", threads=0)
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--size", type=int, default=0, help="image side in px (0 = the model's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=Settings().max_batch)
    p.add_argument("--latency-rounds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=24, help="jobs of the long-tail trace")
    p.add_argument("--pool", type=int, default=1000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--cn-jobs", type=int, default=8, help="jobs of the ControlNet batch")
    p.add_argument("--cn-rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0, help="wall-time budget of the whole run (s)")
    p.add_argument("--processes", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes that make the adapters (each one is converted as `stencil lora add` does)")
    p.add_argument("--workdir", default="", help="model, adapters and store (default: a new temporary folder)")
    p.add_argument("--json", default="docs/bench/addons_gpu.json")
    run = start(p, argv, __file__, quick=dict(dtype="float32", steps=2, rank=4, max_batch=2, latency_rounds=1,
                                              jobs=3, pool=20, cn_jobs=2, cn_rounds=1, budget_s=120.0, json=""))
    args = run.args
    args.model = "sd15"  # e2e_gpu.save_model's key: SD 1.5 inpainting (the ControlNet inpainting pipeline's family)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if unknown := [x for x in parts if x not in PARTS]:
        p.error(f"--parts: unknown {unknown} (known: {', '.join(PARTS)})")
    # No CUDA before the adapter processes fork (``Adapters.prefill``): "auto" asks NVML, not the driver.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    device = device_of(args)
    until = run.t0 + args.budget_s
    work = Path(args.workdir or tempfile.mkdtemp(prefix="stencil-addons-gpu-"))
    side = args.size or (64 if args.quick else MODELS[args.model][2])
    report: dict[str, Any] = {"command": run.command, "hardware": f"{device.type}, {versions()}",
                              "args": vars(args), "side": side, "bank_mib": Settings().lora_cache_bytes >> 20,
                              "model": MODELS[args.model][1 if args.quick else 0], "parts": {}, "notes": []}
    stop_on_sigterm()  # a stage limit: keep what ran
    svc = None
    failed: list[str] = []
    try:
        bench = set_up(args, parts, device, work, side, report)
        svc = bench.svc
        parts = [x for x in parts if x == "controlnet" or not lora_backend()]
        for k, name in enumerate(parts):
            left = until - time.monotonic()
            if left < 5:
                report["notes"].append(f"{name} not run: time budget spent")
                continue
            share = SHARE[name] / sum(SHARE[x] for x in parts[k:])
            t0 = time.monotonic()
            try:
                report["parts"][name] = RUNS[name](bench, time.monotonic() + left * share)
            except Exception as exc:  # one GPU call, several parts: a failure keeps the others' results
                log.exception("%s failed", name)
                report["notes"].append(f"{name} failed: {type(exc).__name__}: {exc}")
                failed.append(name)
                continue
            report["parts"][name]["wall_s"] = time.monotonic() - t0
            report["parts"][name]["stencil_graphs"] = graph_counts(svc)
            log.info("%s done in %.0f s", name, time.monotonic() - t0)
            report["elapsed_s"] = run.elapsed()
            write(report, args)
    except Stopped as exc:
        report["notes"].append(f"stopped by {exc} after {run.elapsed():.0f} s")
        return 143
    finally:
        if svc is not None:
            svc.close()
        report["elapsed_s"] = run.elapsed()
        write(report, args)
    log.info("done in %.0f s", run.elapsed())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
