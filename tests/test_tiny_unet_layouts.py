"""The tiny UNet builder's transformer layouts: SD's (attention at every level but the coarsest) and
SDXL's (none at the finest level, the deepest at the coarsest), which the trained
``tiny-sd-sdxl-layout-trained`` uses to measure coarse-level mask pooling."""

from __future__ import annotations

import json
import shlex

import pytest
from diffusers import UNet2DConditionModel

from ops.train import on_demand, sd
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


# The SDXL-layout model's weights are not shipped (ops/train/on_demand.py trains them): what is
# checked here is that its training command builds that layout and repeats the recorded run.
LAYOUT_MODEL = "tiny-sd-sdxl-layout-trained"
LAYOUT_DIR = TRAINED_DIR / LAYOUT_MODEL


def _config(unet: UNet2DConditionModel) -> dict:
    """The config as ``save_pretrained`` writes it, less diffusers' bookkeeping keys."""
    return {k: v for k, v in json.loads(unet.to_json_string()).items() if not k.startswith("_")}


def test_the_sdxl_layout_model_s_training_command_builds_that_layout_with_the_saved_config() -> None:
    args = sd.parser().parse_args(on_demand.training_argv(LAYOUT_MODEL))
    unet = sd.build_unet_for(args)
    assert unet.config.down_block_types[0] == "DownBlock2D"
    assert _depths(unet) == [0, 1, 3]
    saved = json.loads((LAYOUT_DIR / "unet" / "config.json").read_text())
    assert _config(unet) == {k: v for k, v in saved.items() if not k.startswith("_")}


def test_the_sdxl_layout_model_s_training_command_repeats_the_recorded_run() -> None:
    record = json.loads((LAYOUT_DIR / "training_log.json").read_text())
    recorded_cmd = shlex.split(record["command"])
    assert recorded_cmd[:3] == ["python", "-m", on_demand.RECIPES[LAYOUT_MODEL][0]]
    recorded = vars(sd.parser().parse_args(recorded_cmd[3:]))
    documented = vars(sd.parser().parse_args(on_demand.training_argv(LAYOUT_MODEL)))
    # The recorded run stopped on its wall-clock cap; the command stops at the same step by count.
    assert {k for k in documented if documented[k] != recorded[k]} == {"unet_steps", "unet_minutes"}
    assert documented["unet_steps"] == record["unet"]["steps"]
    assert documented["unet_minutes"] * 60 > 4 * record["unet"]["seconds"]


def test_the_sdxl_layout_model_card_gives_its_training_command() -> None:
    card = (LAYOUT_DIR / "README.md").read_text().replace("\\\n", " ")
    assert on_demand.command(LAYOUT_MODEL) in " ".join(card.split())
