"""Adding a ControlNet: a CPU worker checks a diffusers ``ControlNetModel`` folder against the
service's model before anything is stored (``stencil.add_controlnet``).

Checked without loading the weights: the weights file is safetensors (``workers/weights_format.py``;
pickle-based weights are never read), the config builds a ``ControlNetModel``, the safetensors
header names exactly that model's tensors with exactly its shapes, and the structure fits the
UNet whose down blocks it feeds (block widths, layers per block, block types, cross-attention
width, latent channels), so its residuals have the shapes the UNet adds them at. A refusal is
returned as ``{"error": reason}``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from typing import Any

import torch

from app.celery_app import app
from app.controls import CONTROL_FILES, CONTROL_WEIGHTS, controlnet_key, controlnet_meta_key, controlnet_upload_key
from app.storage import ObjectNotFound
from workers import context as ctx
from workers.addon_store import already_added
from workers.weights_format import check_weights

log = logging.getLogger(__name__)

_MATCH = ("block_out_channels", "layers_per_block", "cross_attention_dim", "transformer_layers_per_block")


class InvalidControlNet(ValueError):
    """A ControlNet that cannot serve this model; the message says why."""


def _per_level(value: Any, levels: int) -> list[Any] | None:
    """A config value that may be given once or per UNet level, as a list per level."""
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value] * levels


def check_controlnet(config: dict[str, Any], weights: bytes, unet_config: dict[str, Any],
                     latent_channels: int) -> int:
    """Raise ``InvalidControlNet`` unless it fits; returns the number of parameters."""
    header = check_weights(weights, name=CONTROL_WEIGHTS, instead=f"upload {CONTROL_WEIGHTS} as ControlNetModel."
                           "save_pretrained writes it (safe_serialization, the default)", error=InvalidControlNet)
    if config.get("_class_name") != "ControlNetModel":
        raise InvalidControlNet(f"config.json is a {config.get('_class_name')!r}, not a ControlNetModel")
    if config.get("global_pool_conditions"):
        raise InvalidControlNet("global-pool ControlNets (guess mode) are not supported")
    if config.get("in_channels", 4) != latent_channels:
        raise InvalidControlNet(f"the ControlNet takes {config.get('in_channels')} latent channels, "
                                f"this model's latents have {latent_channels}")
    levels = len(unet_config.get("block_out_channels", ()))
    for name in _MATCH:
        ours, theirs = _per_level(unet_config.get(name), levels), _per_level(config.get(name), levels)
        if theirs is not None and ours != theirs:
            raise InvalidControlNet(f"{name} is {config.get(name)}, the model's UNet has {unet_config.get(name)}: "
                                    "its residuals would not fit")
    down = [t.replace("CrossAttn", "") for t in config.get("down_block_types", [])]
    if down != [t.replace("CrossAttn", "") for t in unet_config.get("down_block_types", [])]:
        raise InvalidControlNet("down_block_types do not match the model's UNet")
    try:
        want = _tensor_shapes(json.dumps(config, sort_keys=True))
    except Exception as exc:
        raise InvalidControlNet(f"config.json does not build a ControlNetModel: {type(exc).__name__}: {exc}") from None
    have = {k: list(v.shape) for k, v in header.tensors.items()}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if missing or extra:
        raise InvalidControlNet(f"weights do not match the config: {len(missing)} missing, {len(extra)} unexpected "
                                f"(e.g. {(missing or extra)[0]})")
    wrong = [k for k in want if want[k] != have[k]]
    if wrong:
        raise InvalidControlNet(f"{wrong[0]} has shape {have[wrong[0]]}, the config needs {want[wrong[0]]}")
    return sum(math.prod(shape) for shape in want.values())


@functools.lru_cache(maxsize=8)
def _tensor_shapes(config_json: str) -> dict[str, list[int]]:
    """The tensors a ControlNet of this config has, by name, built on the meta device. Memoized:
    uploads of one architecture (a family's ControlNets, the 256 padded files of a test) share it,
    and building the skeleton costs more than the rest of the check."""
    from diffusers import ControlNetModel

    with torch.device("meta"):
        model = ControlNetModel.from_config(json.loads(config_json))
    return {k: list(v.shape) for k, v in model.state_dict().items()}


@app.task(name="stencil.add_controlnet")
def add_controlnet(token: str, controlnet_id: str, source_sha256: str) -> dict[str, Any]:
    store = ctx.object_store()
    known = already_added(store, controlnet_meta_key(controlnet_id), controlnet_id, source_sha256, "ControlNet")
    if known is not None:
        return known
    if ctx.model_family() != "sd":
        return {"error": "ControlNets are served for SD-family models only (diffusers has no Flux Fill ControlNet "
                         "inpainting pipeline)"}
    try:
        raw = {name: store.get(controlnet_upload_key(token, name)) for name in CONTROL_FILES}
    except ObjectNotFound:
        return {"error": "the uploaded ControlNet is missing (expired or never uploaded)"}
    try:
        config = json.loads(raw["config.json"])
        unet_config = json.loads((ctx.model_dir() / "unet" / "config.json").read_text())
        latent = json.loads((ctx.model_dir() / "vae" / "config.json").read_text()).get("latent_channels", 4)
        params = check_controlnet(config, raw[CONTROL_WEIGHTS], unet_config, latent)
    except (InvalidControlNet, json.JSONDecodeError) as exc:
        log.info("ControlNet %s refused: %s", controlnet_id, exc)
        return {"error": str(exc) if isinstance(exc, InvalidControlNet) else "config.json is not valid JSON"}
    for name in CONTROL_FILES:
        store.put(controlnet_key(controlnet_id, name), raw[name])
    meta = {"id": controlnet_id, "model_id": ctx.model_id(), "source_sha256": source_sha256, "parameters": params,
            "nbytes": len(raw[CONTROL_WEIGHTS]), "added": time.time(),
            "conditioning_channels": config.get("conditioning_channels", 3)}
    store.put(controlnet_meta_key(controlnet_id), json.dumps(meta, sort_keys=True).encode())
    log.info("ControlNet %s added (%d parameters)", controlnet_id, params)
    return meta


__all__ = ["InvalidControlNet", "add_controlnet", "check_controlnet"]
