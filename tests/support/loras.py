"""Random but non-trivial LoRA adapters, written by diffusers' own savers (the format users have)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT = ["q_proj", "k_proj", "v_proj", "out_proj"]


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero (a no-op adapter): make it do something
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def lora_state(model: torch.nn.Module, *, rank: int, seed: int, targets: list[str], alpha: float | None = None,
               std: float = 0.05, diffusers_keys: bool = True) -> dict[str, torch.Tensor]:
    """A LoRA on ``model`` (left as it was) as diffusers' training scripts save it: SD scripts convert
    PEFT keys to diffusers' ``lora.down/up`` layout, the Flux scripts keep PEFT's ``lora_A/B``."""
    name = f"tmp{seed}"
    config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=targets, init_lora_weights="gaussian")
    model.add_adapter(config, adapter_name=name)
    _randomize(model, seed, std)
    state = get_peft_model_state_dict(model, adapter_name=name)
    if hasattr(model, "delete_adapters"):
        model.delete_adapters(name)
    else:
        model.delete_adapter(name)
    return convert_state_dict_to_diffusers(state) if diffusers_keys else state


def save_sd_lora(pipe, out: Path, *, rank: int = 4, seed: int = 0, text_encoder: bool = False,  # type: ignore[no-untyped-def]
                 alpha: float | None = None, std: float = 0.05) -> Path:
    """A UNet (and optionally text encoder) LoRA for an SD pipeline, saved with its ``save_lora_weights``."""
    unet = lora_state(pipe.unet, rank=rank, seed=seed, targets=ATTN, alpha=alpha, std=std)
    te = lora_state(pipe.text_encoder, rank=rank, seed=seed + 1, targets=TEXT, alpha=alpha, std=std) \
        if text_encoder else None
    type(pipe).save_lora_weights(out, unet_lora_layers=unet, text_encoder_lora_layers=te)
    return out / "pytorch_lora_weights.safetensors"


def save_flux_lora(pipe, out: Path, *, rank: int = 4, seed: int = 0, std: float = 0.05,  # type: ignore[no-untyped-def]
                   targets: list[str] | None = None) -> Path:
    """A Flux transformer LoRA, saved with the pipeline's ``save_lora_weights``."""
    targets = targets or [*ATTN, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp", "proj_out"]
    state = lora_state(pipe.transformer, rank=rank, seed=seed, targets=targets, std=std, diffusers_keys=False)
    type(pipe).save_lora_weights(out, transformer_lora_layers=state)
    return out / "pytorch_lora_weights.safetensors"
