"""Benchmark-size models (random init, seeded, built from configs) and their masks and inputs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DConditionModel

from workers.maskaware.tokens import TokenMasks, blob_mask, rect_mask
from workers.maskaware.unet import MaskAwareUNet


def build_sd_unet(hidden: tuple[int, ...], latent: int, layers_per_block: int, transformer_layers: int,
                  cross_dim: int, seed: int) -> UNet2DConditionModel:
    """SD-architecture 9-channel inpainting UNet (cross-attention on all but the last level)."""
    torch.manual_seed(seed)
    n = len(hidden)
    return UNet2DConditionModel(
        sample_size=latent, in_channels=9, out_channels=4, layers_per_block=layers_per_block,
        block_out_channels=hidden,
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        transformer_layers_per_block=transformer_layers, cross_attention_dim=cross_dim,
        attention_head_dim=tuple(max(1, c // 64) for c in hidden),  # heads of 64 dims, as SD2
        norm_num_groups=32,
    ).eval()


def add_unet_shape_args(p: argparse.ArgumentParser) -> None:
    """The SD-architecture UNet's shape options, shared by the UNet benchmarks."""
    p.add_argument("--hidden", default="320,640")
    p.add_argument("--latent", type=int, default=64)
    p.add_argument("--layers-per-block", type=int, default=1)
    p.add_argument("--transformer-layers", type=int, default=1)
    p.add_argument("--cross-dim", type=int, default=768)
    p.add_argument("--text-len", type=int, default=77)


def unet_from_args(args: argparse.Namespace) -> UNet2DConditionModel:
    """The UNet of ``add_unet_shape_args``'s options (``args.hidden`` as a tuple)."""
    return build_sd_unet(args.hidden, args.latent, args.layers_per_block, args.transformer_layers, args.cross_dim,
                         args.seed)


def pixel_mask(size: int, ratio: float, shape: str, seed: int, width: int | None = None) -> torch.Tensor:
    """A ``size`` x ``size`` (or ``size`` x ``width``) mask of realistic shape (``blob`` or ``rect``)
    at pixel ratio ``ratio``."""
    width = size if width is None else width
    if ratio >= 1.0:
        return torch.ones(size, width, dtype=torch.bool)
    return (blob_mask if shape == "blob" else rect_mask)(size, width, ratio, seed)


def job_masks(ctrl: MaskAwareUNet, ratio: float, jobs: int, latent: int, vae_factor: int,
              seed: int) -> list[TokenMasks]:
    """Pixel masks of realistic shape (even jobs: blobs, odd jobs: rectangles) -> token masks."""
    return [ctrl.token_masks(pixel_mask(latent * vae_factor, ratio, ("blob", "rect")[k % 2], seed + k),
                             (latent, latent)) for k in range(jobs)]


def cfg_job(pixel: torch.Tensor, latent: int | tuple[int, int], steps: int, text: tuple[int, int], seed: int, *,
            guidance: float = 7.5, mode: str = "full",
            cache_key: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``prepare`` ships for one SD CFG job: random latents and text embeddings of real shapes
    (``text`` = tokens, width), the latent mask pooled from the pixel mask; ``latent``: a side or (h, w)."""
    g = torch.Generator().manual_seed(seed)
    lh, lw = (latent, latent) if isinstance(latent, int) else latent
    lat = torch.nn.functional.adaptive_max_pool2d(pixel.float()[None, None], (lh, lw))
    tensors = {"latents": torch.randn(1, 4, lh, lw, generator=g),
               "mask": lat.expand(2, 1, lh, lw).contiguous(),
               "masked_image_latents": torch.randn(2, 4, lh, lw, generator=g),
               "prompt_embeds": torch.randn(2, *text, generator=g),
               "generator_state": g.get_state(), "pixel_mask": pixel.to(torch.uint8)}
    meta = {"t_start": 0, "num_steps": steps, "do_cfg": True, "guidance": guidance, "cache_mode": mode}
    return tensors, meta if cache_key is None else dict(meta, cache_key=cache_key)


def ddim_config() -> dict[str, Any]:
    """The embedded SD model's scheduler config as a saved folder holds it (with its class name)."""
    from workers.models.tiny_sd import build_scheduler

    sched = build_scheduler()
    return dict(sched.config, _class_name=type(sched).__name__)


def build_flux(seed: int, *, double: int = 2, single: int = 4, heads: int = 4, head_dim: int = 128,
               joint_dim: int = 4096) -> torch.nn.Module:
    """A ``FluxTransformer2DModel`` with Flux's head dim and Fill channels (default: the benchmarks'
    2 double + 4 single blocks, inner dim 512, T5-size text embeddings)."""
    from workers.models.tiny_flux import build_flux_transformer

    return build_flux_transformer(seed, num_layers=double, num_single_layers=single, attention_head_dim=head_dim,
                                  num_attention_heads=heads, joint_attention_dim=joint_dim, pooled_projection_dim=768)


def flux_image_ids(side: int) -> torch.Tensor:
    """Flux's (0, row, column) position ids of a ``side`` x ``side`` token grid."""
    ids = torch.zeros(side, side, 3)
    ids[..., 1] += torch.arange(side)[:, None]
    ids[..., 2] += torch.arange(side)[None, :]
    return ids.reshape(side * side, 3)


def saved_sd_pipeline(workdir: Path, hidden: tuple[int, ...]) -> Path:
    """The end-to-end benchmark's SD pipeline folder (a UNet of ``hidden``), saved once per workdir."""
    from workers.models.tiny_sd import save_pipeline

    model_dir = Path(workdir) / f"model-{'-'.join(map(str, hidden))}"
    if not (model_dir / "model_index.json").is_file():
        save_pipeline(model_dir, unet_hidden=hidden, cross_dim=hidden[0])
    return model_dir
