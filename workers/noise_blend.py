"""Initial noise of a mask-aware edit: its own where tokens are computed, the warm-up's elsewhere.

No longer the service's path: with refresh steps (``app/fidelity.py``) an edit keeps its own noise
everywhere and the offset correction accounts for it; blending the warm-up's noise in lowers
fidelity there (docs/bench/fidelity_causes.md). Kept as the ``cache-as-is`` option of the fidelity
benchmarks, the path it replaced. What follows is why it was introduced.

A masked edit takes the unmasked tokens' activations from its template's warm-up, which denoised
the template from the warm-up's own initial noise. If the edit started from different noise
outside the mask, its unmasked latents would follow one trajectory while the cached activations
(and hence the predicted noise there) belong to another, and the unmasked region decodes to
garbage (measured: 7.5 dB PSNR to the template instead of 17-19 dB on the trained default model).
So an edit whose seed differs from the warm-up's starts from the warm-up's initial latents at the
cached tokens and from its own seed's latents at the computed (masked) tokens: every token's
state is then consistent with where its activations come from. A job with the warm-up's seed is
unchanged (the blend is the identity), which keeps the exactness guarantee.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_mask(pixel_mask: torch.Tensor, patch: int) -> torch.Tensor:
    """Latent-token mask (True = computed) by OR-pooling the pixel mask over ``patch`` pixels,
    as the mask-aware controllers build their first-level token masks."""
    m = pixel_mask.to(torch.float32)[None, None]
    return F.max_pool2d(m, kernel_size=patch, stride=patch)[0, 0] > 0


def blend_sd(own: torch.Tensor, warm: torch.Tensor, pixel_mask: torch.Tensor, vae_scale: int) -> torch.Tensor:
    """``[1, C, h, w]`` latents: own noise at masked latent positions, the warm-up's elsewhere."""
    m = token_mask(pixel_mask, vae_scale).to(own.dtype)[None, None]
    if m.shape[-2:] != own.shape[-2:]:
        raise ValueError(f"mask {tuple(m.shape[-2:])} does not match latents {tuple(own.shape[-2:])}")
    return own * m + warm * (1 - m)


def blend_flux(own: torch.Tensor, warm: torch.Tensor, pixel_mask: torch.Tensor, vae_scale: int) -> torch.Tensor:
    """Packed ``[1, N, C]`` Flux latents (2x2 latent patches per token, raster order)."""
    m = token_mask(pixel_mask, vae_scale * 2).reshape(1, -1, 1).to(own.dtype)
    if m.shape[1] != own.shape[1]:
        raise ValueError(f"mask has {m.shape[1]} tokens, latents {own.shape[1]}")
    return own * m + warm * (1 - m)
