"""LoRA adapters on the CPU side: adding one (validate + convert, a Celery task) and reading them.

``stencil.add_lora`` runs where the model folder is (a CPU worker): the client leaves the uploaded
bytes in the object store, the task converts them with diffusers' own loaders against this
model (``workers/adapters/convert.py``) and stores the canonical weights and a description under
``loras/<id>/``. A refusal is returned as ``{"error": reason}`` (the client raises it): a bad
adapter is a user's mistake, not a task failure, and never takes the worker down.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from app.adapters import AdapterSet, lora_meta_key, lora_upload_key, lora_weights_key
from app.celery_app import app
from app.storage import ObjectNotFound
from workers import context as ctx
from workers.adapters.lora import LoraWeights
from workers.addon_store import Descriptions, already_added

log = logging.getLogger(__name__)


@app.task(name="stencil.add_lora")
def add_lora(token: str, lora_id: str, source_sha256: str) -> dict[str, Any]:
    from workers.adapters.convert import InvalidAdapter, canonical_lora

    store = ctx.object_store()
    known = already_added(store, lora_meta_key(lora_id), lora_id, source_sha256, "adapter")
    if known is not None:
        return known
    try:
        data = store.get(lora_upload_key(token))
    except ObjectNotFound:
        return {"error": "the uploaded adapter is missing (expired or never uploaded)"}
    try:
        weights = canonical_lora(data, ctx.model_dir(), lora_id, max_bytes=ctx.settings().max_lora_bytes)
    except InvalidAdapter as exc:
        log.info("adapter %s refused: %s", lora_id, exc)
        return {"error": str(exc)}
    except Exception as exc:  # anything else is still the adapter's problem, never the worker's
        log.exception("adapter %s: conversion failed", lora_id)
        return {"error": f"conversion failed: {type(exc).__name__}"}
    blob = weights.to_bytes()
    meta = {"id": lora_id, "model_id": ctx.model_id(), "source_sha256": source_sha256,
            "source_bytes": len(data), "added": time.time(), **weights.describe()}
    store.put(lora_weights_key(lora_id), blob)
    store.put(lora_meta_key(lora_id), json.dumps(meta, sort_keys=True).encode())
    log.info("adapter %s added (%d bytes canonical)", lora_id, len(blob))
    return meta


_descriptions = Descriptions(lora_meta_key)


def adapter_meta(lora_id: str) -> dict[str, Any] | None:
    """An adapter's description, or None if no such adapter."""
    return _descriptions.get(lora_id)


def read_weights(lora_id: str) -> LoraWeights:
    """The canonical weights from the object store (safetensors; raises ObjectNotFound)."""
    return LoraWeights.from_bytes(ctx.object_store().get(lora_weights_key(lora_id)))


def adapter_problem(adapters: AdapterSet, model_id: str) -> str | None:
    """Why a job's adapters cannot be used (unknown ids, added for another model), or None."""
    unknown = [i for i, _ in adapters if adapter_meta(i) is None]
    if unknown:
        return f"unknown LoRA adapter(s): {', '.join(unknown)} (add them with `stencil lora add`)"
    other = [i for i, _ in adapters if (adapter_meta(i) or {}).get("model_id") != model_id]
    if other:
        return f"LoRA adapter(s) {', '.join(other)} were added for another model than this service's"
    return None


def text_encoder_sets(adapters: AdapterSet) -> dict[str, AdapterSet]:
    """Per text encoder component, the job's adapters that adapt it."""
    out: dict[str, list[tuple[str, float]]] = {}
    for lora_id, scale in adapters:
        for comp in (adapter_meta(lora_id) or {}).get("components", {}):
            if comp.startswith("text_encoder"):
                out.setdefault(comp, []).append((lora_id, scale))
    return {k: tuple(v) for k, v in out.items()}


_te_lock = threading.Lock()
_te_patchers: dict[str, Any] = {}


@functools.lru_cache(maxsize=64)
def _cached_weights(lora_id: str) -> LoraWeights:
    return read_weights(lora_id)


@contextlib.contextmanager
def text_encoder_adapters(pipe: Any, adapters: AdapterSet) -> Iterator[None]:
    """While encoding a job's prompt: its text-encoder adapters merged into the CPU pipeline's text
    encoders (exactly undone by the next job that needs other ones; in half precision applied as
    terms, ``LoraPatcher.apply``). One job at a time per process."""
    from workers.adapters.patcher import LoraPatcher

    sets = text_encoder_sets(adapters)
    with _te_lock:
        for comp in ("text_encoder", "text_encoder_2"):
            model = getattr(pipe, comp, None)
            if model is None or (comp not in sets and comp not in _te_patchers):
                continue
            patcher = _te_patchers.get(comp)
            if patcher is None or patcher.model is not model:
                patcher = _te_patchers[comp] = LoraPatcher(model, comp, _cached_weights)
            patcher.apply(sets.get(comp, ()))
        yield


__all__ = ["adapter_meta", "add_lora", "read_weights", "text_encoder_adapters", "text_encoder_sets",
           "adapter_problem"]
