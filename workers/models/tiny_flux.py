"""A small Flux Fill pipeline of the real diffusers classes, built offline from configs.

Flux weights cannot be downloaded here, so tests and benchmarks build the real classes with a fixed
seed: a ``FluxTransformer2DModel`` with Flux Fill's channel layout (``in_channels=384`` = 64 packed
latent + 64 packed masked-image + 256 packed mask channels, ``out_channels=64``), a 16-channel
``AutoencoderKL`` without quant convs (like Flux's VAE), tiny ``CLIPTextModel`` and
``T5EncoderModel`` text encoders with locally built tokenizers, and a
``FlowMatchEulerDiscreteScheduler`` with Flux's dynamic shifting. ``save_flux_fill_pipeline``
writes a standard diffusers folder that ``FluxFillPipeline.from_pretrained`` loads offline.
"""

from __future__ import annotations

import logging
import string
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxFillPipeline,
    FluxTransformer2DModel,
)
from transformers import (
    CLIPTextModel,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from workers.models.tiny_sd import build_text_encoder, byte_level_clip_tokenizer

log = logging.getLogger(__name__)

# Flux Fill's channel layout: 16 latent channels packed 2x2 -> 64; the mask is the pixel mask
# unshuffled 8x8 (64) and packed 2x2 -> 256.
FLUX_LATENT_CHANNELS = 16
FLUX_PACKED_CHANNELS = FLUX_LATENT_CHANNELS * 4
FLUX_FILL_IN_CHANNELS = FLUX_PACKED_CHANNELS * 2 + 256

# Flux.1's scheduler config (dynamic shifting by image sequence length).
FLUX_SCHEDULER_CONFIG: dict[str, object] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def build_flux_transformer(
    seed: int = 0,
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    attention_head_dim: int = 16,
    num_attention_heads: int = 2,
    joint_attention_dim: int = 32,
    pooled_projection_dim: int = 32,
    axes_dims_rope: tuple[int, int, int] | None = None,
    in_channels: int = FLUX_FILL_IN_CHANNELS,
    out_channels: int = FLUX_PACKED_CHANNELS,
    guidance_embeds: bool = True,
) -> FluxTransformer2DModel:
    """A Flux Fill transformer of the real class; ``axes_dims_rope`` defaults to Flux's 1:3.5:3.5 split."""
    if axes_dims_rope is None:
        axes_dims_rope = _default_rope_axes(attention_head_dim)
    if sum(axes_dims_rope) != attention_head_dim:
        raise ValueError(f"rope axes {axes_dims_rope} must sum to the head dim {attention_head_dim}")
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        out_channels=out_channels,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=joint_attention_dim,
        pooled_projection_dim=pooled_projection_dim,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=tuple(axes_dims_rope),
    )
    return model.eval()


def _default_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Split ``head_dim`` like Flux (16, 56, 56) of 128: even sizes, the two spatial axes equal."""
    if head_dim % 4:
        raise ValueError(f"head dim {head_dim} must be a multiple of 4 for 3-axis RoPE")
    first = max(2, (head_dim // 8) // 2 * 2)
    rest = head_dim - first
    if rest % 4:
        first += 2
        rest -= 2
    return first, rest // 2, rest // 2


def build_flux_vae(seed: int = 0, block_out_channels: tuple[int, ...] = (16, 16, 32, 32)) -> AutoencoderKL:
    """Four-level VAE (8x downscale), 16 latent channels, no quant convs, Flux's scale/shift."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=block_out_channels,
        latent_channels=FLUX_LATENT_CHANNELS,
        norm_num_groups=16,
        layers_per_block=1,
        sample_size=128,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def build_clip_text_encoder(seed: int = 0, hidden: int = 32, vocab_size: int = 514) -> CLIPTextModel:
    """Tiny CLIP text tower (the SD one); Flux uses only its pooled output."""
    return build_text_encoder(seed, hidden=hidden, vocab_size=vocab_size).eval()


def unigram_t5_tokenizer() -> T5TokenizerFast:
    """A T5 unigram tokenizer over printable ASCII pieces (with and without the word-start marker)."""
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    pieces = [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5TokenizerFast(vocab=specials + pieces, extra_ids=0)


def build_t5_encoder(seed: int = 0, d_model: int = 32, vocab_size: int = 256) -> T5EncoderModel:
    """Tiny T5 encoder; its hidden size is the transformer's ``joint_attention_dim``."""
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=d_model * 2,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def build_flow_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG)


def build_flux_fill_pipeline(seed: int = 0) -> FluxFillPipeline:
    """The tiny Flux Fill pipeline, deterministic for a given seed."""
    tokenizer = byte_level_clip_tokenizer()
    tokenizer_2 = unigram_t5_tokenizer()
    pipe = FluxFillPipeline(
        scheduler=build_flow_scheduler(),
        vae=build_flux_vae(seed),
        text_encoder=build_clip_text_encoder(seed, hidden=32, vocab_size=len(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=build_t5_encoder(seed, d_model=32, vocab_size=len(tokenizer_2)),
        tokenizer_2=tokenizer_2,
        transformer=build_flux_transformer(seed, joint_attention_dim=32, pooled_projection_dim=32),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_flux_fill_pipeline(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Flux Fill pipeline as a diffusers folder (safetensors weights)."""
    out = Path(out_dir)
    build_flux_fill_pipeline(seed).save_pretrained(out, safe_serialization=True)
    log.info("saved tiny Flux Fill pipeline to %s", out)
    return out
