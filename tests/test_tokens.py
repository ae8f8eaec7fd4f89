"""Token-mask pooling, dilation and ratio helpers; level sizes must match a real UNet's."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock

from workers.maskaware.tokens import (
    TokenMasks,
    blob_mask,
    build_token_masks,
    dilate,
    latent_mask,
    mask_ratio,
    pool_levels,
    rect_mask,
)
from workers.models.tiny_sd import build_unet


def test_latent_mask_is_or_over_cells() -> None:
    pix = torch.zeros(64, 64, dtype=torch.bool)
    pix[13, 21] = True  # one pixel -> exactly one latent cell (8x downscale)
    lat = latent_mask(pix, (8, 8))
    assert lat.dtype == torch.bool and lat.shape == (8, 8)
    assert lat.nonzero().tolist() == [[1, 2]]
    assert mask_ratio(lat) == pytest.approx(1 / 64)


def test_latent_mask_accepts_float_and_batched_shapes() -> None:
    pix = torch.zeros(1, 1, 32, 48)
    pix[..., 0:4, 40:48] = 1.0
    lat = latent_mask(pix, (4, 6))
    assert lat.sum() == 1 and bool(lat[0, 5])
    with pytest.raises(ValueError):
        latent_mask(torch.zeros(2, 3, 4), (2, 2))


def test_pool_levels_or_property_and_ceil_sizes() -> None:
    g = torch.Generator().manual_seed(0)
    lat = torch.rand(9, 14, generator=g) > 0.93
    levels = pool_levels(lat, 4)
    assert [tuple(x.shape) for x in levels] == [(9, 14), (5, 7), (3, 4), (2, 2)]
    for fine, coarse in zip(levels, levels[1:]):
        for y in range(coarse.shape[0]):
            for x in range(coarse.shape[1]):
                children = fine[2 * y:2 * y + 2, 2 * x:2 * x + 2]
                assert bool(coarse[y, x]) == bool(children.any())


def test_coarse_levels_have_larger_ratio() -> None:
    lat = blob_mask(32, 32, 0.1, seed=3)
    ratios = build_token_masks(lat, (32, 32), 4).ratios()
    assert ratios[0] == pytest.approx(0.1, abs=1e-3)
    assert all(b >= a for a, b in zip(ratios, ratios[1:]))


def test_dilation_by_k_tokens_per_level() -> None:
    m = torch.zeros(7, 7, dtype=torch.bool)
    m[3, 3] = True
    assert dilate(m, 0) is m
    assert dilate(m, 1).sum() == 9 and dilate(m, 2).sum() == 25
    corner = torch.zeros(5, 5, dtype=torch.bool)
    corner[0, 0] = True
    assert dilate(corner, 1).sum() == 4  # clipped at the border
    tm = build_token_masks(m, (7, 7), 2, dilation=1)
    assert tm.levels[0].sum() == 9
    assert tm.levels[1].shape == (4, 4) and tm.levels[1].sum() == 9  # pooled single -> 1, dilated -> 9


def test_token_masks_indices_and_round_trip() -> None:
    lat = rect_mask(16, 16, 0.2, seed=1)
    tm = build_token_masks(lat, (16, 16), 3)
    idx = tm.indices(256)
    assert idx.tolist() == lat.reshape(-1).nonzero().reshape(-1).tolist()
    assert tm.count(64) == int(tm.levels[1].sum()) and tm.level_for_tokens(16) == 2
    with pytest.raises(ValueError, match="no token-mask level"):
        tm.indices(100)
    back = TokenMasks.from_tensors(tm.as_tensors())
    assert all(torch.equal(a, b) for a, b in zip(back.levels, tm.levels))


@pytest.mark.parametrize("ratio", [0.03, 0.2, 0.5])
def test_synthetic_masks_hit_ratio_and_are_not_raster_prefixes(ratio: float) -> None:
    for seed in range(3):
        b = blob_mask(64, 64, ratio, seed=seed)
        assert mask_ratio(b) == pytest.approx(ratio, abs=1e-3)
        assert not b[0].all()  # not a raster prefix
        r = rect_mask(64, 64, ratio, seed=seed)
        assert mask_ratio(r) == pytest.approx(ratio, rel=0.15)
    assert blob_mask(8, 8, 0.0).sum() == 0 and blob_mask(8, 8, 1.0).all()


@pytest.mark.parametrize("latent_hw", [(16, 16), (12, 20), (10, 14)])
def test_levels_match_real_unet_token_counts(latent_hw: tuple[int, int]) -> None:
    """Every transformer block's token count must be one of the pooled levels (no hard-coding)."""
    unet = build_unet(0, hidden=(32, 64, 64)).eval()
    seen: set[int] = set()
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.add(args[0].shape[1]))
             for m in unet.modules() if isinstance(m, BasicTransformerBlock)]
    with torch.no_grad():
        unet(torch.randn(1, 9, *latent_hw), torch.tensor([10]), torch.randn(1, 4, 32))
    for h in hooks:
        h.remove()
    tm = build_token_masks(torch.ones(*latent_hw), latent_hw, len(unet.config.down_block_types))
    assert len(seen) >= 2
    for n in seen:
        tm.level_for_tokens(n)
