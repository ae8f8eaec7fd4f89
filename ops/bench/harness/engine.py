"""Jobs through the engine in process (no Celery, no Redis): run to completion, record a warm-up,
per-step cost and engine overhead by batch size, and the throughput-vs-batch curve."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import StableDiffusionInpaintPipeline
from PIL import Image

from app.demo import demo_templates
from app.jobs import JobParams
from app.maskgen import make_mask
from app.storage import LocalStore
from ops.bench.harness.dispatch import DispatchCounter, counting_forward
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.engine.sd_runner import SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
from workers.maskaware.unet import MaskAwareUNet
from workers.models.loader import load_cpu_pipeline, load_unet, scheduler_config
from workers.sd_inputs import prepare_job_tensors

log = logging.getLogger(__name__)


def run(runner: Any, jobs: list[tuple[dict, dict]], timeout_s: float = 600.0) -> list[dict]:
    """Run jobs to completion in one continuous-batching engine (in process). An idle step is not
    the end: a job can wait for its adapters, fetched in the background (``AdapterBank``)."""
    engine = Engine(runner, BatchScheduler(max_batch=4))
    handles = [engine.submit(f"j{i}", t, m, total_steps=int(m["num_steps"])) for i, (t, m) in enumerate(jobs)]
    deadline = time.monotonic() + timeout_s
    while True:
        engine._drain_inbox(block=False)
        if engine.step_once():
            continue
        if all(h.future.done() for h in handles):
            return [h.future.result() for h in handles]
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not done after {timeout_s:.0f} s")
        time.sleep(0.002)


def record(runner: Any, tensors: dict, meta: dict, key: TemplateCacheKey, resident_steps: int = 0) -> dict:
    """A warm-up recorded as the service does, committed; its first ``resident_steps`` steps
    waited for in the runner's cache (as after the service's prefetch)."""
    out = run(runner, [(tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))])[0]
    out["commit"].result(600)
    for step in range(resident_steps):
        runner.caches.wait(key, step, 60)
    return out


class TimedForward:
    """Wraps a runner's denoiser call to separate model time from engine overhead."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.inner = runner._forward
        self.seconds = 0.0
        runner._forward = self

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - start


def _engine_after_first_step(runner: Any, jobs: list[tuple[dict, dict]], batch: int, steps: int) -> Engine:
    """An engine with ``batch`` jobs sharing every step, after their first step (the composition's
    first step builds what later steps reuse)."""
    engine = Engine(runner, BatchScheduler(max_batch=batch))
    for i in range(batch):
        tensors, meta = jobs[i % len(jobs)]
        engine.submit(f"j{i}", tensors, meta, total_steps=steps)
    engine._drain_inbox(block=False)
    engine.step_once()
    return engine


def step_costs(runner: Any, jobs: list[tuple[dict, dict]], batch: int, steps: int) -> tuple[float, float]:
    """(seconds per step, overhead seconds per step) for ``batch`` jobs sharing every step."""
    timer = TimedForward(runner)
    engine = _engine_after_first_step(runner, jobs, batch, steps)
    timer.seconds = 0.0
    start = time.perf_counter()
    n = 0
    while engine.step_once():
        n += 1
    total = time.perf_counter() - start
    runner._forward = timer.inner
    return total / max(n, 1), (total - timer.seconds) / max(n, 1)


def kernels_around_the_model(runner: Any, model: torch.nn.Module, jobs: list[tuple[dict, dict]], batch: int,
                             steps: int) -> tuple[int, int]:
    """(kernel-launching operators of one steady engine step, those outside ``model``'s forward) for
    ``batch`` jobs sharing the step: what a step launches besides a graph-replayable model call
    (inputs, guidance, scheduler updates, checks, staging)."""
    engine = _engine_after_first_step(runner, jobs, batch, steps)
    whole = DispatchCounter()
    with counting_forward(model) as inside, whole:
        engine.step_once()
    while engine.step_once():
        pass
    return whole.kernels, whole.kernels - inside.kernels


def _stock_rows(model_dir: Path, image: Image.Image, mask: Image.Image, steps: int,
                batches: list[int], repeats: int) -> list[dict[str, float]]:
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
    record(maskaware, tensors, meta, key, resident_steps=steps)
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
    """Rows of (engine, batch, jobs per second) for the stock pipeline and both Stencil modes, one
    torch thread: whether a step of B jobs costs less than B steps of one job."""
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
