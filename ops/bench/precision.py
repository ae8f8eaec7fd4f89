"""Precision (``STENCIL_DTYPE``): float32, bfloat16 and float16 side by side in one run.

- Exactness and drift: one edit of the trained SD model through the service's path (CPU task and
  engine in the dtype) against the stock ``StableDiffusionInpaintPipeline`` loaded in the same dtype
  (max pixel difference), and against the float32 result (max difference, SSIM): what switching
  precision changes in the picture.
- Speed: engine step time (full compute, and the exact mask-aware path at ``--ratio``) of a UNet of
  ``--hidden`` widths at ``--size`` px, one CFG job per step, rounds interleaved across dtypes, with
  the per-round ratio to float32; and the activation cache bytes one step records.

    python -m ops.bench.precision --out docs/bench/precision.md
"""

from __future__ import annotations

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
from ops.bench.harness.edits import metrics
from ops.bench.harness.engine import record, run, step_costs
from ops.bench.harness.models import saved_sd_pipeline
from ops.bench.harness.timing import interleave, median, paired, uptime
from workers.engine.sd_runner import SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.maskaware.unet import MaskAwareUNet
from workers.models.loader import ensure_model_dir, load_cpu_pipeline, load_unet, scheduler_config, torch_dtype
from workers.sd_inputs import decode_latents, prepare_job_tensors

log = logging.getLogger(__name__)


class Setup:
    """A CPU pipeline and the engine's runners (full, mask-aware) of one model folder in one dtype."""

    def __init__(self, folder: Path, dtype: str, size: int) -> None:
        self.folder, self.dtype, self.size = folder, dtype, size
        self.cpu = load_cpu_pipeline(folder, dtype=torch_dtype(dtype))
        unet = load_unet(folder, "cpu", torch_dtype(dtype))
        store = ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-prec-")))
        self.full = SDRunner(unet, scheduler_config(folder))
        self.masked = SDRunner(unet, scheduler_config(folder), maskaware=MaskAwareUNet(unet),
                               caches=StepCacheProvider(store, 1 << 32), recorder=CacheRecorder(store), prefetch_steps=64)

    def prepare(self, image: Image.Image, mask: np.ndarray, params: JobParams) -> tuple[dict, dict]:
        prep = prepare_job_tensors(self.cpu, scheduler_config(self.folder), image.resize((self.size, self.size)),
                                   Image.fromarray(mask.astype(np.uint8) * 255), params, self.size, self.size)
        return dict(prep.tensors), dict(prep.meta, cache_mode="full")

    def key(self, params: JobParams) -> TemplateCacheKey:
        layout = "kv+y" if self.dtype == "float32" else f"kv+y@{self.dtype}"
        return TemplateCacheKey("bench", "t", self.size, self.size, str(scheduler_config(self.folder)["_class_name"]),
                                params.steps, params.strength, "cfg2", f"{layout}/exact-bench")


def stock(folder: Path, dtype: str, image: Image.Image, mask: np.ndarray, params: JobParams, size: int) -> np.ndarray:
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(folder, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False, dtype=torch_dtype(dtype))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=params.prompt, image=image.resize((size, size)), mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=params.steps, guidance_scale=params.guidance, height=size, width=size,
               generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
    return np.asarray(out)


def fidelity_rows(args: Any, folder: Path, image: Image.Image) -> list[str]:
    size = 128
    mask = make_mask(args.ratio, (size, size), "blob", seed=args.seed)
    params = JobParams(prompt="a cat", steps=args.steps, guidance=7.5, seed=args.seed)
    images = {}
    lines = ["## Exactness and drift (trained SD model, 128 px, one edit)\n",
             "| dtype | max px diff vs stock pipeline in this dtype | max px diff vs float32 | SSIM vs float32 |",
             "|---|---|---|---|"]
    for dtype in args.dtypes.split(","):
        setup = Setup(folder, dtype, size)
        out = run(setup.full, [setup.prepare(image, mask, params)])[0]
        images[dtype] = np.asarray(decode_latents(setup.cpu, out["latents"]))
        ref = stock(folder, dtype, image, mask, params, size)
        vs_stock = int(np.abs(images[dtype].astype(int) - ref.astype(int)).max())
        vs_fp32 = int(np.abs(images[dtype].astype(int) - images["float32"].astype(int)).max())
        ssim = metrics(images[dtype], images["float32"], mask)["ssim"]
        lines.append(f"| {dtype} | {vs_stock} | {vs_fp32} | {ssim:.4f} |")
        log.info("%s: vs stock %d, vs float32 %d, SSIM %.4f", dtype, vs_stock, vs_fp32, ssim)
    return lines + [""]


def speed_rows(args: Any, folder: Path, image: Image.Image) -> list[str]:
    size = args.size
    mask = make_mask(args.ratio, (size, size), "blob", seed=args.seed)
    params = JobParams(prompt="a cat", steps=args.steps, guidance=7.5, seed=args.seed)
    dtypes = args.dtypes.split(",")
    jobs, setups, cache_bytes = {}, {}, {}
    for dtype in dtypes:
        setup = setups[dtype] = Setup(folder, dtype, size)
        tensors, meta = setup.prepare(image, mask, params)
        key = setup.key(params)
        rec = record(setup.masked, tensors, meta, key, resident_steps=args.steps)
        step0 = setup.masked.caches.wait(key, 0, 60)
        cache_bytes[dtype] = sum(t.numel() * t.element_size() for t in step0.values())
        del rec
        jobs[(dtype, "full")] = (setup.full, [(tensors, meta)])
        jobs[(dtype, "masked")] = (setup.masked, [(tensors, dict(meta, cache_mode="masked", cache_key=key.to_dict()))])

    def measure(config: tuple[str, str]) -> float:
        runner, job = jobs[config]
        return step_costs(runner, job, 1, args.steps)[0]

    samples = interleave(args.rounds, list(jobs), measure, rng=random.Random(args.seed), label="speed: ")
    hidden = args.hidden or "the trained model's"
    lines = [f"## Speed (UNet widths {hidden}, {size} px, one CFG job, {args.steps} steps, mask ratio {args.ratio}, "
             f"{args.rounds} interleaved rounds, medians)\n",
             "| dtype | full ms/step | x float32 | mask-aware ms/step | x float32 | mask-aware / full | cache MiB per step |",
             "|---|---|---|---|---|---|---|"]
    for dtype in dtypes:
        full, masked = samples[(dtype, "full")], samples[(dtype, "masked")]
        lines.append(f"| {dtype} | {median(full) * 1e3:.1f} | {paired(samples[('float32', 'full')], full):.2f} | "
                     f"{median(masked) * 1e3:.1f} | {paired(samples[('float32', 'masked')], masked):.2f} | "
                     f"{paired(masked, full):.2f} | {cache_bytes[dtype] / 2**20:.2f} |")
    return lines + ["", "x float32: float32's step time / this dtype's (per round, median): above 1 = faster.", ""]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/precision.md")
    p.add_argument("--model", default="tiny-sd-inpaint-trained", help="embedded model of the exactness part")
    p.add_argument("--hidden", default="320,640", help="UNet widths of the speed part ('' = --model)")
    p.add_argument("--size", type=int, default=256, help="image side of the speed part")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    run_ = cli.start(p, argv, __file__, quick=dict(steps=3, rounds=1, hidden="", size=64, dtypes="float32,bfloat16"))
    args = run_.args
    if args.dtypes.split(",")[0] != "float32":
        p.error("--dtypes must start with float32 (the reference)")
    home = Path(tempfile.mkdtemp(prefix="stencil-prec-home-"))
    trained = ensure_model_dir(Settings.from_env(home=home, model_dir="", model_id=args.model))
    image = demo_templates(128)[0][1]
    speed_model = saved_sd_pipeline(home, tuple(int(h) for h in args.hidden.split(","))) if args.hidden else trained
    lines = ["# Precision: float32 vs bfloat16 vs float16 (STENCIL_DTYPE)\n",
             f"Command: `{run_.command}` ({args.threads} torch thread(s)). Load at start: {uptime()}.\n"]
    lines += fidelity_rows(args, trained, image)
    lines += speed_rows(args, speed_model, image)
    lines.append(f"Total {run_.elapsed():.0f} s; load at end: {uptime()}.")
    run_.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
