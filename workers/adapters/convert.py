"""Validate and convert an uploaded LoRA into Stencil's canonical form with diffusers' own loaders.

Users bring adapters in many layouts (diffusers/PEFT, kohya/A1111 ``lora_unet_*``, the Flux
trainers' formats). Rather than write converters, this runs the very path diffusers' stock
``load_lora_weights`` runs: the pipeline class's ``lora_state_dict`` (format detection and
conversion, network alphas, metadata), then ``load_lora_into_unet`` / ``_transformer`` /
``_text_encoder``, which let PEFT build its ``LoraConfig`` (rank and alpha patterns) and inject
LoRA layers. The model it injects into is a *skeleton*: the component built from its config with
zero-storage weights (one scalar expanded to each shape), so conversion costs no model memory and
no weights, yet PEFT checks every shape. The result is read back from PEFT's layers (``lora_A``,
``lora_B``, ``scaling``), i.e. exactly what diffusers would compute with.

Refused, with a reason naming the problem: anything but safetensors (checked by
``workers/weights_format.py``, which says what the file is instead; pickle-based ``.bin``,
``.ckpt``, ``.pt`` are never loaded), files over the size limit, no LoRA tensors, tensors for
modules or components the model does not have, shape mismatches, and adapter kinds the engine
does not apply (DoRA, LoRA biases, LoKr, embedding LoRAs, Flux Control LoRAs that replace norms).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from workers.adapters.lora import LoraModule, LoraWeights
from workers.weights_format import check_weights

log = logging.getLogger(__name__)

ADAPTER_NAME = "stencil"
WEIGHT_NAME = "pytorch_lora_weights.safetensors"


class InvalidAdapter(ValueError):
    """An adapter that cannot be used with this model; the message says why."""


def _skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """Give every parameter and buffer zero storage (a scalar expanded to its shape) on the CPU, so
    PEFT sees real devices and shapes without the model's memory."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                           requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.zeros((), dtype=b.dtype).expand(b.shape)
    return module


def _build(cls: Any, config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    return _skeleton(model)


def _components(model_dir: Path) -> tuple[Any, dict[str, torch.nn.Module]]:
    """The pipeline class (its LoRA loader mixin) and a skeleton of every LoRA-loadable component."""
    import diffusers
    import transformers

    index = json.loads((model_dir / "model_index.json").read_text())
    pipe_cls = getattr(diffusers, index["_class_name"])
    out: dict[str, torch.nn.Module] = {}
    for name in getattr(pipe_cls, "_lora_loadable_modules", []):
        entry = index.get(name)
        if not entry or entry[0] is None or not (model_dir / name / "config.json").is_file():
            continue
        library, cls_name = entry
        if library == "diffusers":
            cls = getattr(diffusers, cls_name)
            out[name] = _build(cls, cls.load_config(model_dir / name))
        elif library == "transformers":
            cls = getattr(transformers, cls_name)
            config = transformers.AutoConfig.from_pretrained(model_dir / name)
            out[name] = _build(cls, config)
    return pipe_cls, out


def _lora_numel(state: dict[str, torch.Tensor], prefix: str) -> tuple[int, set[str]]:
    """LoRA weight elements (alphas excluded) under ``prefix`` and the module paths they name."""
    numel, paths = 0, set()
    for k, v in state.items():
        if k.startswith(prefix + ".") and "lora" in k and not k.endswith(".alpha"):
            numel += v.numel()
            paths.add(k[len(prefix) + 1:].split(".lora")[0])
    return numel, paths


def _read_layers(name: str, model: torch.nn.Module) -> dict[str, LoraModule]:
    from peft.tuners.lora import LoraLayer

    out: dict[str, LoraModule] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or ADAPTER_NAME not in getattr(mod, "lora_A", {}):
            if isinstance(mod, LoraLayer) and ADAPTER_NAME in getattr(mod, "lora_embedding_A", {}):
                raise InvalidAdapter(f"{name}.{path}: embedding LoRAs are not supported")
            continue
        if getattr(mod, "use_dora", {}).get(ADAPTER_NAME):
            raise InvalidAdapter(f"{name}.{path}: DoRA adapters are not supported")
        base = mod.get_base_layer()
        if type(base) not in (torch.nn.Linear, torch.nn.Conv2d):
            raise InvalidAdapter(f"{name}.{path}: LoRA on {type(base).__name__} layers is not supported")
        a, b = mod.lora_A[ADAPTER_NAME], mod.lora_B[ADAPTER_NAME]
        if getattr(b, "bias", None) is not None:
            raise InvalidAdapter(f"{name}.{path}: LoRA biases are not supported")
        if isinstance(base, torch.nn.Conv2d) and (b.kernel_size != (1, 1) or b.stride != (1, 1)):
            raise InvalidAdapter(f"{name}.{path}: conv LoRA with a non-1x1 up projection is not supported")
        out[path] = LoraModule(
            a.weight.detach().clone(), b.weight.detach().clone(), float(mod.scaling[ADAPTER_NAME]))
    return out


def canonical_lora(data: bytes, model_dir: Path, lora_id: str, *, max_bytes: int) -> LoraWeights:
    """Convert an uploaded adapter for the model in ``model_dir`` or raise ``InvalidAdapter``."""
    if len(data) > max_bytes:
        raise InvalidAdapter(f"adapter is {len(data)} bytes, over STENCIL_MAX_LORA_BYTES = {max_bytes}")
    check_weights(data, name="the adapter", error=InvalidAdapter,
                  instead="upload it as .safetensors (what save_lora_weights writes by default; "
                          "safetensors.torch.save_file writes a state dict)")
    pipe_cls, skeletons = _components(Path(model_dir))
    if not skeletons:
        raise InvalidAdapter(f"{pipe_cls.__name__} models take no LoRA adapters")
    with tempfile.TemporaryDirectory(prefix="stencil-lora-") as tmp:
        (Path(tmp) / WEIGHT_NAME).write_bytes(data)
        kwargs: dict[str, Any] = {"weight_name": WEIGHT_NAME, "return_lora_metadata": True}
        if "unet" in skeletons:
            kwargs["unet_config"] = skeletons["unet"].config
        if "transformer" in skeletons:
            kwargs["return_alphas"] = True
        try:
            state, alphas, metadata = pipe_cls.lora_state_dict(tmp, **kwargs)
        except Exception as exc:  # a format diffusers cannot read: say so, no traceback
            raise InvalidAdapter(f"not a LoRA diffusers can read: {type(exc).__name__}: {exc}") from None
    if any(".lokr_" in k for k in state):
        raise InvalidAdapter("LoKr adapters are not supported")
    norm_keys = getattr(pipe_cls, "_control_lora_supported_norm_keys", [])
    if any(n in k for k in state for n in norm_keys):
        raise InvalidAdapter("adapters that replace norm layers (Flux Control LoRAs) are not supported")
    prefixes = {k.split(".")[0] for k in state if "lora" in k}
    if not prefixes:
        raise InvalidAdapter("no LoRA tensors found (every LoRA tensor name contains 'lora')")
    unknown = sorted(prefixes - set(skeletons))
    if unknown:
        raise InvalidAdapter(f"tensors for components this model does not have: {', '.join(unknown)} "
                             f"(model components: {', '.join(sorted(skeletons))})")
    out = LoraWeights(lora_id)
    for name in sorted(prefixes):
        model = skeletons[name]
        try:
            _load(pipe_cls, name, model, state, alphas, metadata)
        except InvalidAdapter:
            raise
        except Exception as exc:
            raise InvalidAdapter(f"{name}: does not fit this model: {_short(exc)}") from None
        mods = _read_layers(name, model)
        want, paths = _lora_numel(state, name)
        got = sum(m.down.numel() + m.up.numel() for m in mods.values())
        if got != want:
            missing = sorted(p for p in paths if p not in mods and f"text_model.{p}" not in mods)
            raise InvalidAdapter(f"{name}: {len(missing) or 'some'} LoRA modules name layers this model does not "
                                 f"have: {', '.join(missing[:3]) or '?'}{' ...' if len(missing) > 3 else ''}")
        if mods:
            out.components[name] = mods
    log.info("adapter %s converted: %s", lora_id, out.describe())
    return out


def _load(pipe_cls: Any, name: str, model: torch.nn.Module, state: dict[str, torch.Tensor],
          alphas: Any, metadata: Any) -> None:
    """What ``load_lora_weights`` does for one component, on the skeleton."""
    common = {"adapter_name": ADAPTER_NAME, "metadata": metadata, "low_cpu_mem_usage": False}
    if name == "unet":
        pipe_cls.load_lora_into_unet(state, alphas, unet=model, **common)
    elif name == "transformer":
        pipe_cls.load_lora_into_transformer(state, alphas, transformer=model, **common)
    else:
        pipe_cls.load_lora_into_text_encoder(state, alphas, text_encoder=model, prefix=name, lora_scale=1.0,
                                             **common)


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    detail = next((line.strip() for line in text if "size mismatch" in line), text[0] if text else "")
    return f"{type(exc).__name__}: {detail[:240]}"


__all__ = ["InvalidAdapter", "canonical_lora"]
