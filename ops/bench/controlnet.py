"""ControlNets per job: Stencil vs the stock pipeline, side by side in one run.

Parts (``--parts``):

- ``jobs``: latency of one job and throughput of ``--jobs`` jobs with 0, 1 and 2 ControlNets.
  Stock: ``StableDiffusionControlNetInpaintPipeline`` (``MultiControlNetModel`` for two; the plain
  inpainting pipeline for none), one request at a time, its ControlNets kept loaded. Stencil: the
  service's job path in process (``ops/bench/harness/service.py``): ControlNets resident in the
  engine's LRU, continuous batching, ControlNets computed on a second thread while the UNet runs its
  down path. Both get the machine's two cores: the stock pipeline as two intra-op threads, Stencil
  as the service runs by default (torch's default intra-op threads, ``--stencil-threads``) with its
  ControlNets on a second thread.
- ``overlap``: one step of a batch with 1 and 2 ControlNets, the ControlNets computed before the
  UNet vs concurrently with its down path; and the stage costs (UNet down path, ControlNets, rest
  of the UNet) from which the multi-GPU placement is planned.
- ``lru``: hit rate of the resident ControlNet LRU on a skewed trace of ControlNet ids (the
  product's ``ControlNetBank``, ``--controlnets`` ids with Zipf popularity, capacities of 1-16
  resident), and the measured load time of one ControlNet from the object store.

    python -m ops.bench.controlnet --parts jobs,overlap,lru --out docs/bench/controlnet.md
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.jobs import JobParams
from app.storage import LocalStore
from ops.bench.harness import cli
from ops.bench.harness.controlnet_paths import NETS, Stock, add_controlnets, job_inputs
from ops.bench.harness.models import saved_sd_pipeline
from ops.bench.harness.service import InProcess
from ops.bench.harness.timing import interleave, median
from workers.controlnets.bank import ControlNetBank, store_loader

log = logging.getLogger(__name__)


def _params(n: int, steps: int, seed: int) -> JobParams:
    return JobParams(prompt="a hat", steps=steps, guidance=7.5, seed=seed,
                     controls=tuple((x, 0.8, 0.0, 1.0) for x in NETS[:n]))


def part_jobs(args: Any, model_dir: Path, work: Path) -> list[str]:
    store = LocalStore(work / "store")
    folders = add_controlnets(model_dir, store, work)
    stock, svc = Stock(model_dir, folders), InProcess(model_dir, store, controlnet_parallel=True)
    for n in (1, 2):  # make them resident (the LRU's steady state for a popular ControlNet)
        svc.controlnets.prefetch(NETS[:n])
    inputs = [job_inputs(args.size, k) for k in range(args.jobs)]

    def latency(config: tuple[str, int]) -> float:
        system, n = config
        image, mask, control = inputs[0]
        if system == "stock":
            torch.set_num_threads(2)
            return stock.job(image, mask, control, n, args.steps, 0)
        torch.set_num_threads(args.stencil_threads)
        return svc.job(image, mask, _params(n, args.steps, 0), [control] * n)[1]

    def throughput(config: tuple[str, int]) -> float:
        system, n = config
        t0 = time.perf_counter()
        if system == "stock":
            torch.set_num_threads(2)
            for k, (image, mask, control) in enumerate(inputs):
                stock.job(image, mask, control, n, args.steps, k)
        else:
            torch.set_num_threads(args.stencil_threads)
            handles = []
            for k, (image, mask, control) in enumerate(inputs):
                p = _params(n, args.steps, k)
                svc.route(p)
                handles.append(svc.submit(*svc.prepare(image, mask, p, [control] * n)))
            for h in handles:
                svc.decode(h.future.result()["latents"])
        return args.jobs / (time.perf_counter() - t0)

    configs = [(s, n) for s in ("stock", "stencil") for n in (0, 1, 2)]
    latency(("stencil", 2))
    latency(("stock", 2))  # warm-up
    lat = interleave(args.rounds, configs, latency, rng=random.Random(args.seed), label="latency ")
    thr = interleave(1, configs, throughput, rng=random.Random(args.seed), label="throughput ")
    svc.close()
    rows = ["| ControlNets | stock latency | Stencil latency | latency ratio | stock jobs/s | Stencil jobs/s | "
            "throughput ratio |", "|---|---|---|---|---|---|---|"]
    for n in (0, 1, 2):
        sl, ol = median(lat[("stock", n)]), median(lat[("stencil", n)])
        st, ot = thr[("stock", n)][0], thr[("stencil", n)][0]
        rows.append(f"| {n} | {sl:.2f} s | {ol:.2f} s | {ol / sl:.2f}x | {st:.3f} | {ot:.3f} | {ot / st:.2f}x |")
    return ["## Jobs with 0, 1 and 2 ControlNets\n",
            f"UNet {args.hidden}, {args.size} px, {args.steps} steps, guidance 7.5, conditioning scale 0.8, canny "
            f"control images; latency: one job alone, median of {args.rounds} interleaved rounds; throughput: "
            f"{args.jobs} jobs submitted together (Stencil: max batch 4, continuous batching). Wall time; two cores "
            f"for each system: the stock pipeline with 2 intra-op threads, Stencil with {args.stencil_threads} "
            "(its ControlNets on a second thread).\n", *rows, ""]


def part_overlap(args: Any, model_dir: Path, work: Path) -> list[str]:
    from workers.controlnets.step import Use, residuals

    store = LocalStore(work / "store-overlap")
    add_controlnets(model_dir, store, work)
    torch.set_num_threads(1)
    loader = store_loader(store.get, "cpu", torch.float32)
    nets = {n: loader(n) for n in NETS}
    svc = {mode: InProcess(model_dir, store, controlnet_parallel=mode == "thread") for mode in ("before", "thread")}
    for s in svc.values():
        s.engine.stop()
    size = args.step_size
    latent = size // 8
    jobs = [job_inputs(size, k) for k in range(4)]

    def batch_inputs(n: int) -> tuple[Any, ...]:
        prepared = [svc["before"].prepare(img, m, _params(n, 50, k), [c] * n) for k, (img, m, c) in enumerate(jobs)]
        return tuple(prepared)

    from workers.engine.engine import Engine
    from workers.engine.scheduler import BatchScheduler

    def step_seconds(config: tuple[str, int]) -> float:
        mode, n = config
        s = svc[mode]
        for name in NETS:
            s.controlnets.prefetch([name])
        while not s.controlnets.ready(NETS):
            time.sleep(0.01)
        engine = Engine(s.runner, BatchScheduler(max_batch=4))
        for k, (tensors, meta) in enumerate(batch_inputs(n)):
            engine.submit(f"o{k}", tensors, meta, total_steps=50)
        engine._drain_inbox(block=False)
        engine.step_once()
        times = []
        for _ in range(args.step_repeats):
            t0 = time.perf_counter()
            engine.step_once()
            times.append(time.perf_counter() - t0)
        for job in engine.scheduler.jobs():
            engine.scheduler.remove(job.job_id)
        return statistics.median(times)

    configs = [(mode, n) for mode in ("before", "thread") for n in (1, 2)]
    samples = interleave(args.rounds, configs, step_seconds, rng=random.Random(args.seed), label="overlap ")
    # Stage costs of the same batch (one thread): UNet down path, each ControlNet, the whole UNet.
    s = svc["before"]
    tensors = [t for t, _ in batch_inputs(1)]
    sample = torch.cat([torch.cat([t["latents"]] * 2) for t in tensors])
    cond = torch.cat([torch.cat([t["mask"], t["masked_image_latents"]], dim=1) for t in tensors])
    times = torch.full((sample.shape[0],), 500)
    text = torch.cat([t["prompt_embeds"] for t in tensors])
    unet = s.runner.unet
    down_end: list[float] = []
    hook = unet.down_blocks[-1].register_forward_hook(lambda *a: down_end.append(time.perf_counter()))
    with torch.no_grad():
        t0 = time.perf_counter()
        unet(torch.cat([sample, cond], dim=1), times, encoder_hidden_states=text)
        t_unet, t_down = time.perf_counter() - t0, down_end[-1] - t0
        hook.remove()
        use = [Use(0, NETS[0], 2 * k, 2, tensors[k]["control0"], 0.8) for k in range(4)]
        t0 = time.perf_counter()
        down, mid = residuals(nets.__getitem__, sample, times, text, use)
        t_cn = time.perf_counter() - t0
    residual_mib = (sum(d.numel() for d in down) + mid.numel()) * 4 / 2**20
    for x in svc.values():
        x.close()
    rows = ["| ControlNets | ControlNets before the UNet | concurrent with the down path | concurrent / before |",
            "|---|---|---|---|"]
    for n in (1, 2):
        before, thread = median(samples[("before", n)]), median(samples[("thread", n)])
        rows.append(f"| {n} | {before:.3f} s | {thread:.3f} s | {thread / before:.2f}x |")
    plan = [f"Stage costs of this batch (one thread): whole UNet {t_unet:.3f} s, of which the down path "
            f"{t_down:.3f} s; one ControlNet on all 8 rows {t_cn:.3f} s; residuals {residual_mib:.1f} MiB "
            f"(float32) per step.",
            "",
            "Multi-GPU placement from these costs: with ControlNets on other devices (SwiftDiffusion's "
            "ControlNet-as-a-service), a step costs max(down path, slowest ControlNet + residual transfer) + "
            "rest of the UNet instead of sum(ControlNets) + UNet. With k ControlNets on k devices:",
            "", "| ControlNets | sequential (one device) | overlapped, ControlNets on other devices | saving |",
            "|---|---|---|---|"]
    rest = t_unet - t_down
    # Residual transfer at 25 GB/s (PCIe 4.0 x16, one direction, NVIDIA's figure); NVLink is faster.
    transfer = residual_mib * 2**20 / 25e9
    for n in (1, 2):
        seq = n * t_cn + t_unet
        par = max(t_down, t_cn + transfer) + rest
        plan.append(f"| {n} | {seq:.3f} s | {par:.3f} s | {seq / par:.2f}x |")
    return ["## ControlNets overlapped with the UNet's down path\n",
            f"One step of 4 CFG jobs at {size} px (latent {latent}), UNet {args.hidden}, each job with the same "
            f"ControlNet(s); wall time, median of {args.step_repeats} steps per round, {args.rounds} interleaved "
            "rounds; one torch thread per thread: 'before' runs the ControlNets then the UNet on one core, "
            "'concurrent' the ControlNets on a second thread (core) while the UNet runs its down path.\n",
            *rows, "", *plan, ""]


def part_lru(args: Any, model_dir: Path, work: Path) -> list[str]:
    store = LocalStore(work / "store-lru")
    add_controlnets(model_dir, store, work)
    loader = store_loader(store.get, "cpu", torch.float32)
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        net = loader(NETS[0])
        loads.append(time.perf_counter() - t0)
    params_m = sum(p.numel() for p in net.parameters()) / 1e6
    rng = np.random.default_rng(args.seed)
    weights = 1.0 / np.arange(1, args.controlnets + 1) ** args.zipf
    weights /= weights.sum()
    trace = rng.choice(args.controlnets, size=args.requests, p=weights)
    rows = ["| resident ControlNets (LRU) | hit rate | loads |", "|---|---|---|"]
    one = torch.nn.Linear(4, 4)  # the LRU's bookkeeping only: every ControlNet weighs as much as this
    for cap in (1, 2, 4, 8, 16):
        bank = ControlNetBank(lambda i: torch.nn.Linear(4, 4), budget_bytes=cap * sum(
            p.numel() * p.element_size() for p in one.parameters()))
        for cid in trace:
            name = f"cn-{cid}"
            bank.prefetch([name])
            while not bank.ready([name]):
                time.sleep(0)
        rows.append(f"| {cap} | {bank.stats.hits / args.requests:.3f} | {bank.stats.loads} |")
        bank.close()
    return ["## Resident ControlNets on a skewed trace\n",
            f"{args.requests} requests over {args.controlnets} ControlNets with Zipf({args.zipf}) popularity "
            "(SwiftDiffusion's production traces: ~94 ControlNets, skewed); the product's `ControlNetBank` "
            f"with room for 1-16. Loading one of this benchmark's ControlNets ({params_m:.0f} M parameters) from "
            f"the object store took {median(loads):.2f} s (median of 3); a hit costs nothing.\n", *rows, ""]


PARTS = {"jobs": part_jobs, "overlap": part_overlap, "lru": part_lru}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/controlnet.md", threads=None)
    p.add_argument("--parts", default="jobs,overlap,lru")
    p.add_argument("--hidden", default="320,640")
    p.add_argument("--stencil-threads", type=int, default=2,
                   help="intra-op threads of Stencil's engine in the jobs part (2 = the service's default on this "
                        "machine: STENCIL_TORCH_THREADS=0, torch's default; 1 = one core per compute thread)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-size", type=int, default=256)
    p.add_argument("--step-repeats", type=int, default=3)
    p.add_argument("--controlnets", type=int, default=94)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--zipf", type=float, default=1.1)
    run = cli.start(p, argv, __file__, quick=dict(hidden="32,64", size=64, steps=2, jobs=2, rounds=1, step_size=64,
                                                   step_repeats=1, requests=100))
    args = run.args
    args.hidden = tuple(int(c) for c in args.hidden.split(","))
    work = Path(tempfile.mkdtemp(prefix="stencil-controlnet-bench-"))
    cli.report_parts(run, "ControlNets: Stencil vs the stock pipeline", PARTS, saved_sd_pipeline(work, args.hidden),
                     work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
