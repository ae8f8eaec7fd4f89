"""Add-ons (LoRA adapters, ControlNets) in the object store, as the CPU side reads them.

Each stored add-on has a description (``meta.json``: what it adapts, its size, the digest of the
bytes it was added from). Ids are immutable, so a found description is cached for the life of the
process; a miss is asked again next time (the add-on may be added meanwhile).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from app.storage import ObjectNotFound, ObjectStore
from workers import context as ctx


class Descriptions:
    def __init__(self, meta_key: Callable[[str], str], limit: int = 4096) -> None:
        self.meta_key = meta_key
        self.limit = limit
        self._found: dict[str, dict[str, Any]] = {}

    def get(self, addon_id: str) -> dict[str, Any] | None:
        meta = self._found.get(addon_id)
        if meta is None:
            try:
                meta = json.loads(ctx.object_store().get(self.meta_key(addon_id)))
            except ObjectNotFound:
                return None
            if len(self._found) >= self.limit:
                self._found.clear()
            self._found[addon_id] = meta
        return meta


def already_added(store: ObjectStore, meta_key: str, addon_id: str, source_sha256: str,
                  what: str) -> dict[str, Any] | None:
    """For an add task: the stored description if ``addon_id`` exists with the same bytes, a refusal
    if it names other bytes (ids are immutable), None if it is new."""
    if not store.exists(meta_key):
        return None
    meta = json.loads(store.get(meta_key))
    if meta.get("source_sha256") == source_sha256:
        return meta
    return {"error": f"{addon_id!r} already names another {what} (ids are immutable)"}


__all__ = ["Descriptions", "already_added"]
