"""Packed-token masks for Flux: which of the transformer's image tokens an edit touches.

Flux packs its latent (8x VAE downscale) into 2x2 patches, so one image token covers a 16x16
pixel block, in row-major order (token ``i * (W // 16) + j``, matching ``FluxFillPipeline._pack_latents``
and ``_prepare_latent_image_ids``). A token is masked if ANY of its pixels (or latent pixels) is:
OR-pooling never drops an edited pixel, at the price of a coarser mask than the pixel ratio.
Optional dilation by whole tokens widens the recomputed region to hide seams.

Also here: realistic synthetic masks (blobs, rectangles) of an exact token count, for benchmarks
and tests -- raster-prefix masks hide indexing bugs and flatter attention locality (DESIGN 3.8).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FLUX_VAE_SCALE_FACTOR = 8
FLUX_PACK = 2


def _as_2d(mask: torch.Tensor) -> torch.Tensor:
    """Accept [H, W], [1, H, W] or [1, 1, H, W] (one mask); return [H, W]."""
    while mask.ndim > 2:
        if mask.shape[0] != 1:
            raise ValueError(f"expected a single mask, got shape {tuple(mask.shape)}")
        mask = mask[0]
    if mask.ndim != 2:
        raise ValueError(f"expected a 2-D mask, got shape {tuple(mask.shape)}")
    return mask


def _or_pool(mask2d: torch.Tensor, k: int) -> torch.Tensor:
    h, w = mask2d.shape
    if h % k or w % k:
        raise ValueError(f"mask {h}x{w} is not a multiple of the pooling size {k}")
    return F.max_pool2d(mask2d[None, None].float(), kernel_size=k, stride=k)[0, 0] > 0


def dilate_token_grid(grid: torch.Tensor, tokens: int) -> torch.Tensor:
    """Grow a [h, w] boolean token grid by ``tokens`` in every direction (square structuring element)."""
    if tokens <= 0:
        return grid
    k = 2 * tokens + 1
    return F.max_pool2d(grid[None, None].float(), kernel_size=k, stride=1, padding=tokens)[0, 0] > 0


def pixel_to_token_grid(mask: torch.Tensor, *, vae_scale_factor: int = FLUX_VAE_SCALE_FACTOR,
                        threshold: float = 0.5, dilate: int = 0) -> torch.Tensor:
    """Pixel mask (already at the job's H x W, values in [0, 1]) -> [H/16, W/16] boolean token grid.

    ``threshold`` matches ``VaeImageProcessor``'s binarization (>= 0.5 is masked), so the token mask
    covers exactly the pixels the Fill pipeline treats as masked.
    """
    m = _as_2d(mask).float() >= threshold
    latent = _or_pool(m, vae_scale_factor)
    return dilate_token_grid(_or_pool(latent, FLUX_PACK), dilate)


def pixel_to_token_mask(mask: torch.Tensor, *, vae_scale_factor: int = FLUX_VAE_SCALE_FACTOR,
                        threshold: float = 0.5, dilate: int = 0) -> torch.Tensor:
    """Pixel mask -> flat [(H/16)*(W/16)] boolean packed-token mask, in Flux's token order."""
    return pixel_to_token_grid(mask, vae_scale_factor=vae_scale_factor, threshold=threshold,
                               dilate=dilate).flatten()


def latent_to_token_mask(latent_mask: torch.Tensor, *, dilate: int = 0) -> torch.Tensor:
    """Latent-resolution mask [h, w] -> flat packed-token mask (2x2 OR-pool)."""
    grid = _or_pool(_as_2d(latent_mask) > 0, FLUX_PACK)
    return dilate_token_grid(grid, dilate).flatten()


def token_grid_to_pixels(grid: torch.Tensor, *, vae_scale_factor: int = FLUX_VAE_SCALE_FACTOR) -> torch.Tensor:
    """Inverse of the pooling for whole tokens: [h, w] grid -> [16h, 16w] float pixel mask."""
    k = vae_scale_factor * FLUX_PACK
    return grid.float().repeat_interleave(k, 0).repeat_interleave(k, 1)


def image_token_count(height: int, width: int, *, vae_scale_factor: int = FLUX_VAE_SCALE_FACTOR) -> int:
    """Number of packed image tokens for an H x W image (the pipeline floors to multiples of 16)."""
    k = vae_scale_factor * FLUX_PACK
    return (int(height) // k) * (int(width) // k)


def synthetic_token_grid(h: int, w: int, ratio: float, *, shape: str = "blob", seed: int = 0) -> torch.Tensor:
    """A realistic [h, w] token mask with exactly ``round(ratio*h*w)`` tokens set.

    ``blob``: an ellipse at a random centre whose radius is perturbed by a few low-frequency angular
    harmonics (irregular, connected-looking, like a face/hand/garment mask). ``rect``: an axis-aligned
    box of random aspect ratio. The k tokens with the smallest shape "distance" are taken, so the
    count is exact and the region grows outward from the centre.
    """
    n = h * w
    k = int(round(max(0.0, min(1.0, ratio)) * n))
    if k == 0:
        return torch.zeros(h, w, dtype=torch.bool)
    if k == n:
        return torch.ones(h, w, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: float(torch.rand((), generator=g))  # noqa: E731 - tiny local helper
    cy, cx = (0.25 + 0.5 * rnd()) * h, (0.25 + 0.5 * rnd()) * w
    aspect = math.exp((rnd() - 0.5) * 1.0)
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float64) + 0.5,
                            torch.arange(w, dtype=torch.float64) + 0.5, indexing="ij")
    dy, dx = (yy - cy) * aspect, (xx - cx) / aspect
    if shape == "rect":
        dist = torch.maximum(dy.abs(), dx.abs())
    elif shape == "blob":
        theta = torch.atan2(dy, dx)
        wobble = torch.ones_like(theta)
        for harmonic in (2, 3, 5):
            wobble = wobble + 0.18 * (rnd() + 0.3) * torch.cos(harmonic * theta + 6.283 * rnd())
        dist = torch.sqrt(dy**2 + dx**2) / wobble.clamp_min(0.3)
    else:
        raise ValueError(f"unknown mask shape {shape!r}")
    order = torch.argsort(dist.flatten() + 1e-9 * torch.arange(n, dtype=torch.float64), stable=True)
    flat = torch.zeros(n, dtype=torch.bool)
    flat[order[:k]] = True
    return flat.view(h, w)


def mask_ratio(token_mask: torch.Tensor) -> float:
    return float(token_mask.float().mean()) if token_mask.numel() else 0.0
