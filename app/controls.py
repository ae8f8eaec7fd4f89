"""ControlNets as the control plane sees them: per-job controls, object-store keys. No tensors.

A job's controls are ``(controlnet id, conditioning scale, start, end)`` as diffusers'
``StableDiffusionControlNetInpaintPipeline`` takes them (``controlnet_conditioning_scale``,
``control_guidance_start``, ``control_guidance_end``); the control images travel beside the
job's mask (blobs ``control0``, ``control1``, ...). A ControlNet itself is a diffusers
``ControlNetModel`` folder, validated against the service's model by a CPU worker when added
(``workers/controlnets/registry.py``) and stored under ``controlnets/<id>/``; ids are immutable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from app.validation import InvalidParameter, number, object_id

CONTROLNET_PREFIX = "controlnets/"
DEFAULT_MAX_CONTROLS = 4
MAX_CONTROL_SCALE = 4.0
CONTROL_WEIGHTS = "diffusion_pytorch_model.safetensors"
CONTROL_FILES = ("config.json", CONTROL_WEIGHTS)

Control = tuple[str, float, float, float]  # (controlnet id, scale, start, end)


def controlnet_key(controlnet_id: str, name: str) -> str:
    """A file of the stored ControlNet folder (``CONTROL_FILES``)."""
    return f"{CONTROLNET_PREFIX}{controlnet_id}/{name}"


def controlnet_meta_key(controlnet_id: str) -> str:
    return f"{CONTROLNET_PREFIX}{controlnet_id}/meta.json"


def controlnet_upload_key(token: str, name: str) -> str:
    return f"{CONTROLNET_PREFIX}.incoming/{token}/{name}"


def control_blob(index: int) -> str:
    """The job blob holding its ``index``-th control image."""
    return f"control{index}"


def control_spec(item: Any) -> tuple[Control, Any]:
    """One control as a client gives it: ``(id, image, scale[, start, end])`` or a mapping with
    ``id``, ``image``, ``scale``, ``start``, ``end``. Returns the checked control and the image."""
    if isinstance(item, Mapping):
        values = [item.get("id"), item.get("image"), item.get("scale", 1.0), item.get("start", 0.0),
                  item.get("end", 1.0)]
    elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and 2 <= len(item) <= 5:
        values = list(item) + [1.0, 0.0, 1.0][len(item) - 2:]
    else:
        raise InvalidParameter("controls", "each control is (id, image, scale[, start, end]) or a mapping")
    control_id, image, scale, start, end = values
    if image is None:
        raise InvalidParameter("controls", "a control needs an image")
    return check_control((control_id, scale, start, end)), image


def check_control(control: Sequence[Any]) -> Control:
    control_id, scale, start, end = control
    control_id = object_id("controls", control_id)
    scale = number("controls", scale, -MAX_CONTROL_SCALE, MAX_CONTROL_SCALE)
    start = number("controls", start, 0.0, 1.0)
    end = number("controls", end, 0.0, 1.0)
    if start >= end:
        raise InvalidParameter("controls", f"start ({start:g}) must be before end ({end:g})")
    return (control_id, scale, start, end)


def check_controls(controls: Iterable[Sequence[Any]], max_controls: int) -> tuple[Control, ...]:
    out = tuple(check_control(c) for c in controls)
    if len(out) > max_controls:
        raise InvalidParameter("controls", f"at most {max_controls} controls per job, "
                                           f"got {len(out)}")
    return out


def dump_controls(controls: tuple[Control, ...]) -> str:
    return json.dumps([list(c) for c in controls], separators=(",", ":")) if controls else ""


def load_controls(field: str) -> tuple[Control, ...]:
    if not field:
        return ()
    return tuple((str(i), float(s), float(a), float(b)) for i, s, a, b in json.loads(field))


def controls_digest(controls: tuple[Control, ...], image_digests: Sequence[str]) -> str:
    """A short stable name of a job's controls and their images (cache keys); "" for none."""
    if not controls:
        return ""
    import hashlib

    return hashlib.sha256(json.dumps([dump_controls(controls), list(image_digests)]).encode()).hexdigest()[:16]


__all__ = ["CONTROL_FILES", "CONTROL_WEIGHTS", "Control", "DEFAULT_MAX_CONTROLS", "check_control", "check_controls",
           "control_blob", "control_spec", "controlnet_key", "controlnet_meta_key", "controlnet_upload_key",
           "controls_digest", "dump_controls", "load_controls"]
