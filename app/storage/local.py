"""Local-folder object store: the embedded default, shared by processes on one host."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from app.storage.base import ObjectNotFound, ObjectStore


class LocalStore(ObjectStore):
    """Objects are files under ``root``; writes go to a temp file, then ``os.replace``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid object key: {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.name)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                if start is None and end is None:
                    return fh.read()
                begin = start or 0
                fh.seek(begin)
                return fh.read() if end is None else fh.read(max(0, end - begin))
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc

    def list(self, prefix: str) -> Iterator[str]:
        keys = []
        for path in self.root.rglob("*"):
            if path.is_file() and not path.name.startswith(".tmp-"):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        yield from sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
