"""A job's controls on the CPU side: checked, decoded and prepared as the stock pipeline does.

``StableDiffusionControlNetInpaintPipeline.prepare_control_image`` (run on a stand-in that holds
only its ``control_image_processor``, built as that pipeline builds it) turns each control image
into the tensor the ControlNet receives: resized to the job's size, RGB in [0, 1], doubled for
classifier-free guidance. A control image must have the template's size (as the mask must): a
different size is a mistake the service reports instead of silently stretching it.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image

from app.controls import Control, controlnet_meta_key
from workers.addon_store import Descriptions

controlnet_meta = Descriptions(controlnet_meta_key).get  # a stored ControlNet's description, or None


def controls_problem(controls: tuple[Control, ...], model_id: str, family: str) -> str | None:
    """Why a job's controls cannot be served, or None."""
    if not controls:
        return None
    if family != "sd":
        return "ControlNets are served for SD-family models only (diffusers has no Flux Fill ControlNet pipeline)"
    unknown = sorted({c[0] for c in controls if controlnet_meta(c[0]) is None})
    if unknown:
        return f"unknown ControlNet(s): {', '.join(unknown)} (add them with `stencil controlnet add`)"
    other = sorted({c[0] for c in controls if (controlnet_meta(c[0]) or {}).get("model_id") != model_id})
    if other:
        return f"ControlNet(s) {', '.join(other)} were added for another model than this service's"
    return None


def prepare_control_images(pipe: Any, images: list[Image.Image], height: int, width: int,
                           do_cfg: bool) -> dict[str, torch.Tensor]:
    """Job tensors ``control<i>`` exactly as the stock ControlNet inpainting pipeline prepares them."""
    from diffusers import StableDiffusionControlNetInpaintPipeline
    from diffusers.image_processor import VaeImageProcessor

    stand_in = SimpleNamespace(control_image_processor=VaeImageProcessor(
        vae_scale_factor=pipe.vae_scale_factor, do_convert_rgb=True, do_normalize=False))
    out = {}
    for i, image in enumerate(images):
        out[f"control{i}"] = StableDiffusionControlNetInpaintPipeline.prepare_control_image(
            stand_in, image=image, width=width, height=height, batch_size=1, num_images_per_prompt=1,
            device=torch.device("cpu"), dtype=torch.float32, crops_coords=None, resize_mode="default",
            do_classifier_free_guidance=do_cfg, guess_mode=False)
    return out


def image_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


__all__ = ["controlnet_meta", "controls_problem", "image_digest", "prepare_control_images"]
