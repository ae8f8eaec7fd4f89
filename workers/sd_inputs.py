"""Everything an SD or SDXL inpainting job needs before denoising, computed exactly as the stock pipeline.

``prepare_job_tensors`` mirrors steps 3-8 of ``StableDiffusionInpaintPipeline.__call__`` (and of
``StableDiffusionXLInpaintPipeline.__call__`` up to its step 10, the added time ids) by calling
the pipeline's own methods (encode_prompt, prepare_latents, prepare_mask_latents, the image and
mask processors) in the same order with the same ``torch.Generator("cpu").manual_seed(seed)``, so
that a job denoised by the engine reproduces the stock pipeline. The generator's state after these
draws travels with the job, so stochastic schedulers continue the same random stream.

Every tensor comes out in the pipeline's dtype (``STENCIL_DTYPE``), as the stock pipeline loaded
with that ``torch_dtype`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline
from PIL import Image

from app.jobs import JobParams
from workers.models.loader import make_scheduler, stage_device


@dataclass
class PreparedJob:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, object]
    mask_ratio: float
    processed_image: torch.Tensor  # [-1, 1], 1x3xHxW; returned as is for an empty mask


@torch.no_grad()
def prepare_job_tensors(pipe: StableDiffusionInpaintPipeline, scheduler_config: dict,
                        image: Image.Image, mask: Image.Image, params: JobParams,
                        height: int, width: int) -> PreparedJob:
    # The stage modules' device (STENCIL_STAGE_DEVICE); the seeded generator stays on the CPU (the
    # pipeline draws there and moves the noise), so the random stream is the stock pipeline's.
    device = stage_device(pipe)
    generator = torch.Generator("cpu").manual_seed(params.seed)
    do_cfg = params.guidance > 1.0

    added: dict[str, torch.Tensor] = {}
    if isinstance(pipe, StableDiffusionXLInpaintPipeline):
        prompt_embeds, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
            prompt=params.prompt, device=device, num_images_per_prompt=1, do_classifier_free_guidance=do_cfg,
            negative_prompt=params.negative_prompt or None)
        time_ids, negative_time_ids = sdxl_time_ids(pipe, height, width, prompt_embeds.dtype)
        if do_cfg:
            pooled = torch.cat([negative_pooled, pooled])
            time_ids = torch.cat([negative_time_ids, time_ids])
        added = {"add_text_embeds": pooled, "add_time_ids": time_ids}
    else:
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            params.prompt, device, 1, do_cfg, params.negative_prompt or None)
    if do_cfg:
        prompt_embeds = torch.cat([negative_embeds, prompt_embeds])

    scheduler = make_scheduler(scheduler_config)
    scheduler.set_timesteps(params.steps, device="cpu")
    init_timestep = min(int(params.steps * params.strength), params.steps)
    t_start = max(params.steps - init_timestep, 0)
    timesteps = scheduler.timesteps[t_start * scheduler.order:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(t_start * scheduler.order)
    if len(timesteps) < 1:
        raise ValueError(f"strength {params.strength} with {params.steps} steps leaves no denoising step")
    latent_timestep = timesteps[:1].repeat(1)
    is_strength_max = params.strength == 1.0

    init_image = pipe.image_processor.preprocess(image, height=height, width=width).to(torch.float32)
    # prepare_latents reads pipe.scheduler (init_noise_sigma, add_noise): give it this job's.
    pipe.scheduler = scheduler
    latents, _noise = pipe.prepare_latents(
        1, pipe.vae.config.latent_channels, height, width, prompt_embeds.dtype, device, generator,
        None, image=init_image, timestep=latent_timestep, is_strength_max=is_strength_max,
        return_noise=True, return_image_latents=False)

    mask_condition = pipe.mask_processor.preprocess(mask, height=height, width=width)
    masked_image = init_image * (mask_condition < 0.5)
    mask_latents, masked_image_latents = pipe.prepare_mask_latents(
        mask_condition, masked_image, 1, height, width, prompt_embeds.dtype, device, generator, do_cfg)

    tensors = {
        "latents": latents,
        "mask": mask_latents,
        "masked_image_latents": masked_image_latents,
        "prompt_embeds": prompt_embeds,
        "generator_state": generator.get_state(),
        "pixel_mask": (mask_condition[0, 0] >= 0.5).to(torch.uint8),
        **added,
    }
    meta = {
        "t_start": t_start,
        "num_steps": len(timesteps),
        "do_cfg": do_cfg,
        "guidance": params.guidance,
        "height": height,
        "width": width,
    }
    ratio = float((mask_condition >= 0.5).float().mean())
    return PreparedJob(tensors=tensors, meta=meta, mask_ratio=ratio, processed_image=init_image)


def sdxl_time_ids(pipe: StableDiffusionXLInpaintPipeline, height: int, width: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(time ids, negative time ids) as ``StableDiffusionXLInpaintPipeline._get_add_time_ids`` builds
    them for a call with the defaults: original and target size = the processed size, crop (0, 0),
    and with ``requires_aesthetics_score`` the aesthetic scores 6.0 / 2.5 instead of the target size.
    (The pipeline's own method reads the UNet, which CPU tasks do not load; the GPU runner checks
    the widths against the UNet.)"""
    size, crop = (height, width), (0, 0)
    if pipe.config.requires_aesthetics_score:
        ids, neg = list(size + crop + (6.0,)), list(size + crop + (2.5,))
    else:
        ids, neg = list(size + crop + size), list(size + crop + size)
    return torch.tensor([ids], dtype=dtype), torch.tensor([neg], dtype=dtype)


@torch.no_grad()
def decode_latents(pipe: StableDiffusionInpaintPipeline | StableDiffusionXLInpaintPipeline,
                   latents: torch.Tensor) -> Image.Image:
    """VAE decode + postprocess, as the stock pipeline's tail (no safety checker, no watermark).
    SDXL: a float16 VAE whose config says ``force_upcast`` decodes in float32, and latents are
    denormalized with the VAE's ``latents_mean``/``latents_std`` if it has them, as its pipeline does."""
    vae = pipe.vae
    latents = latents.to(stage_device(pipe), vae.dtype)
    if not isinstance(pipe, StableDiffusionXLInpaintPipeline):
        image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil", do_denormalize=[True])[0]
    upcast = vae.dtype == torch.float16 and vae.config.force_upcast
    if upcast:
        vae.to(torch.float32)
        latents = latents.to(torch.float32)
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    try:
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
    finally:
        if upcast:
            vae.to(torch.float16)
    return pipe.image_processor.postprocess(image, output_type="pil")[0]


def image_from_processed(pipe: StableDiffusionInpaintPipeline, processed: torch.Tensor) -> Image.Image:
    """The processed template as a PIL image (the result of an empty-mask edit)."""
    return pipe.image_processor.postprocess(processed, output_type="pil", do_denormalize=[True])[0]
