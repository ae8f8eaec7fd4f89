"""Short-lived binary payloads in Redis (uploads, intermediate tensors), keyed per job.

Celery messages stay small JSON; anything binary travels by reference to one of these keys.
Tensors are safetensors bytes (``workers.tensors``), never pickles. Keys expire by TTL so an
abandoned job cannot leak memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

BLOB_PREFIX = "stencil:blob:"


class BlobStore:
    def __init__(self, client: redis.Redis, ttl_seconds: int) -> None:
        self.r = client
        self.ttl = ttl_seconds

    @staticmethod
    def key(job_id: str, name: str) -> str:
        return f"{BLOB_PREFIX}{job_id}:{name}"

    def put(self, job_id: str, name: str, data: bytes) -> str:
        key = self.key(job_id, name)
        self.r.set(key, data, ex=self.ttl)
        return key

    def put_many(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        """Several payloads of one job in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for name, data in blobs.items():
            pipe.set(self.key(job_id, name), data, ex=self.ttl)
        pipe.execute()

    def get(self, job_id: str, name: str) -> bytes | None:
        value = self.r.get(self.key(job_id, name))
        return bytes(value) if value is not None else None

    def exists(self, job_id: str, name: str) -> bool:
        return bool(self.r.exists(self.key(job_id, name)))

    def delete_job(self, job_id: str) -> None:
        keys = list(self.r.scan_iter(match=f"{BLOB_PREFIX}{job_id}:*", count=100))
        if keys:
            self.r.delete(*keys)
