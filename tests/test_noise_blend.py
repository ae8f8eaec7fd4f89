"""Initial-noise blend of mask-aware edits (workers/noise_blend.py)."""

from __future__ import annotations

import pytest
import torch

from workers.noise_blend import blend_flux, blend_sd, token_mask


def test_token_mask_or_pools_each_patch() -> None:
    pixel = torch.zeros(16, 16, dtype=torch.uint8)
    pixel[9, 2] = 1  # one pixel in latent cell (1, 0) of an 8x downscale
    m = token_mask(pixel, 8)
    assert m.shape == (2, 2) and m.tolist() == [[False, False], [True, False]]


def test_blend_sd_takes_own_noise_only_at_computed_tokens() -> None:
    own, warm = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 4)
    pixel = torch.zeros(32, 32, dtype=torch.uint8)
    pixel[0:8, 8:16] = 1  # latent cell (0, 1)
    out = blend_sd(own, warm, pixel, 8)
    assert torch.equal(out[..., 0, 1], own[..., 0, 1])
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[0, 1] = False
    assert torch.equal(out[..., keep], warm[..., keep])
    assert torch.equal(blend_sd(own, warm, torch.ones(32, 32, dtype=torch.uint8), 8), own)
    with pytest.raises(ValueError):
        blend_sd(own, warm, torch.zeros(64, 64, dtype=torch.uint8), 8)


def test_blend_flux_uses_packed_raster_order() -> None:
    own, warm = torch.randn(1, 4, 64), torch.randn(1, 4, 64)  # 2x2 tokens of 16x16 pixels
    pixel = torch.zeros(32, 32, dtype=torch.uint8)
    pixel[20, 3] = 1  # token row 1, col 0 -> index 2
    out = blend_flux(own, warm, pixel, 8)
    assert torch.equal(out[0, 2], own[0, 2])
    for i in (0, 1, 3):
        assert torch.equal(out[0, i], warm[0, i])
