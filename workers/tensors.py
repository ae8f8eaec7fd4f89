"""Tensors as safetensors bytes: the only way tensors cross process boundaries (no pickle)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def pack(tensors: dict[str, torch.Tensor], meta: dict[str, object] | None = None) -> bytes:
    """Serialize tensors (made contiguous, on CPU) with JSON metadata under ``__metadata__``."""
    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    metadata = {"json": json.dumps(meta or {}, sort_keys=True)}
    return st_save(data, metadata=metadata)


def unpack(blob: bytes) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Inverse of ``pack``; raises ValueError on malformed data."""
    try:
        tensors = st_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get("json", "{}"))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"malformed tensor payload: {exc}") from exc
    return tensors, meta
