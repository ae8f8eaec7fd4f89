"""Timing the engine's runner on composed batches: the model under test, in-RAM template caches and
``RunnerTimer`` (real ``SDRunner`` steps, CPU or wall time). Shared by ``profile`` (the cost-model
fit) and ``mixing_cost`` (what one more image size in a step costs)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from app.settings import Settings
from ops.bench.harness.gpu import build_on, sync
from ops.bench.harness.models import build_sd_unet, cfg_job, ddim_config, pixel_mask
from workers.engine.job import EngineJob
from workers.engine.sd_runner import SDRunner
from workers.maskaware.activation_store import TemplateCacheKey, recorded_layout
from workers.maskaware.tokens import build_token_masks
from workers.maskaware.unet import MaskAwareUNet
from workers.models import true_size
from workers.models.loader import ensure_model_dir, load_unet, scheduler_config

log = logging.getLogger(__name__)


@dataclass
class ModelUnderTest:
    model_id: str
    unet: Any
    scheduler_config: dict[str, Any]
    latent: int
    text_len: int
    cross_dim: int
    description: str


def load_model(kind: str, latent: int | None, seed: int, device: str = "cpu",
               dtype: torch.dtype = torch.float32, quick: bool = False) -> ModelUnderTest:
    """``tiny``: the model the service is configured with (the embedded default unless ``STENCIL_MODEL``
    / ``STENCIL_MODEL_DIR`` name another), at its own sample size; ``sd-l2``: SD-1.5-width blocks
    (320/640 channels, heads of 64, cross dim 768), two levels so that it fits 2 CPU cores; ``sd15``:
    the full SD-1.5 architecture (only for ``--project-from``: a few validation points);
    ``sd15-inpaint``: the true-size SD 1.5 inpainting UNet (``workers/models/true_size.py``, random
    weights made on ``device``: what a GPU deployment serves; ``quick``: its shrunk test twin)."""
    if kind == "tiny":
        s = Settings.from_env()
        folder = ensure_model_dir(s)
        unet = load_unet(folder, device, dtype)
        return ModelUnderTest(s.model_id, unet, scheduler_config(folder), latent or int(unet.config.sample_size), 77,
                              int(unet.config.cross_attention_dim), f"the configured model ({folder})")
    if kind == "sd-l2":
        lat = latent or 32
        unet = build_sd_unet((320, 640), lat, 1, 1, 768, seed).to(device, dtype)
        return ModelUnderTest("sd-arch-320-640", unet, ddim_config(), lat, 77, 768,
                              "SD-architecture UNet, block_out_channels (320, 640), layers_per_block 1, "
                              "cross_attention_dim 768, heads of 64, random init")
    if kind == "sd15":
        lat = latent or 64
        unet = build_sd_unet((320, 640, 1280, 1280), lat, 2, 1, 768, seed).to(device, dtype)
        return ModelUnderTest("sd15-arch", unet, ddim_config(), lat, 77, 768,
                              "SD-1.5 architecture UNet (320/640/1280/1280, 2 layers per block, cross dim 768, "
                              "heads of 64), 9-channel inpainting, random init")
    if kind in true_size.TRUE_SIZE_MODELS and true_size.spec(kind).pipeline == "StableDiffusionInpaintPipeline":
        spec = true_size.shrunk(kind) if quick else true_size.spec(kind)
        unet = build_on(spec.components["unet"], dtype, torch.device(device), seed)
        lat = latent or int(unet.config.sample_size)
        return ModelUnderTest(kind, unet, ddim_config(), lat, 77, int(unet.config.cross_attention_dim),
                              f"true-size {kind} UNet{' (shrunk)' if quick else ''}, random weights")
    raise ValueError(f"unknown model kind {kind!r} (tiny | sd-l2 | sd15 | sd15-inpaint)")


class RecordedCaches:
    """Recorder + provider for the runner: keeps warm-ups' real per-step activations in RAM (per key)."""

    def __init__(self) -> None:
        self.steps: dict[tuple[Any, int], dict[str, torch.Tensor]] = {}

    def put(self, key: Any, step: int, tensors: dict[str, torch.Tensor]) -> Future:
        self.steps[(key, step)] = {k: v.detach().clone() for k, v in tensors.items()}
        return self.commit(key)

    def commit(self, key: Any) -> Future:
        f: Future = Future()
        f.set_result(None)
        return f

    def prefetch(self, key: Any, steps: Any) -> None:
        return None

    def ready(self, key: Any, step: int, fetch: bool = True) -> dict[str, torch.Tensor] | None:
        """Every recorded step is resident (``fetch`` only matters for a real store)."""
        return self.steps.get((key, step))

    def peek(self, key: Any, step: int) -> dict[str, torch.Tensor] | None:
        """What the runner stages a step ahead with (on CUDA, while the current step computes)."""
        return self.steps.get((key, step))


@dataclass
class JobSpec:
    ratio: float
    cached: bool
    shape: str  # blob | rect
    seed: int
    latent_hw: tuple[int, int] | None = None  # None: the model's profiled size


class RunnerTimer:
    """Builds jobs for the real ``SDRunner`` and times its ``step`` (one template cache per size)."""

    def __init__(self, mut: ModelUnderTest, steps: int, device: str = "cpu",
                 sizes: list[tuple[int, int]] | None = None, graphs: bool | None = None) -> None:
        self.mut = mut
        self.steps = steps
        self.device = device
        self.sizes = sizes or [(mut.latent, mut.latent)]  # latent (h, w)
        self.h = self.w = mut.latent
        self.caches = RecordedCaches()
        self.maskaware = MaskAwareUNet(mut.unet)
        self.runner = SDRunner(mut.unet, mut.scheduler_config, device, maskaware=self.maskaware, caches=self.caches,
                               recorder=self.caches, prefetch_steps=0, graphs=graphs)
        # Untimed steps of a batch: one; with step graphs (CUDA by default) until its signature is
        # captured (``StepGraphs.repeats``), so that the timed steps are the replays the engine runs.
        self.warm = 1 if self.runner.graphs is None else self.runner.graphs.repeats
        self.keys = {hw: TemplateCacheKey(
            model_id=mut.model_id, template_id="profile", height=hw[0] * 8, width=hw[1] * 8,
            scheduler=str(mut.scheduler_config["_class_name"]), steps=steps, strength=1.0, guidance="cfg2",
            layout=recorded_layout(self.maskaware.cache_layout, mut.unet.dtype)).to_dict() for hw in self.sizes}
        for hw in self.sizes:
            self._record(hw)

    def tokens(self, pixel_mask: torch.Tensor, latent_hw: tuple[int, int]) -> tuple[int, ...]:
        levels = len(self.mut.unet.config.block_out_channels)
        tm = build_token_masks(pixel_mask, latent_hw, levels)
        return tuple(int(lvl.sum()) for lvl in tm.levels)

    def make_job(self, spec: JobSpec, mode: str, index: int) -> Any:
        hw = spec.latent_hw or self.sizes[0]
        pix = pixel_mask(hw[0] * 8, spec.ratio, spec.shape, spec.seed, width=hw[1] * 8)
        tensors, meta = cfg_job(pix, hw, self.steps, (self.mut.text_len, self.mut.cross_dim), 1000 + spec.seed,
                                mode=mode, cache_key=self.keys[hw] if mode != "full" else None)
        job = EngineJob(job_id=f"j{index}", total_steps=self.steps, mask_ratio=spec.ratio, latent_hw=hw)
        job.state = self.runner.init_state(tensors, meta)
        job.cached = mode == "masked"
        job.masked_tokens = self.tokens(pix, hw) if job.cached else None
        return job

    def _record(self, hw: tuple[int, int]) -> None:
        """A warm-up job records real activations for every step (the template's cache at this size)."""
        job = self.make_job(JobSpec(0.0, False, "blob", 7, hw), "record", -1)
        for _ in range(self.steps):
            self.runner.step([job])
            job.steps_done += 1
        first = next(v for (k, st), v in self.caches.steps.items() if st == 0 and k.height == hw[0] * 8
                     and k.width == hw[1] * 8)
        log.info("recorded %d steps of template activations at latent %s (%.1f MiB per step)", self.steps, hw,
                 sum(t.numel() * t.element_size() for t in first.values()) / 2**20)

    def time_batch(self, specs: list[JobSpec], repeats: int, pipelined: bool = False
                   ) -> tuple[list[float], list[float], list[Any]]:
        """(wall seconds, CPU seconds) of ``repeats`` steps after ``warm`` untimed ones. CPU: this
        thread's, or with several sizes the process's (lockstep threads compute one at a time).
        ``pipelined`` (on a GPU): the timed steps run back to back, as the engine launches a step
        while the device still runs the last, and each one's wall time is their mean period; else
        each step is synchronised on its own (its launch and its kernels one after the other)."""
        mode = lambda s: "masked" if (s.cached and s.ratio < 1.0) else "full"  # noqa: E731
        jobs = [self.make_job(s, mode(s), i) for i, s in enumerate(specs)]
        cpu_clock = time.process_time if len(self.sizes) > 1 else time.thread_time
        wall, cpu = [], []
        device = torch.device(self.device)
        if repeats + self.warm > self.steps:
            raise ValueError(f"{repeats} timed + {self.warm} warm steps exceed the template's {self.steps}")
        back_to_back = pipelined and device.type == "cuda"
        started = 0.0
        for r in range(repeats + self.warm):
            if not back_to_back or r <= self.warm:
                sync(device)  # on a GPU: the step's wall time from its first launch to its last kernel
            if r == self.warm:
                started = time.perf_counter()
            c0, w0 = cpu_clock(), time.perf_counter()
            self.runner.step(jobs)
            if not back_to_back:
                sync(device)
            dw, dc = time.perf_counter() - w0, cpu_clock() - c0
            for j in jobs:
                j.steps_done += 1
            if r >= self.warm:
                wall.append(dw)
                cpu.append(dc)
        if back_to_back:
            sync(device)
            wall = [(time.perf_counter() - started) / repeats] * repeats
        return wall, cpu, jobs
