"""A small SDXL inpainting pipeline of the real diffusers classes, built offline from configs.

Same classes and wiring as ``diffusers/stable-diffusion-xl-1.0-inpainting-0.1``: a 9-channel
``UNet2DConditionModel`` with SDXL's added conditioning (``addition_embed_type="text_time"``:
pooled text embeddings of the second text encoder plus six micro-conditioning time ids, each
embedded with ``addition_time_embed_dim`` sinusoids), linear projections in its transformers and
several transformer layers per block (module paths with inner depth), two text encoders
(``CLIPTextModel`` + ``CLIPTextModelWithProjection``, hidden states concatenated as the
cross-attention context), an ``AutoencoderKL`` with SDXL's ``scaling_factor`` and
``force_upcast``, and SDXL's ``EulerDiscreteScheduler`` config. Widths are tiny and weights
random (its outputs are noise): for exactness tests and speed checks, not for pictures.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLInpaintPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from workers.models.tiny_sd import SD_BETAS, build_text_encoder, build_vae, byte_level_clip_tokenizer

log = logging.getLogger(__name__)

# SDXL's micro-conditioning: (original h, w, crop top, left, target h, w), or with
# requires_aesthetics_score (the refiner layout) (original h, w, crop top, left, aesthetic score).
TIME_IDS = 6
TIME_IDS_AESTHETIC = 5
TEXT_HIDDEN = 32  # each text encoder's width: the UNet's context is both concatenated (64)
ADD_TIME_DIM = 8


def build_sdxl_unet(seed: int = 0, *, hidden: tuple[int, ...] = (32, 64), layers: tuple[int, ...] = (1, 2),
                    time_ids: int = TIME_IDS) -> UNet2DConditionModel:
    """SDXL's UNet layout at tiny width: no attention at the finest level, ``layers`` transformer
    layers per block below it, heads given as ``attention_head_dim`` as SDXL's config does."""
    torch.manual_seed(seed)
    n = len(hidden)
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=9,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=hidden,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
        transformer_layers_per_block=layers,
        attention_head_dim=tuple(max(1, h // 16) for h in hidden),
        cross_attention_dim=2 * TEXT_HIDDEN,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=ADD_TIME_DIM,
        projection_class_embeddings_input_dim=ADD_TIME_DIM * time_ids + TEXT_HIDDEN,
        norm_num_groups=min(32, hidden[0]),
    )


def build_text_encoder_2(seed: int = 0, vocab_size: int = 514) -> CLIPTextModelWithProjection:
    torch.manual_seed(seed + 1)
    config = CLIPTextConfig(
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
        hidden_size=TEXT_HIDDEN, intermediate_size=TEXT_HIDDEN * 2, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=vocab_size, max_position_embeddings=77, projection_dim=TEXT_HIDDEN, hidden_act="gelu",
    )
    return CLIPTextModelWithProjection(config)


def build_sdxl_scheduler() -> EulerDiscreteScheduler:
    """SDXL's scheduler config (Euler, leading spacing, SD betas)."""
    return EulerDiscreteScheduler(**SD_BETAS, steps_offset=1, timestep_spacing="leading",
                                  prediction_type="epsilon", interpolation_type="linear", use_karras_sigmas=False)


def build_sdxl_pipeline(seed: int = 0, *, requires_aesthetics_score: bool = False) -> StableDiffusionXLInpaintPipeline:
    """The tiny SDXL inpainting pipeline, deterministic for a given seed."""
    tokenizer = byte_level_clip_tokenizer()
    vae = build_vae(seed)
    vae.register_to_config(scaling_factor=0.13025, force_upcast=True)  # SDXL's VAE config
    pipe = StableDiffusionXLInpaintPipeline(
        vae=vae,
        text_encoder=build_text_encoder(seed, hidden=TEXT_HIDDEN, vocab_size=len(tokenizer)),
        text_encoder_2=build_text_encoder_2(seed, vocab_size=len(tokenizer)),
        tokenizer=tokenizer,
        tokenizer_2=byte_level_clip_tokenizer(),
        unet=build_sdxl_unet(seed, time_ids=TIME_IDS_AESTHETIC if requires_aesthetics_score else TIME_IDS),
        scheduler=build_sdxl_scheduler(),
        requires_aesthetics_score=requires_aesthetics_score,
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_sdxl_pipeline(out_dir: str | Path, seed: int = 0, **options: object) -> Path:
    """Write the tiny SDXL inpainting pipeline as a diffusers folder (safetensors)."""
    out = Path(out_dir)
    build_sdxl_pipeline(seed, **options).save_pretrained(out, safe_serialization=True)  # type: ignore[arg-type]
    log.info("saved tiny SDXL inpainting model to %s", out)
    return out
