"""Coarse-level token pooling (workers/maskaware/tokens.py): OR at threshold 0, by coverage above it
(the service's default is the measured one); shapes follow the OR rule's, level 0 never changes, no
reached level is empty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.maskaware.tokens import POOL_THRESHOLD, blob_mask, build_token_masks


def _shares(levels: list[torch.Tensor]) -> list[float]:
    return [float(lv.float().mean()) for lv in levels]


FIDELITY = Path(__file__).resolve().parents[1] / "docs/bench/fidelity_pooling_sdxl_layout.json"
BUDGET = 0.005  # SSIM loss against OR-pooling, whole image and in the mask (issue 19's compression budget)


def _losses_by_threshold() -> dict[float, float]:
    """Worst SSIM loss (whole image or in the mask, any option and trace) of each measured threshold."""
    rows = json.loads(FIDELITY.read_text())["summary"]
    base = {(r["option"], r["trace"]): r for r in rows if "+pool" not in r["option"]}
    worst: dict[float, float] = {}
    for r in rows:
        if "+pool" not in r["option"]:
            continue
        option, threshold = r["option"].split("+pool")
        ref = base[(option, r["trace"])]
        loss = max(ref["ssim"] - r["ssim"], ref["ssim_masked"] - r["ssim_masked"])
        worst[float(threshold)] = max(worst.get(float(threshold), 0.0), loss)
    return worst


def test_default_threshold_is_the_largest_measured_within_the_fidelity_budget() -> None:
    default = POOL_THRESHOLD
    worst = _losses_by_threshold()
    assert {0.25, 0.5} <= set(worst), worst
    assert worst[default] <= BUDGET, (default, worst)
    assert all(loss > BUDGET for t, loss in worst.items() if t > default), worst


def test_threshold_zero_is_or_pooling() -> None:
    m = blob_mask(256, 256, 0.2, seed=3)
    default = build_token_masks(m, (32, 32), 4)
    explicit = build_token_masks(m, (32, 32), 4, pool_threshold=0.0)
    assert all(torch.equal(a, b) for a, b in zip(default.levels, explicit.levels))
    shares = _shares(default.levels)
    assert shares == sorted(shares) and shares[-1] > 1.5 * shares[0]  # OR inflates coarse levels


@pytest.mark.parametrize("hw", [(32, 32), (13, 8), (7, 12)])
def test_coverage_pooling_keeps_level_shapes_and_level_zero(hw: tuple[int, int]) -> None:
    m = blob_mask(hw[0] * 8, hw[1] * 8, 0.2, seed=1)
    orp = build_token_masks(m, hw, 4)
    cov = build_token_masks(m, hw, 4, pool_threshold=0.5)
    assert [lv.shape for lv in cov.levels] == [lv.shape for lv in orp.levels]
    assert torch.equal(cov.levels[0], orp.levels[0])
    for a, b in zip(cov.levels[1:], orp.levels[1:]):
        assert not (a & ~b).any()  # coverage pooling only drops tokens the OR rule would compute


def test_coverage_pooling_tracks_the_pixel_ratio_at_coarse_levels() -> None:
    m = blob_mask(1024, 1024, 0.2, seed=0)
    shares = _shares(build_token_masks(m, (128, 128), 4, pool_threshold=0.5).levels)
    assert all(abs(s - 0.2) < 0.03 for s in shares[1:])
    assert _shares(build_token_masks(m, (128, 128), 4).levels)[2] > 0.4  # OR at SDXL's 32x32 level


def test_a_small_mask_still_has_fresh_tokens_at_every_level() -> None:
    m = torch.zeros(128, 128, dtype=torch.bool)
    m[60:62, 60:62] = True  # 4 pixels: well under half of any coarse token
    levels = build_token_masks(m, (16, 16), 4, pool_threshold=0.5).levels
    assert all(int(lv.sum()) >= 1 for lv in levels)
    empty = build_token_masks(torch.zeros(128, 128, dtype=torch.bool), (16, 16), 4, pool_threshold=0.5).levels
    assert all(int(lv.sum()) == 0 for lv in empty)


def test_threshold_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="pool threshold"):
        build_token_masks(torch.ones(16, 16, dtype=torch.bool), (16, 16), 2, pool_threshold=1.5)
