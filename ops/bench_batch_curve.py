"""Throughput vs batch size of each engine, in process, on one model folder.

Three engines, same model weights, same image size and step count, one torch thread:

- ``stock``: ``StableDiffusionInpaintPipeline.__call__`` on a batch of B jobs (what the stock
  worker runs; text encoding, VAE encode and decode included, as in the stock loop);
- ``stencil-full``: the Stencil engine's denoising steps, full compute, B jobs in the batch;
- ``stencil-maskaware``: the same with every job masked-only against a warmed template cache.

Jobs per second of denoising work (``B / (steps * step seconds)`` for the engines, ``B / call
seconds`` for the pipeline) show whether a step of B jobs costs less than B steps of one job:
on a GPU it does (batching pays), on this CPU it is close to linear, which is what decides
whether continuous batching can beat static batching here (see ``docs/bench/e2e``).

    python -m ops.bench_batch_curve --model-dir DIR --size 256 --steps 4 --batches 1,2,4
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask

log = logging.getLogger("bench_batch_curve")


def _stock_rows(model_dir: Path, image: Image.Image, mask: Image.Image, steps: int,
                batches: list[int], repeats: int) -> list[dict[str, float]]:
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(model_dir, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    side = image.size[0]

    def call(b: int) -> float:
        start = time.perf_counter()
        pipe(prompt=["a hat"] * b, image=[image] * b, mask_image=[mask] * b, num_inference_steps=steps,
             guidance_scale=7.5, height=side, width=side,
             generator=[torch.Generator("cpu").manual_seed(i) for i in range(b)])
        return time.perf_counter() - start

    call(1)  # warm-up (lazy init)
    rows = []
    for b in batches:
        seconds = float(np.median([call(b) for _ in range(repeats)]))
        rows.append({"engine": "stock", "batch": b, "seconds_per_job": seconds / b, "jobs_per_s": b / seconds})
        log.info("stock batch %d: %.2f s per call", b, seconds)
    return rows


def _engine_rows(model_dir: Path, image: Image.Image, mask: np.ndarray, steps: int, batches: list[int],
                 ratio: float) -> list[dict[str, float]]:
    from app.storage import LocalStore
    from ops.bench_fidelity import run
    from ops.bench_overheads import step_costs
    from workers.engine.sd_runner import SDRunner
    from workers.engine.template_cache import CacheRecorder, StepCacheProvider
    from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
    from workers.maskaware.unet import MaskAwareUNet
    from workers.models.loader import load_cpu_pipeline, load_unet, scheduler_config
    from workers.sd_inputs import prepare_job_tensors

    pipe = load_cpu_pipeline(model_dir)
    unet = load_unet(model_dir, "cpu")
    cfg = scheduler_config(model_dir)
    activations = ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-curve-")))
    full = SDRunner(unet, cfg)
    maskaware = SDRunner(unet, cfg, maskaware=MaskAwareUNet(unet), caches=StepCacheProvider(activations, 1 << 31),
                         recorder=CacheRecorder(activations), prefetch_steps=64)
    side = image.size[0]
    params = JobParams(prompt="a hat", seed=1, steps=steps, guidance=7.5)
    prep = prepare_job_tensors(pipe, cfg, image, Image.fromarray(mask.astype(np.uint8) * 255), params, side, side)
    tensors, meta = dict(prep.tensors), dict(prep.meta)
    key = TemplateCacheKey(model_id="curve", template_id="t0", height=side, width=side,
                           scheduler=str(cfg["_class_name"]), steps=steps, strength=params.strength,
                           guidance="cfg2" if meta["do_cfg"] else "single", layout="kv+y")
    run(maskaware, [(tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))])[0]["commit"].result(300)
    for step in range(steps):
        maskaware.caches.wait(key, step, 60)  # type: ignore[union-attr]
    masked_meta = dict(meta, cache_mode="masked", cache_key=key.to_dict())
    rows = []
    for b in batches:
        for engine, runner, m in (("stencil-full", full, meta), ("stencil-maskaware", maskaware, masked_meta)):
            step_s, overhead_s = step_costs(runner, [(tensors, dict(m))], b, steps)
            rows.append({"engine": engine, "batch": b, "seconds_per_job": step_s * steps / b,
                         "jobs_per_s": b / (step_s * steps), "overhead_ms_per_step": overhead_s * 1e3,
                         "mask_ratio": ratio})
            log.info("%s batch %d: %.1f ms/step", engine, b, step_s * 1e3)
    return rows


def batch_curve(model_dir: Path, *, size: int, steps: int, batches: list[int], ratio: float = 0.15,
                repeats: int = 2) -> list[dict[str, Any]]:
    """Rows of (engine, batch, jobs per second) for the stock pipeline and both Stencil modes."""
    from app.demo import demo_templates

    torch.set_num_threads(1)
    image = demo_templates(size)[0][1]
    mask = make_mask(ratio, (size, size), "blob", seed=3)
    mask_img = Image.fromarray(mask.astype(np.uint8) * 255)
    rows = _stock_rows(model_dir, image, mask_img, steps, batches, repeats)
    rows += _engine_rows(model_dir, image, mask, steps, batches, ratio)
    return rows


def curve_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: jobs/s per engine and batch, and the gain over batch 1 (1.00 = batching buys nothing)."""
    engines = sorted({r["engine"] for r in rows}, key=lambda e: ["stock", "stencil-full", "stencil-maskaware"].index(e))
    batches = sorted({r["batch"] for r in rows})
    lines = ["| engine | " + " | ".join(f"B={b} jobs/s (gain)" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for e in engines:
        by_b = {r["batch"]: r["jobs_per_s"] for r in rows if r["engine"] == e}
        base = by_b.get(batches[0], float("nan"))
        cells = [f"{by_b[b]:.3f} ({by_b[b] / base:.2f}x)" if b in by_b else "-" for b in batches]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = batch_curve(Path(args.model_dir), size=args.size, steps=args.steps,
                       batches=[int(x) for x in args.batches.split(",")], ratio=args.ratio)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    log.info("\n%s", curve_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
