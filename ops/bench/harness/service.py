"""The service's job path in one process, for add-on benchmarks: what the dispatcher, a CPU worker
and a GPU worker do, minus Redis and Celery (measured elsewhere: ``ops/bench/overheads.py``).

``route`` is the dispatcher's part (the GPU worker starts fetching the job's adapters and
ControlNets; an idle engine merges the adapters in the background), ``prepare`` / ``decode`` the
CPU worker's (the product's own functions), and the engine runs on its own thread with the
product's LoRA patcher, adapter bank and ControlNet bank, reading add-ons from an object store as
a GPU worker does. ``device``: where the UNet, the add-ons and the stages run (on a GPU, the GPU
host's stage pool: ``STENCIL_STAGE_PLACEMENT=gpu_host``), in ``dtype``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.adapters import lora_meta_key, lora_weights_key
from app.jobs import JobParams
from app.storage import ObjectStore
from workers.adapters.bank import AdapterBank
from workers.adapters.convert import canonical_lora
from workers.adapters.lora import LoraWeights
from workers.adapters.patcher import LoraPatcher
from workers.controlnets.bank import ControlNetBank, store_loader
from workers.controlnets.inputs import prepare_control_images
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.engine.sd_runner import SDRunner
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore
from workers.maskaware.unet import MaskAwareUNet
from workers.models.loader import load_cpu_pipeline, load_unet, scheduler_config
from workers.sd_inputs import decode_latents, prepare_job_tensors


def add_lora(store: ObjectStore, model_dir: Path, lora_id: str, file: Path) -> LoraWeights:
    """What ``stencil lora add`` stores (the canonical weights and their description)."""
    weights = canonical_lora(file.read_bytes(), model_dir, lora_id, max_bytes=1 << 32)
    store.put(lora_weights_key(lora_id), weights.to_bytes())
    store.put(lora_meta_key(lora_id), json.dumps({"id": lora_id, **weights.describe()}, sort_keys=True).encode())
    return weights


class InProcess:
    def __init__(self, model_dir: Path, store: ObjectStore, *, max_batch: int = 4, lora_cache_bytes: int = 1 << 30,
                 controlnet_cache_bytes: int = 1 << 32, controlnet_parallel: bool = True,
                 merge_buffers: int = 2, mask_aware: bool = False, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        self.model_dir = model_dir
        self.store = store
        self.device = torch.device(device)
        self.cfg = scheduler_config(model_dir)
        self.cpu = load_cpu_pipeline(model_dir, device, dtype=dtype)
        unet = load_unet(model_dir, device, dtype)
        read = lambda i: LoraWeights.from_bytes(store.get(lora_weights_key(i)))  # noqa: E731
        self.bank = AdapterBank(read, lora_cache_bytes)
        self.text = LoraPatcher(self.cpu.text_encoder, "text_encoder", read)  # the CPU worker's text adapters
        self.lora = LoraPatcher(unet, "unet", self.bank.get, merge_buffers=merge_buffers,
                                resident=self.bank.resident)
        self.controlnets = ControlNetBank(store_loader(store.get, device, unet.dtype), controlnet_cache_bytes)
        caches: dict[str, Any] = {}
        if mask_aware:  # after the patcher (its forwards must be the ones the hooks wrap)
            activations = ActivationStore(store)
            caches = dict(maskaware=MaskAwareUNet(unet), caches=StepCacheProvider(activations, 1 << 31),
                          recorder=CacheRecorder(activations), prefetch_steps=64)
        self.runner = SDRunner(unet, self.cfg, device, lora=self.lora, adapters=self.bank, controlnets=self.controlnets,
                               controlnet_parallel=controlnet_parallel, **caches)
        self.engine = Engine(self.runner, BatchScheduler(max_batch=max_batch)).start()
        self._n = 0
        self._described: dict[str, dict[str, Any]] = {}
        self.last_result: dict[str, Any] = {}

    def route(self, params: JobParams) -> None:
        """The dispatcher's part for a routed job: fetch its add-ons (and, on an idle engine, merge
        its adapters in the background), as ``stencil.prefetch_loras`` / ``_controlnets`` do."""
        if params.loras:
            def stage() -> None:
                if not self.engine.scheduler.jobs():
                    self.lora.stage(tuple(params.loras))
            self.bank.prefetch((i for i, _ in params.loras), on_ready=stage)
        if params.controls:
            self.controlnets.prefetch(c[0] for c in params.controls)

    def _components(self, lora_id: str) -> dict[str, Any]:
        """What the adapter adapts, from its stored description (as the CPU worker decides which
        text-encoder adapters a job needs, ``workers/adapter_tasks.text_encoder_sets``: no weights read)."""
        if lora_id not in self._described:
            self._described[lora_id] = json.loads(self.store.get(lora_meta_key(lora_id)))["components"]
        return self._described[lora_id]

    def prepare(self, image: Image.Image, mask: np.ndarray, params: JobParams,
                controls: list[Image.Image] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
        h, w = mask.shape
        self.text.apply(tuple((i, sc) for i, sc in params.loras if "text_encoder" in self._components(i)))
        prep = prepare_job_tensors(self.cpu, self.cfg, image, Image.fromarray(mask.astype(np.uint8) * 255), params,
                                   h, w)
        tensors = dict(prep.tensors, **prepare_control_images(self.cpu, list(controls), h, w,
                                                                bool(prep.meta["do_cfg"])))
        meta = dict(prep.meta, cache_mode="full", loras=[[i, s] for i, s in params.loras],
                    controls=[list(c) for c in params.controls])
        return tensors, meta

    def submit(self, tensors: dict[str, Any], meta: dict[str, Any]) -> Any:
        self._n += 1
        return self.engine.submit(f"j{self._n}", tensors, meta, total_steps=int(meta["num_steps"]))

    def decode(self, latents: torch.Tensor) -> Image.Image:
        return decode_latents(self.cpu, latents)

    def job(self, image: Image.Image, mask: np.ndarray, params: JobParams,
            controls: list[Image.Image] = ()) -> tuple[Image.Image, float]:
        """One job end to end (route, prepare, denoise, decode); returns the image and its seconds."""
        t0 = time.perf_counter()
        self.route(params)
        job = self.submit(*self.prepare(image, mask, params, controls))
        self.last_result = job.future.result()  # the engine's record of it (graph-replayed steps, ...)
        image_out = self.decode(self.last_result["latents"])
        return image_out, time.perf_counter() - t0

    def close(self) -> None:
        self.engine.stop()
        self.bank.close()
        self.controlnets.close()
        self.lora.weights.close()
        self.text.weights.close()


__all__ = ["InProcess", "add_lora"]
