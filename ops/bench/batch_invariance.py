"""Batch invariance in half precision (``STENCIL_BATCH_INVARIANT``): what batched GEMMs change in a
job's picture, and what multiplying each job's rows on their own costs, side by side in one run.

- Fidelity: the trained Flux Fill model in bfloat16 with two LoRA adapters, three jobs (adapter sets
  ``(a 0.9)``, ``(a 0.4, b 1.0)``, none), every pair in both orders and all three: each job's
  picture from the batch against the same job alone and against the stock ``FluxFillPipeline`` +
  ``load_lora_weights`` in bfloat16 (max pixel difference), with batch invariance off and on, over
  several adapter pairs (the kernels' differences are rare last bits: whether one reaches a pixel
  depends on the values).
- Speed: engine step time of ``--batch`` jobs sharing every step, full compute and mask-aware,
  in bfloat16, invariance off and on, rounds interleaved (per-round ratio, medians): a UNet of
  ``--hidden`` widths at ``--size`` px (CFG jobs) and the trained Flux model at ``--size`` px.

    python -m ops.bench.batch_invariance --out docs/bench/batch_invariance.md
"""

from __future__ import annotations

import copy
import logging
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.demo import demo_templates
from app.jobs import JobParams
from app.maskgen import make_mask
from app.settings import Settings
from app.storage import LocalStore
from ops.bench.harness import cli
from ops.bench.harness.addons import save_flux_lora
from ops.bench.harness.engine import record, run, step_costs
from ops.bench.harness.models import saved_sd_pipeline
from ops.bench.harness.timing import interleave, median, paired
from workers.adapters.bank import AdapterBank
from workers.adapters.convert import canonical_lora
from workers.adapters.patcher import LoraPatcher
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.models.loader import ensure_model_dir, load_cpu_pipeline, load_unet, scheduler_config

log = logging.getLogger(__name__)
BF16 = torch.bfloat16
SETS = [(("a", 0.9),), (("a", 0.4), ("b", 1.0)), ()]
ORDERS = ([0, 1], [1, 0], [0, 2], [2, 0], [1, 2], [2, 1], [0, 1, 2], [2, 1, 0])


def _pil(mask: np.ndarray) -> Image.Image:
    return Image.fromarray(mask.astype(np.uint8) * 255)


def _pattern(size: int, seed: int) -> Image.Image:
    """A smooth synthetic template (the adapter tests' images)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    arr = np.stack([np.sin(xx * rng.uniform(2, 8)), np.cos(yy * rng.uniform(2, 8)), np.sin((xx + yy) * 4)], -1)
    return Image.fromarray(((arr * 0.5 + 0.5) * 255).astype(np.uint8))


class FluxWorld:
    """The trained Flux model in bf16, two adapters, and runners with invariance on or off."""

    def __init__(self, folder: Path, work: Path, size: int, steps: int, rank: int, adapter_seed: int = 3) -> None:
        from diffusers import FluxFillPipeline

        from workers.flux_inputs import prepare_flux_job_tensors

        self.folder, self.size = folder, size
        maker = FluxFillPipeline.from_pretrained(folder, dtype=torch.float32)
        self.files = {"a": save_flux_lora(maker, work / "a", rank=rank, seed=adapter_seed),
                      "b": save_flux_lora(maker, work / "b", rank=2 * rank, seed=adapter_seed + 1)}
        self.weights = {i: canonical_lora(f.read_bytes(), folder, i, max_bytes=1 << 30) for i, f in self.files.items()}
        self.pipe = FluxFillPipeline.from_pretrained(folder, dtype=BF16)
        self.pipe.set_progress_bar_config(disable=True)
        self.jobs = [(_pattern(size, 20 + i), make_mask(0.3, (size, size), "blob", seed=i),
                      JobParams(prompt=p, steps=steps, guidance=30.0, seed=i, loras=s))
                     for i, (p, s) in enumerate(zip(["a cat", "grass", "the moon"], SETS))]
        self.prepared = []
        for img, mask, params in self.jobs:
            prep = prepare_flux_job_tensors(self.pipe, scheduler_config(folder), img, _pil(mask), params, size, size)
            self.prepared.append((prep.tensors, dict(prep.meta, loras=[[i, c] for i, c in params.loras],
                                                     cache_mode="full")))

    def runner(self, invariant: bool, maskaware: bool = True) -> Any:
        from workers.engine.flux_runner import FluxRunner
        from workers.maskaware.flux import MaskAwareFlux

        model = copy.deepcopy(self.pipe.transformer).eval()
        bank = AdapterBank(self.weights.__getitem__, 1 << 30)
        return FluxRunner(model, scheduler_config(self.folder), self.pipe.vae_scale_factor,
                          maskaware=MaskAwareFlux(model) if maskaware else None,
                          lora=LoraPatcher(model, "transformer", bank.get), adapters=bank, batch_invariant=invariant)

    def picture(self, latents: torch.Tensor) -> np.ndarray:
        from workers.flux_inputs import decode_flux_latents

        return np.asarray(decode_flux_latents(self.pipe, latents, self.size, self.size), dtype=np.int16)

    def stock(self, k: int) -> np.ndarray:
        from diffusers import FluxFillPipeline

        img, mask, params = self.jobs[k]
        ref = FluxFillPipeline.from_pretrained(self.folder, dtype=BF16)
        ref.set_progress_bar_config(disable=True)
        if params.loras:
            for lora_id, _ in params.loras:
                ref.load_lora_weights(str(self.files[lora_id].parent), adapter_name=lora_id)
            ref.set_adapters([i for i, _ in params.loras], [c for _, c in params.loras])
        out = ref(prompt=params.prompt, image=img, mask_image=_pil(mask), num_inference_steps=params.steps,
                  guidance_scale=params.guidance, height=self.size, width=self.size,
                  generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
        return np.asarray(out, dtype=np.int16)


def part_fidelity(args: Any, work: Path) -> list[str]:
    folder = ensure_model_dir(Settings.from_env(home=work, model_dir="", model_id="tiny-flux-fill-trained"))
    seeds = [int(x) for x in args.adapter_seeds.split(",")]
    orders = [[int(i) for i in o.split(",")] for o in args.orders.split(";")]
    which = ("every pair in both orders, all three in two orders" if orders == [list(o) for o in ORDERS]
             else f"job indices in batch order: {args.orders.replace(';', ' / ')}")
    lines = [f"## Fidelity: trained Flux Fill, bfloat16, {args.fidelity_size} px, {args.fidelity_steps} steps, "
             "guidance 30, mixed LoRA batches\n",
             f"Per adapter pair (seeds s, s+1 of `save_flux_lora`; s in {seeds}): the three jobs alone and in "
             f"{len(orders)} batches ({which}). Max pixel difference (/255) of each job's picture from a batch against "
             "the same job alone in the engine and against the stock `FluxFillPipeline` with `load_lora_weights` in "
             "bfloat16; jobs moved = pictures (of "
             f"{sum(map(len, orders))} per pair) that differ from the job alone.\n",
             "| adapter seed | invariance off: worst vs alone | vs stock | jobs moved | invariance on: worst vs alone "
             "| vs stock | jobs moved |", "|---|---|---|---|---|---|---|"]
    worst = {False: [0, 0, 0], True: [0, 0, 0]}
    for seed in seeds:
        world = FluxWorld(folder, work / f"adapters-{seed}", args.fidelity_size, args.fidelity_steps, args.rank, seed)
        stock = [world.stock(k) for k in range(len(SETS))]
        row = [str(seed)]
        for invariant in (False, True):
            alone_latents = [run(world.runner(invariant), [p])[0]["latents"] for p in world.prepared]
            alone = [world.picture(z) for z in alone_latents]
            w_alone = w_stock = moved = 0
            for order in orders:
                out = run(world.runner(invariant), [world.prepared[i] for i in order])
                for i, o in zip(order, out):
                    # equal latents decode to the same picture: only a moved job pays a (bf16) VAE decode
                    pic = alone[i] if torch.equal(o["latents"], alone_latents[i]) else world.picture(o["latents"])
                    d = int(np.abs(pic - alone[i]).max())
                    w_alone, moved = max(w_alone, d), moved + (d > 0)
                    w_stock = max(w_stock, int(np.abs(pic - stock[i]).max()))
            row += [f"{w_alone}/255", f"{w_stock}/255", str(moved)]
            agg = worst[invariant]
            worst[invariant] = [max(agg[0], w_alone), max(agg[1], w_stock), agg[2] + moved]
        lines.append("| " + " | ".join(row) + " |")
    n = len(seeds) * sum(len(o) for o in orders)
    lines += ["", f"Over {n} batched pictures: invariance off, worst {worst[False][0]}/255 from the job alone and "
              f"{worst[False][1]}/255 from stock, {worst[False][2]} pictures moved; on, {worst[True][0]}/255, "
              f"{worst[True][1]}/255, {worst[True][2]} moved (the bf16 budget is 2/255).", ""]
    return lines


def _sd_jobs(folder: Path, size: int, steps: int, n: int, ratio: float, seed: int) -> tuple[Any, list]:
    from workers.sd_inputs import prepare_job_tensors

    cpu = load_cpu_pipeline(folder, dtype=BF16)
    images = demo_templates(size)
    jobs = []
    for i in range(n):
        params = JobParams(prompt=["a cat", "grass", "the moon", "a rocket"][i % 4], steps=steps, guidance=7.5,
                           seed=seed + i)
        mask = make_mask(ratio, (size, size), "blob", seed=seed + i)
        prep = prepare_job_tensors(cpu, scheduler_config(folder), images[i % len(images)][1], _pil(mask), params,
                                   size, size)
        jobs.append((prep.tensors, dict(prep.meta), params))
    return cpu, jobs


def part_speed(args: Any, work: Path) -> list[str]:
    from workers.engine.sd_runner import SDRunner
    from workers.maskaware.unet import MaskAwareUNet

    size, steps, batch = args.size, args.steps, args.batch
    sd_folder = saved_sd_pipeline(work, tuple(int(h) for h in args.hidden.split(",")))
    _cpu, sd_jobs = _sd_jobs(sd_folder, size, steps, batch, args.ratio, args.seed)
    configs: dict[tuple[str, str, bool], tuple[Any, list]] = {}
    for invariant in (False, True):
        store = ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-inv-", dir=work)))
        unet = load_unet(sd_folder, "cpu", BF16)
        full = SDRunner(unet, scheduler_config(sd_folder), batch_invariant=invariant)
        masked = SDRunner(unet, scheduler_config(sd_folder), maskaware=MaskAwareUNet(unet), batch_invariant=invariant,
                          caches=StepCacheProvider(store, 1 << 33), recorder=CacheRecorder(store), prefetch_steps=64)
        masked_jobs = []
        for i, (tensors, meta, params) in enumerate(sd_jobs):
            key = TemplateCacheKey("bench", f"t{i}", size, size, str(scheduler_config(sd_folder)["_class_name"]),
                                   params.steps, params.strength, "cfg2", "kv+y@bfloat16/exact-bench")
            record(masked, tensors, dict(meta, cache_mode="full"), key, resident_steps=steps)
            masked_jobs.append((tensors, dict(meta, cache_mode="masked", cache_key=key.to_dict())))
        configs[("sd", "full", invariant)] = (full, [(t, dict(m, cache_mode="full")) for t, m, _ in sd_jobs])
        configs[("sd", "masked", invariant)] = (masked, masked_jobs)
    flux_folder = ensure_model_dir(Settings.from_env(home=work, model_dir="", model_id="tiny-flux-fill-trained"))
    flux = FluxWorld(flux_folder, work, size, steps, args.rank)
    for invariant in (False, True):
        configs[("flux", "full", invariant)] = (flux.runner(invariant), flux.prepared)

    def measure(config: tuple[str, str, bool]) -> float:
        runner, jobs = configs[config]
        return step_costs(runner, jobs, batch, steps)[0]

    samples = interleave(args.rounds, list(configs), measure, rng=random.Random(args.seed), label="speed: ")
    lines = [f"## Speed: bfloat16, {batch} jobs per step, {size} px, {steps} steps, {args.rounds} interleaved rounds\n",
             f"SD: UNet widths {args.hidden}, CFG jobs, no adapters, mask-aware at mask ratio {args.ratio} from "
             "recorded caches. Flux: the trained model, the fidelity part's three adapter sets (a mixed LoRA batch).\n",
             "| model | path | off ms/step | on ms/step | on / off |", "|---|---|---|---|---|"]
    for model, path in dict.fromkeys((m, p) for m, p, _ in configs):
        off, on = samples[(model, path, False)], samples[(model, path, True)]
        lines.append(f"| {model} | {path} | {median(off) * 1e3:.1f} | {median(on) * 1e3:.1f} | {paired(on, off):.3f} |")
    return lines + ["", "on / off: per-round ratio of step times (median); above 1 = invariance costs time.", ""]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/batch_invariance.md")
    p.add_argument("--parts", default="fidelity,speed")
    p.add_argument("--fidelity-size", type=int, default=128)
    p.add_argument("--fidelity-steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=4, help="rank of adapter a (b: twice)")
    p.add_argument("--adapter-seeds", default="3,5,7,9,11,13,15,17")
    p.add_argument("--orders", default=";".join(",".join(map(str, o)) for o in ORDERS),
                   help="the fidelity part's batches, as job indices in batch order (default: every pair in both "
                        "orders, all three in two orders)")
    p.add_argument("--hidden", default="320,640", help="UNet widths of the speed part")
    p.add_argument("--size", type=int, default=256, help="image side of the speed part")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=5)
    run_ = cli.start(p, argv, __file__, quick=dict(fidelity_steps=2, fidelity_size=64, adapter_seeds="3",
                                                   orders="2,1,0", steps=3, rounds=1, hidden="32,64", size=64))
    work = Path(tempfile.mkdtemp(prefix="stencil-inv-home-"))
    cli.report_parts(run_, f"Batch invariance in half precision (STENCIL_BATCH_INVARIANT, {run_.args.threads} "
                     "torch thread(s))", {"fidelity": part_fidelity, "speed": part_speed}, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
