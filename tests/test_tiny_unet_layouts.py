"""The tiny UNet builder's transformer layouts: SD's (attention at every level but the coarsest) and
SDXL's (none at the finest level, the deepest at the coarsest), which the trained
``tiny-sd-sdxl-layout-trained`` uses to measure coarse-level mask pooling."""

from __future__ import annotations

import pytest
from diffusers import UNet2DConditionModel

from workers.models.loader import TRAINED_DIR
from workers.models.tiny_sd import build_unet


def _depths(unet: UNet2DConditionModel) -> list[int]:
    """Transformer blocks per down level (0 where the level has no attention)."""
    out = []
    for block in unet.down_blocks:
        attns = getattr(block, "attentions", None)
        out.append(len(attns[0].transformer_blocks) if attns else 0)
    return out


def test_sd_layout_is_the_default() -> None:
    unet = build_unet(0, hidden=(32, 64, 64))
    assert unet.config.down_block_types == ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
    assert unet.config.up_block_types == ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    assert _depths(unet) == [1, 1, 0]


def test_sdxl_layout_has_no_attention_at_the_finest_level_and_the_deepest_at_the_coarsest() -> None:
    unet = build_unet(0, hidden=(32, 64, 64), layout="sdxl", transformer_layers=(1, 1, 3))
    assert unet.config.down_block_types == ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
    assert unet.config.up_block_types == ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")
    assert _depths(unet) == [0, 1, 3]
    assert len(unet.mid_block.attentions[0].transformer_blocks) == 3  # the mid block takes the coarsest depth


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown UNet layout"):
        build_unet(0, layout="flux")
    with pytest.raises(ValueError, match="one depth per level"):
        build_unet(0, hidden=(32, 64), layout="sdxl", transformer_layers=(1, 2, 3))


def test_the_shipped_sdxl_layout_model_has_that_layout() -> None:
    unet = UNet2DConditionModel.from_pretrained(TRAINED_DIR / "tiny-sd-sdxl-layout-trained", subfolder="unet",
                                                use_safetensors=True)
    assert unet.config.down_block_types[0] == "DownBlock2D"
    assert _depths(unet) == [0, 1, 3]
