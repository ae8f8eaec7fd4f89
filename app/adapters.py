"""LoRA adapters as the control plane sees them: ids, per-job scales, object-store keys.

No tensors here (the dispatcher and clients never import torch): a job names its adapters as
``[(id, scale), ...]``; the adapter itself is validated and converted once, when it is added, by
a CPU worker (``workers/adapters/convert.py``), which writes the canonical weights and a small
JSON description under ``loras/<id>/``. Adapters are immutable: an id names one set of weights
for its whole life, so every cache keyed by id stays valid.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from app.validation import InvalidParameter, number, object_id

MAX_LORA_SCALE = 8.0  # |scale| per adapter; diffusers' set_adapters weights are usually 0..1.5
DEFAULT_MAX_LORAS = 4  # adapters per job
# exact: a job's adapters apply from its first step (it waits in the engine until they are loaded);
# late: it may start without them and take them once loaded, within the first 30 %
# of its steps (the runner's lora_late_max_fraction) (SwiftDiffusion's observation: adapters barely change the first ~30 % of steps).
LORA_PATCH_POLICIES = ("exact", "late")
LORA_PREFIX = "loras/"

AdapterSet = tuple[tuple[str, float], ...]


def lora_weights_key(lora_id: str) -> str:
    """The canonical weights (safetensors, ``workers/adapters/lora.py`` layout)."""
    return f"{LORA_PREFIX}{lora_id}/weights.safetensors"


def lora_meta_key(lora_id: str) -> str:
    """What the adapter is (JSON): components, ranks, target modules, bytes, digest, source format."""
    return f"{LORA_PREFIX}{lora_id}/meta.json"


def lora_upload_key(token: str) -> str:
    """Where a client leaves the bytes of an adapter being added (deleted once converted)."""
    return f"{LORA_PREFIX}.incoming/{token}"


def adapter_set(value: Any, max_adapters: int) -> AdapterSet:
    """A job's adapters, checked and normalised: ``[(id, scale), ...]`` or ``"id:scale;id"``
    (scale 1.0 when omitted) or a JSON list; sorted by id (the sum of adapters does not depend
    on their order, and a canonical order makes equal sets equal keys); no id twice."""
    if value is None or value == "" or value == [] or value == ():
        return ()
    if isinstance(value, str):
        value = _parse_text(value)
    if not isinstance(value, Iterable) or isinstance(value, (bytes, dict)):
        raise InvalidParameter("loras", f"must be a list of (id, scale) pairs, got {type(value).__name__}")
    out: dict[str, float] = {}
    for item in value:
        if isinstance(item, str):
            lora_id, scale = item, 1.0
        elif isinstance(item, Sequence) and len(item) == 2:
            lora_id, scale = item[0], item[1]
        else:
            raise InvalidParameter("loras", f"each entry must be an id or an (id, scale) pair, got {item!r:.60}")
        lora_id = object_id("loras", lora_id)
        if lora_id in out:
            raise InvalidParameter("loras", f"adapter {lora_id!r} is named twice")
        out[lora_id] = number("loras", scale, -MAX_LORA_SCALE, MAX_LORA_SCALE)
    if len(out) > max_adapters:
        raise InvalidParameter("loras", f"at most {max_adapters} adapters per job, "
                                        f"got {len(out)}")
    return tuple(sorted(out.items()))


def _parse_text(value: str) -> Any:
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise InvalidParameter("loras", "is not valid JSON") from None
    pairs = []
    for part in filter(None, (p.strip() for p in text.replace(",", ";").split(";"))):
        lora_id, sep, scale = part.partition(":")
        pairs.append((lora_id, scale if sep else 1.0))
    return pairs


def dump_adapter_set(adapters: AdapterSet) -> str:
    """The record field: a compact JSON list (empty string for none)."""
    return json.dumps([[i, s] for i, s in adapters], separators=(",", ":")) if adapters else ""


def load_adapter_set(field: str) -> AdapterSet:
    """Inverse of ``dump_adapter_set`` (the record was validated when written)."""
    if not field:
        return ()
    return tuple((str(i), float(s)) for i, s in json.loads(field))


def adapter_digest(adapters: AdapterSet) -> str:
    """A short stable name of an adapter set (cache keys, logs); "" for none."""
    if not adapters:
        return ""
    import hashlib

    return hashlib.sha256(dump_adapter_set(adapters).encode()).hexdigest()[:16]


__all__ = ["AdapterSet", "DEFAULT_MAX_LORAS", "LORA_PATCH_POLICIES", "MAX_LORA_SCALE", "adapter_digest",
           "adapter_set", "dump_adapter_set", "load_adapter_set", "lora_meta_key", "lora_upload_key",
           "lora_weights_key"]
