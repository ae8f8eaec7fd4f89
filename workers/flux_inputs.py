"""Everything a Flux Fill job needs before denoising, computed exactly as the stock pipeline.

Mirrors ``FluxFillPipeline.__call__`` up to its denoising loop by calling the pipeline's own
methods (encode_prompt, prepare_latents, prepare_mask_latents, the processors) in the same order
with ``torch.Generator("cpu").manual_seed(seed)``. The scheduler's sigmas and shift ``mu`` travel
with the job so the engine rebuilds the identical timestep schedule.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxFillPipeline
from diffusers.pipelines.flux.pipeline_flux_fill import calculate_shift
from PIL import Image

from app.jobs import JobParams
from workers.models.loader import make_scheduler, stage_device
from workers.sd_inputs import PreparedJob


def flux_schedule(scheduler_config: dict, steps: int, height: int, width: int, vae_scale_factor: int,
                  strength: float):  # type: ignore[no-untyped-def]
    """(scheduler, timesteps, t_start, sigmas, mu) as the pipeline derives them."""
    scheduler = make_scheduler(scheduler_config)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    seq_len = (int(height) // vae_scale_factor // 2) * (int(width) // vae_scale_factor // 2)
    cfg = scheduler.config
    mu = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    scheduler.set_timesteps(sigmas=sigmas, mu=mu, device="cpu")
    init_timestep = min(steps * strength, steps)
    t_start = int(max(steps - init_timestep, 0))
    timesteps = scheduler.timesteps[t_start * scheduler.order:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(t_start * scheduler.order)
    return scheduler, timesteps, t_start, sigmas, mu


@torch.no_grad()
def prepare_flux_job_tensors(pipe: FluxFillPipeline, scheduler_config: dict, image: Image.Image,
                             mask: Image.Image, params: JobParams, height: int, width: int) -> PreparedJob:
    device = stage_device(pipe)  # STENCIL_STAGE_DEVICE; the seeded generator stays on the CPU
    generator = torch.Generator("cpu").manual_seed(params.seed)
    init_image = pipe.image_processor.preprocess(image, height=height, width=width).to(torch.float32)
    prompt_embeds, pooled, text_ids = pipe.encode_prompt(prompt=params.prompt, prompt_2=None, device=device,
                                                         num_images_per_prompt=1)
    scheduler, timesteps, t_start, _sigmas, _mu = flux_schedule(
        scheduler_config, params.steps, height, width, pipe.vae_scale_factor, params.strength)
    if len(timesteps) < 1:
        raise ValueError(f"strength {params.strength} with {params.steps} steps leaves no denoising step")
    pipe.scheduler = scheduler  # prepare_latents reads pipe.scheduler (scale_noise)
    latents, image_ids = pipe.prepare_latents(init_image, timesteps[:1].repeat(1), 1, pipe.vae.config.latent_channels,
                                              height, width, prompt_embeds.dtype, device, generator)
    mask_image = pipe.mask_processor.preprocess(mask, height=height, width=width)
    masked_image = (init_image * (1 - mask_image)).to(dtype=prompt_embeds.dtype)
    h, w = init_image.shape[-2:]
    mask_latents, masked_image_latents = pipe.prepare_mask_latents(
        mask_image, masked_image, 1, pipe.vae.config.latent_channels, 1, h, w, prompt_embeds.dtype, device, generator)
    tensors = {
        "latents": latents,
        "masked_image_latents": torch.cat((masked_image_latents, mask_latents), dim=-1),
        "prompt_embeds": prompt_embeds,
        "pooled_prompt_embeds": pooled,
        "text_ids": text_ids,
        "image_ids": image_ids,
        "generator_state": generator.get_state(),
        "pixel_mask": (mask_image[0, 0] >= 0.5).to(torch.uint8),
    }
    meta = {"family": "flux", "t_start": t_start, "num_steps": len(timesteps), "guidance": params.guidance,
            "height": height, "width": width, "do_cfg": False}
    ratio = float((mask_image >= 0.5).float().mean())
    return PreparedJob(tensors=tensors, meta=meta, mask_ratio=ratio, processed_image=init_image)


@torch.no_grad()
def decode_flux_latents(pipe: FluxFillPipeline, latents: torch.Tensor, height: int, width: int) -> Image.Image:
    latents = pipe._unpack_latents(latents.to(stage_device(pipe), pipe.vae.dtype), height, width,
                                   pipe.vae_scale_factor)
    latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pil")[0]
