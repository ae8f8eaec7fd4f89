"""The stock diffusers pipelines the tests compare with, built one way everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import ControlNetModel, StableDiffusionControlNetInpaintPipeline, StableDiffusionInpaintPipeline


def cpu_bf16_convs(*modules: torch.nn.Module | None) -> None:
    """Channels-last weights for the convolutions of ``modules`` held in bfloat16 on the CPU (the
    others are left as they are). There a contiguous (NCHW) bfloat16 convolution falls to a
    reference kernel about 30x slower than the channels-last one on a CPU without native bfloat16
    (AVX2): most of a bf16 test's time. Applied to both sides of a comparison, so each computes
    with the same kernels; on a GPU nothing changes."""
    for m in modules:
        p = next(m.parameters(), None) if m is not None else None
        if p is not None and p.dtype == torch.bfloat16 and p.device.type == "cpu":
            m.to(memory_format=torch.channels_last)


def sd_pipe(folder: Path | str, dtype: torch.dtype = torch.float32) -> StableDiffusionInpaintPipeline:
    pipe = StableDiffusionInpaintPipeline.from_pretrained(folder, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    cpu_bf16_convs(pipe.unet, pipe.vae)
    return pipe


def controlnet_call(folder: Path | str, nets: list[Path], controls: list[tuple[Any, ...]],
                    dtype: torch.dtype = torch.float32) -> tuple[Any, dict]:
    """``StableDiffusionControlNetInpaintPipeline`` over the model in ``folder`` with the ControlNets
    in ``nets`` (``MultiControlNetModel`` for several), and its call's control arguments for
    ``controls`` = ``(id, image, scale[, start, end])`` each."""
    base = sd_pipe(folder, dtype)
    models = [ControlNetModel.from_pretrained(n, dtype=dtype) for n in nets]
    cpu_bf16_convs(*models)
    pipe = StableDiffusionControlNetInpaintPipeline(
        vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=base.unet,
        controlnet=models if len(models) > 1 else models[0], scheduler=base.scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    full = [tuple(c) + (0.0, 1.0)[len(c) - 3:] if len(c) < 5 else tuple(c) for c in controls]
    one = len(full) == 1

    def arg(i: int) -> Any:
        return full[0][i] if one else [c[i] for c in full]

    return pipe, {"control_image": arg(1), "controlnet_conditioning_scale": arg(2),
                  "control_guidance_start": arg(3), "control_guidance_end": arg(4)}
