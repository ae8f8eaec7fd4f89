"""The object-store interface every tier above it (activation cache, results, templates) uses.

Keys are ``/``-separated strings. Writes are atomic: a reader sees the whole object or nothing.
Backends: ``LocalStore`` (a folder; the embedded default) and ``S3Store`` (boto3; MinIO, SeaweedFS).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator


class ObjectNotFound(KeyError):
    """The key does not exist in the store."""


class StoreUnavailable(OSError):
    """The store cannot be reached (network down, server stopped); callers may fall back."""


class ObjectStore(ABC):
    """Byte-oriented key/value store with ranged reads."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically (replaces any previous object)."""

    @abstractmethod
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read the object, or bytes ``[start, end)`` of it. Raises ``ObjectNotFound``."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int:
        """Object size in bytes. Raises ``ObjectNotFound``."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Keys starting with ``prefix``, in lexicographic order."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; missing keys are ignored."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix``; returns how many were removed."""
        keys = list(self.list(prefix))
        for key in keys:
            self.delete(key)
        return len(keys)
