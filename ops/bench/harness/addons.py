"""Add-ons for benchmarks and tests: LoRA adapters and ControlNets that really change the output
(PEFT starts LoRA ``B`` and ControlNet zero convolutions at zero: no-ops), written with diffusers'
own savers so they are in the formats users have."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT = ["q_proj", "k_proj", "v_proj", "out_proj"]
FLUX = [*ATTN, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp", "proj_out"]


def lora_state(model: torch.nn.Module, *, rank: int, seed: int, targets: list[str], alpha: float | None = None,
               std: float = 0.05, diffusers_keys: bool = True) -> dict[str, torch.Tensor]:
    """A LoRA on ``model`` (left as it was, but for PEFT's empty wrappers) as diffusers' training
    scripts save it: SD scripts convert PEFT keys to diffusers' ``lora.down/up`` layout, the Flux
    scripts keep PEFT's ``lora_A/B``."""
    name = f"tmp{seed}"
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=targets,
                                 init_lora_weights="gaussian"), adapter_name=name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # both factors from ``seed``: PEFT's own init draws on the global RNG
        for pname, p in model.named_parameters():
            if "lora_A" in pname:  # PEFT's "gaussian" init: std 1/r
                p.copy_(torch.randn(p.shape, generator=gen) / rank)
            elif "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    state = get_peft_model_state_dict(model, adapter_name=name)
    (model.delete_adapters if hasattr(model, "delete_adapters") else model.delete_adapter)(name)
    return convert_state_dict_to_diffusers(state) if diffusers_keys else state


def save_sd_lora(pipe, out: Path, *, rank: int = 4, seed: int = 0, text_encoder: bool = False,  # type: ignore[no-untyped-def]
                 alpha: float | None = None, std: float = 0.05) -> Path:
    """A UNet (and optionally text encoder) LoRA on every attention projection, saved with the
    pipeline's ``save_lora_weights``; returns the file."""
    unet = lora_state(pipe.unet, rank=rank, seed=seed, targets=ATTN, alpha=alpha, std=std)
    te = lora_state(pipe.text_encoder, rank=rank, seed=seed + 1, targets=TEXT, alpha=alpha, std=std) \
        if text_encoder else None
    type(pipe).save_lora_weights(out, unet_lora_layers=unet, text_encoder_lora_layers=te)
    return out / "pytorch_lora_weights.safetensors"


def derive_lora(source: Path, out: Path, *, seed: int, rank: int, std: float = 0.05) -> Path:
    """Another adapter in ``source``'s format (a file ``save_sd_lora`` wrote): the same keys,
    shapes, dtype and metadata, every factor redrawn from ``seed`` as ``lora_state`` draws it
    (down/A: std 1/rank, up/B: ``std``). For benchmarks that need many distinct adapters of a
    true-size model, where PEFT's injection per adapter costs seconds on the host."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(source), "pt") as fh:
        metadata = fh.metadata()
        for key in fh.keys():
            t = fh.get_tensor(key)
            if key.endswith(("lora.down.weight", "lora_A.weight")):
                t = (torch.randn(t.shape, generator=gen) / rank).to(t.dtype)
            elif key.endswith(("lora.up.weight", "lora_B.weight")):
                t = (torch.randn(t.shape, generator=gen) * std).to(t.dtype)
            tensors[key] = t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / source.name), metadata=metadata)
    return out / source.name


def save_flux_lora(pipe, out: Path, *, rank: int = 4, seed: int = 0, std: float = 0.05,  # type: ignore[no-untyped-def]
                   targets: list[str] | None = None) -> Path:
    """A Flux transformer LoRA, saved with the pipeline's ``save_lora_weights``."""
    state = lora_state(pipe.transformer, rank=rank, seed=seed, targets=targets or FLUX, std=std, diffusers_keys=False)
    type(pipe).save_lora_weights(out, transformer_lora_layers=state)
    return out / "pytorch_lora_weights.safetensors"


def make_controlnet(unet: UNet2DConditionModel, seed: int, std: float = 0.02) -> ControlNetModel:
    """``ControlNetModel.from_unet`` with 4 latent input channels (what the ControlNet inpainting
    pipeline feeds it; a 9-channel inpainting UNet's first 4 input channels are the latents) and
    random zero convolutions, so its residuals are not zero. Built on the UNet's device (seconds on
    the host for a true-size one, a fraction of one on a GPU), in float32."""
    with torch.device(unet.device):
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


def save_controlnet(unet: UNet2DConditionModel, out: Path, seed: int, std: float = 0.02,
                    dtype: torch.dtype = torch.float32) -> Path:
    """``make_controlnet`` saved with ``save_pretrained`` in ``dtype`` (a true-size one in half
    precision: half the bytes to write and load)."""
    net = make_controlnet(unet, seed, std)
    torch.nn.Module.to(net, dtype=dtype)  # not ModelMixin.to: it warns about its empty keep-in-float32 list
    net.save_pretrained(out, safe_serialization=True)
    return out
