"""Test fixture: a diffusers SD inpainting folder as an original (LDM / CompVis) single-file state dict.

The installed diffusers converts original -> diffusers (``loaders/single_file_utils.py``) but ships
no reverse converter (the repository's ``scripts/`` are not installed), so the fixture writes the
minimal reverse key mapping for SD-1.x-layout UNets (any number of levels, any
``layers_per_block``), the 4-level-style VAE and the CLIP text tower. It only needs to be the
inverse of diffusers' forward mapping: the single-file test loads what it writes with
``from_single_file`` and compares every tensor with the folder's, so a wrong key fails there.
Top-level names come from diffusers' own table (``DIFFUSERS_TO_LDM_MAPPING``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING
from safetensors.torch import load_file

_UNET_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
                ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
_VAE_ATTN = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))


def _head(rest: str, table: tuple[tuple[str, str], ...]) -> str:
    for old, new in table:
        if rest.startswith(old + "."):
            return new + rest[len(old):]
    return rest


def unet_to_ldm(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    top = DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"]
    step = config["layers_per_block"] + 1
    up_attn = ["CrossAttn" in t for t in config["up_block_types"]]
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in top:
            new = top[key]
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            i, j, rest = int(m[1]), int(m[2]), m[3]
            new = f"input_blocks.{step * i + j + 1}.0.{_head(rest, _UNET_RESNET)}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", key):
            new = f"input_blocks.{step * int(m[1]) + int(m[2]) + 1}.1.{m[3]}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
            new = f"input_blocks.{step * (int(m[1]) + 1)}.0.op.{m[2]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"output_blocks.{step * int(m[1]) + int(m[2])}.0.{_head(m[3], _UNET_RESNET)}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", key):
            new = f"output_blocks.{step * int(m[1]) + int(m[2])}.1.{m[3]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key):
            i = int(m[1])
            new = f"output_blocks.{step * i + step - 1}.{2 if up_attn[i] else 1}.{m[2]}"
        elif m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", key):
            new = f"middle_block.{2 * int(m[1])}.{_head(m[2], _UNET_RESNET)}"
        elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", key):
            new = f"middle_block.1.{m[1]}"
        else:
            raise KeyError(f"no original-layout name for UNet key {key}")
        out["model.diffusion_model." + new] = value
    return out


def vae_to_ldm(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    top = DIFFUSERS_TO_LDM_MAPPING["vae"]
    n = len(config["up_block_types"])
    vres = (("conv_shortcut", "nin_shortcut"),)
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in top:
            new = top[key]
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"encoder.down.{m[1]}.block.{m[2]}.{_head(m[3], vres)}"
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.+)", key):
            new = f"encoder.down.{m[1]}.downsample.{m[2]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"decoder.up.{n - 1 - int(m[1])}.block.{m[2]}.{_head(m[3], vres)}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key):
            new = f"decoder.up.{n - 1 - int(m[1])}.upsample.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", key):
            new = f"{m[1]}.mid.block_{int(m[2]) + 1}.{_head(m[3], vres)}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", key):
            new = f"{m[1]}.mid.attn_1.{_head(m[2], _VAE_ATTN)}"
            if value.dim() == 2:   # original attention projections are 1x1 convs
                value = value[:, :, None, None]
        else:
            raise KeyError(f"no original-layout name for VAE key {key}")
        out["first_stage_model." + new] = value
    return out


def sd_folder_to_ldm(folder: Path) -> dict[str, torch.Tensor]:
    """UNet + VAE + CLIP text tower of a diffusers SD folder, in the original single-file layout."""
    folder = Path(folder)

    def part(name: str, weights: str) -> tuple[dict[str, torch.Tensor], dict]:
        return load_file(str(folder / name / weights)), json.loads((folder / name / "config.json").read_text())

    unet, unet_cfg = part("unet", "diffusion_pytorch_model.safetensors")
    vae, vae_cfg = part("vae", "diffusion_pytorch_model.safetensors")
    text, _ = part("text_encoder", "model.safetensors")
    state = {**unet_to_ldm(unet, unet_cfg), **vae_to_ldm(vae, vae_cfg)}
    # Original checkpoints hold the text tower as transformers < 5.6 named it (under ``text_model.``).
    state.update({"cond_stage_model.transformer." + (k if k.startswith("text_model.") else "text_model." + k): v
                  for k, v in text.items()})
    return {k: v.contiguous() for k, v in state.items()}


# ------------------------------------------------------------------------------------------------
# Flux: diffusers FluxTransformer2DModel -> Black Forest Labs' original single-file layout.

_FLUX_TOP = {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
             "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
_FLUX_DOUBLE = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
                "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
                "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
                "ff_context.net.2": "txt_mlp.2", "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}
_FLUX_SINGLE = {"norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
                "proj_out": "linear2"}


def flux_to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of diffusers' ``convert_flux_transformer_checkpoint_to_diffusers``."""
    def leaf(module: str, param: str) -> str:   # RMSNorm weights are ``scale`` in the original
        return "scale" if module.endswith("_norm") else param

    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        module, param = key.rsplit(".", 1)
        if module in _FLUX_TOP:
            out[f"{_FLUX_TOP[module]}.{param}"] = value
        elif module == "norm_out.linear":   # diffusers keeps (scale, shift); the original (shift, scale)
            scale, shift = value.chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{param}"] = torch.cat([shift, scale], dim=0)
        elif m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module):
            i, sub = m[1], m[2]
            if sub in _FLUX_DOUBLE:
                new = _FLUX_DOUBLE[sub]
                out[f"double_blocks.{i}.{new}.{leaf(new, param)}"] = value
            elif sub in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
                         "attn.add_v_proj"):
                stream = "txt" if "add_" in sub else "img"
                fused.setdefault(f"double_blocks.{i}.{stream}_attn.qkv.{param}", {})[sub] = value
            else:
                raise KeyError(f"no original-layout name for Flux key {key}")
        elif m := re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)", module):
            i, sub = m[1], m[2]
            if sub in _FLUX_SINGLE:
                new = _FLUX_SINGLE[sub]
                out[f"single_blocks.{i}.{new}.{leaf(new, param)}"] = value
            elif sub in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
                fused.setdefault(f"single_blocks.{i}.linear1.{param}", {})[sub] = value
            else:
                raise KeyError(f"no original-layout name for Flux key {key}")
        else:
            raise KeyError(f"no original-layout name for Flux key {key}")
    order = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "attn.add_q_proj", "attn.add_k_proj",
             "attn.add_v_proj")
    for name, parts in fused.items():
        out[name] = torch.cat([parts[k] for k in order if k in parts], dim=0)
    return {k: v.contiguous() for k, v in out.items()}
