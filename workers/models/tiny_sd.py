"""The embedded default model: a small SD-style inpainting pipeline of the real diffusers classes.

Weights cannot be downloaded here, so the default is built from configs with a fixed seed: a
9-channel ``UNet2DConditionModel`` with cross-attention blocks, an ``AutoencoderKL`` with four
levels (downscale 8, like real SD), a two-layer ``CLIPTextModel`` and a byte-level
``CLIPTokenizer`` built locally. ``save_pipeline`` writes it as a standard diffusers folder that
``StableDiffusionInpaintPipeline.from_pretrained`` (and every Stencil process) loads.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    StableDiffusionInpaintPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

log = logging.getLogger(__name__)

SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable-unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def byte_level_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP BPE tokenizer over the 256 byte-level symbols and no merges (no download)."""
    symbols = list(_bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


# Where the transformers sit, per resolution level (finest first).
# sd: SD 1.5's layout, attention at every level but the coarsest (plus the mid block);
# sdxl: SDXL's, no attention at the finest level and the deepest transformers at the coarsest
# (there every token pools 4x4 latent pixels, as at SDXL's 32x32 level of a 1024 px image).
LAYOUTS = ("sd", "sdxl")


def build_unet(seed: int = 0, *, hidden: tuple[int, ...] = (32, 64), cross_dim: int = 32,
               sample_size: int = 16, layers_per_block: int = 1, layout: str = "sd",
               transformer_layers: tuple[int, ...] | None = None) -> UNet2DConditionModel:
    """A 9-channel inpainting UNet (4 latent + 1 mask + 4 masked-image channels)."""
    torch.manual_seed(seed)
    n = len(hidden)
    if layout == "sd":
        attn = [True] * (n - 1) + [False]
    elif layout == "sdxl":
        attn = [False] + [True] * (n - 1)
    else:
        raise ValueError(f"unknown UNet layout {layout!r}; known: {LAYOUTS}")
    depth: dict = {}
    if transformer_layers is not None:
        if len(transformer_layers) != n:
            raise ValueError(f"transformer_layers needs one depth per level ({n}), got {transformer_layers}")
        depth = {"transformer_layers_per_block": tuple(transformer_layers)}
    return UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=9,
        out_channels=4,
        layers_per_block=layers_per_block,
        block_out_channels=hidden,
        down_block_types=tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attn),
        up_block_types=tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attn)),
        cross_attention_dim=cross_dim,
        attention_head_dim=8,
        norm_num_groups=min(32, hidden[0]),
        **depth,
    )


def build_vae(seed: int = 0, *, block_out_channels: tuple[int, ...] = (16, 16, 32, 32)) -> AutoencoderKL:
    """Four-level VAE: 8x spatial downscale, 4 latent channels, as SD's (wider for the trained model)."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=block_out_channels,
        latent_channels=4,
        norm_num_groups=16,
        layers_per_block=1,
        sample_size=128,
    )


def build_text_encoder(seed: int = 0, hidden: int = 32, vocab_size: int = 514) -> CLIPTextModel:
    torch.manual_seed(seed)
    config = CLIPTextConfig(
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        max_position_embeddings=77,
        projection_dim=hidden,
    )
    return CLIPTextModel(config)


def build_scheduler() -> DDIMScheduler:
    return DDIMScheduler(
        **SD_BETAS,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
    )


def build_pipeline(seed: int = 0, *, unet_hidden: tuple[int, ...] = (32, 64), cross_dim: int = 32,
                   layers_per_block: int = 1) -> StableDiffusionInpaintPipeline:
    """The embedded default pipeline, deterministic for a given seed (wider UNets for benchmarks)."""
    tokenizer = byte_level_clip_tokenizer()
    pipe = StableDiffusionInpaintPipeline(
        vae=build_vae(seed),
        text_encoder=build_text_encoder(seed, hidden=cross_dim, vocab_size=len(tokenizer)),
        tokenizer=tokenizer,
        unet=build_unet(seed, hidden=unet_hidden, cross_dim=cross_dim, layers_per_block=layers_per_block),
        scheduler=build_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_pipeline(out_dir: str | Path, seed: int = 0, **shape: object) -> Path:
    """Write the embedded default (or a wider variant) as a diffusers folder (safetensors)."""
    out = Path(out_dir)
    build_pipeline(seed, **shape).save_pretrained(out, safe_serialization=True)  # type: ignore[arg-type]
    log.info("saved embedded model to %s", out)
    return out
