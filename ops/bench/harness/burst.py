"""A burst of edits of one template (mask ratios from the spring trace, blob masks) and the stock
diffusers pipeline's run of it in process, in batches: the GPU benchmarks' baseline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.demo import demo_templates
from app.jobs import JobParams
from app.maskgen import make_mask
from ops.bench.harness.gpu import DTYPES, sync

TRACE = Path(__file__).resolve().parents[2] / "data" / "mask_ratios" / "spring_festival_mask_ratio_original.npy"


def trace_ratios(n: int, seed: int) -> list[float]:
    """``n`` mask ratios drawn from the spring trace (clipped to (0.01, 0.9))."""
    ratios = np.load(TRACE).astype(float).ravel()
    rng = np.random.default_rng(seed)
    return [float(np.clip(r, 0.01, 0.9)) for r in rng.choice(ratios, n)]


class Edits:
    """The burst: one template, ``jobs`` edits with their masks, prompts and seeds."""

    def __init__(self, side: int, jobs: int, steps: int, seed: int) -> None:
        self.side, self.steps = side, steps
        self.template = demo_templates(side)[0][1]
        self.ratios = trace_ratios(jobs, seed)
        self.masks = [make_mask(r, (side, side), "blob", seed=seed + i) for i, r in enumerate(self.ratios)]
        self.params = [JobParams(prompt=f"a red scarf {i}", seed=seed + i, steps=steps, guidance=7.5)
                       for i in range(jobs)]

    def mask_image(self, i: int) -> Image.Image:
        return Image.fromarray(self.masks[i].astype(np.uint8) * 255)


def run_stock(folder: Path, edits: Edits, args: Any, device: torch.device) -> dict[str, Any]:
    """The pipeline (``args.model``: sd15 | sdxl, in ``args.dtype``) on ``device``, called per batch
    of ``args.max_batch`` after a warm-up call: jobs/s, latency of each job from the first call."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

    cls = StableDiffusionXLInpaintPipeline if args.model == "sdxl" else StableDiffusionInpaintPipeline
    extra = {} if args.model == "sdxl" else {"safety_checker": None, "feature_extractor": None,
                                             "requires_safety_checker": False}
    pipe = cls.from_pretrained(folder, dtype=DTYPES[args.dtype], **extra).to(device)
    pipe.set_progress_bar_config(disable=True)

    def call(idx: list[int]) -> None:
        pipe(prompt=[edits.params[i].prompt for i in idx], image=[edits.template] * len(idx),
             mask_image=[edits.mask_image(i) for i in idx], num_inference_steps=edits.steps, guidance_scale=7.5,
             height=edits.side, width=edits.side,
             generator=[torch.Generator("cpu").manual_seed(edits.params[i].seed) for i in idx])

    call([0])  # warm-up
    sync(device)
    latencies, t0 = [], time.perf_counter()
    for start_ in range(0, len(edits.params), args.max_batch):
        idx = list(range(start_, min(start_ + args.max_batch, len(edits.params))))
        call(idx)
        sync(device)
        latencies += [time.perf_counter() - t0] * len(idx)
    total = time.perf_counter() - t0
    return row("stock", total, latencies)


def row(system: str, total: float, latencies: list[float], **extra: Any) -> dict[str, Any]:
    """A burst's result: jobs/s, mean and P95 latency, the total seconds, ``extra``."""
    return {"system": system, "jobs_per_s": len(latencies) / total, "mean_s": float(np.mean(latencies)),
            "p95_s": float(np.percentile(latencies, 95)), "total_s": total, **extra}
