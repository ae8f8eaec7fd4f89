"""Object stores (local folder, S3) behind one interface; see ``base.ObjectStore``."""

from __future__ import annotations

from app.settings import Settings
from app.storage.base import ObjectNotFound, ObjectStore, StoreUnavailable
from app.storage.local import LocalStore


def open_store(settings: Settings) -> ObjectStore:
    """The object store the settings name (``STENCIL_STORE_BACKEND``)."""
    if settings.store_backend == "local":
        return LocalStore(settings.store_dir)
    if settings.store_backend == "s3":
        from app.storage.s3 import S3Store

        return S3Store.from_settings(settings)
    raise ValueError(f"unknown store backend {settings.store_backend!r} (local | s3)")


__all__ = ["LocalStore", "ObjectNotFound", "ObjectStore", "StoreUnavailable", "open_store"]
