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


def open_activation_store(settings: Settings) -> ObjectStore:
    """The object store holding template activation caches (``STENCIL_ACTIVATIONS_BACKEND``)."""
    backend = settings.activations_backend or settings.store_backend
    if backend == "local":
        return LocalStore(settings.activations_dir)
    if backend == "s3":
        from app.storage.s3 import S3Store

        store = S3Store.from_settings(settings)
        if settings.activations_bucket:
            store = S3Store(settings.activations_bucket, endpoint_url=settings.s3_endpoint_url or None,
                            region=settings.s3_region, access_key=settings.s3_access_key or None,
                            secret_key=settings.s3_secret_key or None)
        return store
    raise ValueError(f"unknown activations backend {backend!r} (local | s3)")


__all__ = ["LocalStore", "ObjectNotFound", "ObjectStore", "StoreUnavailable", "open_activation_store", "open_store"]
