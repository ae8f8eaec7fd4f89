"""Small ControlNets for an inpainting UNet that do something (not the zero-initialised no-op)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel


def make_controlnet(unet: UNet2DConditionModel, seed: int, std: float = 0.02) -> ControlNetModel:
    """``ControlNetModel.from_unet`` with 4 latent input channels (what the ControlNet inpainting
    pipeline feeds it; the 9-channel UNet's first 4 input channels are the latents) and random
    zero convolutions, so that its residuals are not zero."""
    base = ControlNetModel.from_unet(unet)
    config = dict(base.config)
    config["in_channels"] = 4
    net = ControlNetModel.from_config(config)
    state = base.state_dict()
    state["conv_in.weight"] = state["conv_in.weight"][:, :4].clone()
    net.load_state_dict(state)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding")):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return net.eval()


def save_controlnet(unet: UNet2DConditionModel, out: Path, seed: int, std: float = 0.02) -> Path:
    make_controlnet(unet, seed, std).save_pretrained(out, safe_serialization=True)
    return out
