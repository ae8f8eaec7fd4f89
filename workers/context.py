"""Per-process singletons for Celery workers: settings, Redis, stores, models, the engine.

Created lazily and once (under a lock) because Celery imports task modules in every process,
including ones that never run a task of that kind.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import redis

from app.blobs import BlobStore
from app.jobs import JobStore
from app.settings import Settings
from app.storage import ObjectStore, open_store

log = logging.getLogger(__name__)
_lock = threading.RLock()
# What the `stencil` command started this process as (gpu | cpu | stage; "" elsewhere): set before
# the Celery worker starts, inherited by its pool (threads, or forked processes).
_role = ""


def set_role(role: str) -> None:
    global _role
    _role = role


def role() -> str:
    return _role


@functools.cache
def settings() -> Settings:
    return Settings.from_env()


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings().redis_url, health_check_interval=30)


@functools.cache
def jobs() -> JobStore:
    s = settings()
    return JobStore(redis_client(), ttl_seconds=s.job_ttl_seconds)


@functools.cache
def blobs() -> BlobStore:
    return BlobStore(redis_client(), settings().blob_ttl_seconds)


@functools.cache
def object_store() -> ObjectStore:
    return open_store(settings())


@functools.cache
def model_dir() -> Path:
    from workers.models.loader import ensure_model_dir

    with _lock:
        return ensure_model_dir(settings())


@functools.cache
def scheduler_config() -> dict:
    from workers.models.loader import scheduler_config as load

    return load(model_dir())


@functools.cache
def model_family() -> str:
    from workers.models.loader import model_family as family

    return family(model_dir())


@functools.cache
def model_id() -> str:
    from workers.models.loader import model_identity

    return model_identity(model_dir())


@functools.cache
def activations():  # type: ignore[no-untyped-def]
    from app.storage import open_activation_store
    from workers.maskaware.activation_store import ActivationStore

    return ActivationStore(open_activation_store(settings()))


_stage_pipeline = None


def stage_pipeline():  # type: ignore[no-untyped-def]
    """Text encoders + VAE + tokenizers (no denoiser) for prepare/finalize, on STENCIL_STAGE_DEVICE."""
    global _stage_pipeline
    with _lock:
        if _stage_pipeline is None:
            from workers.models.loader import load_cpu_pipeline, torch_dtype

            _stage_pipeline = load_cpu_pipeline(model_dir(), settings().stage_device, torch_dtype(settings().dtype))
            log.info("stage modules (text encoders, VAE) on %s in %s", settings().stage_device, settings().dtype)
        return _stage_pipeline
