"""The ControlNet benchmarks' two paths: ``StableDiffusionControlNetInpaintPipeline`` (stock) and
ControlNets added to Stencil's store; shared by ``controlnet`` and ``addons_gpu``."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import ControlNetModel, StableDiffusionControlNetInpaintPipeline, StableDiffusionInpaintPipeline
from PIL import Image

from app.controls import controlnet_key
from app.demo import demo_templates
from app.maskgen import make_mask
from app.storage import LocalStore
from ops.bench.harness.addons import save_controlnet
from workers.models.loader import load_unet

log = logging.getLogger(__name__)


NETS = ("edges", "depth")


def edges_of(image: Image.Image) -> Image.Image:
    from skimage.feature import canny

    gray = np.asarray(image.convert("L"), dtype=np.float32) / 255
    return Image.fromarray((canny(gray, sigma=2) * 255).astype(np.uint8)).convert("RGB")


def job_inputs(size: int, k: int) -> tuple[Image.Image, np.ndarray, Image.Image]:
    templates = demo_templates(size)
    image = templates[k % len(templates)][1]
    return image, make_mask(0.25, (size, size), ("blob", "rect")[k % 2], seed=k), edges_of(image)


def add_controlnets(model_dir: Path, store: LocalStore, work: Path, names: tuple[str, ...] = NETS,
                    device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Path]:
    """ControlNets of the benchmark model (made on ``device``, saved in ``dtype``), stored as
    ``stencil controlnet add`` stores them."""
    unet = load_unet(model_dir, device, dtype)
    out = {}
    for seed, name in enumerate(names):
        folder = save_controlnet(unet, work / f"cn-{name}", seed=seed + 1, std=0.02, dtype=dtype)
        for f in ("config.json", "diffusion_pytorch_model.safetensors"):
            store.put(controlnet_key(name, f), (folder / f).read_bytes())
        out[name] = folder
    return out


class Stock:
    """Per request the stock pipeline for its ControlNets (resident: the most favourable case):
    the plain inpainting pipeline for none, ``StableDiffusionControlNetInpaintPipeline`` for one,
    with a ``MultiControlNetModel`` (a list) for more; one per count of ``folders``' ControlNets."""

    def __init__(self, model_dir: Path, folders: dict[str, Path], device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        base = StableDiffusionInpaintPipeline.from_pretrained(model_dir, safety_checker=None, feature_extractor=None,
                                                              requires_safety_checker=False, dtype=dtype).to(device)
        base.set_progress_bar_config(disable=True)
        nets = [ControlNetModel.from_pretrained(f, dtype=dtype).to(device).eval() for f in folders.values()]
        parts = dict(vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=base.unet,
                     scheduler=base.scheduler, safety_checker=None, feature_extractor=None,
                     requires_safety_checker=False)
        self.device = torch.device(device)
        self.pipes: dict[int, Any] = {0: base}
        for n in range(1, len(nets) + 1):
            pipe = StableDiffusionControlNetInpaintPipeline(controlnet=nets[:n] if n > 1 else nets[0], **parts)
            pipe.set_progress_bar_config(disable=True)
            self.pipes[n] = pipe

    def job(self, image: Image.Image, mask: np.ndarray, control: Image.Image, n: int, steps: int, seed: int) -> float:
        h, w = mask.shape
        kw: dict[str, Any] = dict(prompt="a hat", image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
                                  num_inference_steps=steps, guidance_scale=7.5, height=h, width=w,
                                  generator=torch.Generator("cpu").manual_seed(seed))
        if n:
            kw.update(control_image=[control] * n if n > 1 else control,
                      controlnet_conditioning_scale=[0.8] * n if n > 1 else 0.8)
        t0 = time.perf_counter()
        self.pipes[n](**kw)
        return time.perf_counter() - t0

    def batch(self, jobs: list[tuple[Image.Image, np.ndarray, Image.Image]], steps: int, seed: int) -> None:
        """One pipeline call for ``jobs`` (image, mask, control image of one size) with the first
        ControlNet: the stock way to batch on a GPU; job k's seed is ``seed + k``."""
        h, w = jobs[0][1].shape
        self.pipes[1](prompt=["a hat"] * len(jobs), image=[j[0] for j in jobs],
                      mask_image=[Image.fromarray(j[1].astype(np.uint8) * 255) for j in jobs],
                      control_image=[j[2] for j in jobs], controlnet_conditioning_scale=0.8,
                      num_inference_steps=steps, guidance_scale=7.5, height=h, width=w,
                      generator=[torch.Generator("cpu").manual_seed(seed + k) for k in range(len(jobs))])
