"""Template activation caches in the object store: one safetensors object per (template, step).

Layout under ``activations/<digest>/``: ``step_0000.safetensors`` ... and ``manifest.json``. The
manifest is written *last* by ``commit``: readers require it, so a partly written cache is never
visible, and ``delete`` removes it first for the same reason. Step objects carry the key in their
safetensors metadata and the manifest carries the full key, so a cache recorded under another key
(digest collision, copied or stale objects) is refused rather than silently used. Tensors are read
with ``safetensors.torch.load`` from bytes; nothing is ever unpickled. Step objects are written by
``app/storage/tensorfile.py`` (plain safetensors plus per-tensor sha256), so the engine can read
one plan unit's tensors with a ranged GET (``step_header`` + ``read_tensors``) and every read is
verified; objects written before that (no hashes) still load whole through ``read_step``.

This tier is deliberately small; a host-RAM LRU and S3 go below/above it without changing it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields

import torch
from safetensors.torch import load as st_load

from app.storage import tensorfile
from app.storage.base import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CacheNotFound(KeyError):
    """No committed cache (or no such step) for this key."""


class CacheKeyMismatch(ValueError):
    """Stored objects were recorded under a different key than the one asked for."""


def recorded_layout(layout: str, dtype: str | torch.dtype) -> str:
    """A cache layout keyed by the compute dtype its activations are recorded in (``kv+y@bfloat16``;
    float32's is the bare layout): an exact cache is exact only in that dtype, and the runner
    refuses a key recorded in another one."""
    name = str(dtype).removeprefix("torch.")
    return layout if name == "float32" else f"{layout}@{name}"


@dataclass(frozen=True)
class TemplateCacheKey:
    """Everything a cache's validity depends on (DESIGN.md section 2, "Cache validity")."""

    model_id: str
    template_id: str
    height: int
    width: int
    scheduler: str
    steps: int
    strength: float
    guidance: str  # "cfg2" (uncond, cond rows) | "single"
    layout: str = "kv+y"  # MaskAwareUNet.cache_layout: "kv+y" or "y"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def exact_region(self) -> bool:
        """A region warm-up's key (layout ``.../exact-<region>``, ``workers/cpu_tasks.py``): one edit's
        own recording, which must stay lossless and complete so that edit equals the stock pipeline."""
        return "/exact-" in self.layout

    @property
    def stored_step_count(self) -> int:
        """Steps a template warm-up stores (layout segment ``steps-<n>``, ``STENCIL_CACHE_STEPS``,
        ``workers/engine/template_cache.py``); 0 = every step. Exact-region caches store every step."""
        if self.exact_region:
            return 0
        for part in self.layout.split("/"):
            if part.startswith("steps-") and part[6:].isdigit():
                n = int(part[6:])
                return n if n < self.steps else 0
        return 0

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> "TemplateCacheKey":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]

    def canonical(self) -> str:
        """Stable text form: sorted keys, floats in repr form (0.8 -> "0.8")."""
        d = self.to_dict()
        d["strength"] = repr(float(self.strength))
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:32]


def _st_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte LE header length + JSON header)."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]).get("__metadata__", {}) or {}


class ActivationStore:
    """Writes, commits, reads, lists and deletes template caches in an ``ObjectStore``."""

    def __init__(self, store: ObjectStore, prefix: str = "activations", manifest_cache: int = 256) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        # Committed manifests, so reading a step costs one request, not two (the prefetcher is
        # latency-bound on S3). Safe to reuse: step objects are verified against the key and their
        # hashes on every read, and a deleted cache then fails the read (-> full compute).
        self._manifests: OrderedDict[str, dict[str, object]] = OrderedDict()
        self._manifest_cache = manifest_cache
        self._manifest_lock = threading.Lock()

    def _dir(self, key: TemplateCacheKey) -> str:
        return f"{self.prefix}/{key.digest()}/"

    def step_object(self, key: TemplateCacheKey, step: int) -> str:
        return f"{self._dir(key)}step_{step:04d}.safetensors"

    def manifest_object(self, key: TemplateCacheKey) -> str:
        return self._dir(key) + MANIFEST

    def put_step(self, key: TemplateCacheKey, step: int, tensors: dict[str, torch.Tensor],
                 codec: str = "", rows: int = 0) -> int:
        """Store one step's tensors (invisible to readers until ``commit``); returns bytes.
        ``codec``: the storage codec the tensors were encoded with (``workers/engine/cache_codec.py``),
        recorded in the object's metadata; ``rows``: the recording's row count, when tensors with
        bit-equal rows are stored with one row (``cache_codec.share_rows``), likewise."""
        if not 0 <= step < key.steps:
            raise ValueError(f"step {step} outside 0..{key.steps - 1}")
        meta = {"key": key.canonical(), "step": str(step), "format": str(FORMAT_VERSION)}
        if codec:
            meta["codec"] = codec
        if rows:
            meta["rows"] = str(rows)
        data = tensorfile.encode({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, meta)
        self.store.put(self.step_object(key, step), data)
        return len(data)

    def commit(self, key: TemplateCacheKey, extra: dict[str, object] | None = None) -> dict[str, object]:
        """Publish the cache: write the manifest over the step objects present. ``extra``: more
        manifest fields (``codec``: the storage codec; ``units``: the plan units stored, when the
        warm-up stored only those its link speed makes worth loading; ``rows``: every tensor's row
        count, a one-row tensor then holding bit-equal rows, and ``shared_rows``: the names stored
        so in every step, ``cache_codec.share_rows``)."""
        steps: dict[str, dict[str, object]] = {}
        d = self._dir(key)
        for obj in self.store.list(d):
            name = obj[len(d):]
            if name.startswith("step_") and name.endswith(".safetensors"):
                steps[str(int(name[5:-12]))] = {"object": obj, "bytes": self.store.size(obj)}
        if not steps:
            raise CacheNotFound(f"no step objects written for {key}")
        manifest = {
            "format": FORMAT_VERSION,
            "key": key.to_dict(),
            "digest": key.digest(),
            "steps": steps,
            "nbytes": sum(int(s["bytes"]) for s in steps.values()),
            "created": time.time(),
            **(extra or {}),
        }
        self.store.put(self.manifest_object(key), json.dumps(manifest, sort_keys=True).encode())
        self._forget_manifest(key)
        log.info("committed activation cache %s (%d steps, %d bytes)", key.digest(), len(steps),
                 manifest["nbytes"])
        return manifest

    def _forget_manifest(self, key: TemplateCacheKey) -> None:
        with self._manifest_lock:
            self._manifests.pop(key.digest(), None)

    def cached_manifest(self, key: TemplateCacheKey) -> dict[str, object]:
        """``manifest`` through a small LRU (readers of step objects; module doc of ``__init__``)."""
        digest = key.digest()
        with self._manifest_lock:
            hit = self._manifests.get(digest)
            if hit is not None:
                self._manifests.move_to_end(digest)
                return hit
        manifest = self.manifest(key)
        with self._manifest_lock:
            self._manifests[digest] = manifest
            while len(self._manifests) > self._manifest_cache:
                self._manifests.popitem(last=False)
        return manifest

    def manifest(self, key: TemplateCacheKey) -> dict[str, object]:
        """The committed manifest, read from the store; refuses one recorded under another key."""
        try:
            manifest = json.loads(self.store.get(self.manifest_object(key)))
        except ObjectNotFound as exc:
            raise CacheNotFound(f"no committed cache for {key}") from exc
        stored = TemplateCacheKey.from_dict(manifest["key"])
        if stored != key:
            raise CacheKeyMismatch(f"cache at {key.digest()} was recorded for {stored}, not {key}")
        return manifest

    def has(self, key: TemplateCacheKey) -> bool:
        try:
            self.manifest(key)
        except (CacheNotFound, CacheKeyMismatch):
            return False
        return True

    def steps(self, key: TemplateCacheKey) -> list[int]:
        """Committed step indices of a template's cache."""
        return sorted(int(s) for s in self.manifest(key)["steps"])  # type: ignore[union-attr]

    def read_step(self, key: TemplateCacheKey, step: int) -> dict[str, torch.Tensor]:
        """One committed step's tensors (CPU); checks the key in the manifest and the object."""
        entry = self.cached_manifest(key)["steps"].get(str(step))  # type: ignore[union-attr]
        if entry is None:
            raise CacheNotFound(f"step {step} not in cache {key.digest()}")
        try:
            data = self.store.get(str(entry["object"]))
        except ObjectNotFound:
            self._forget_manifest(key)  # deleted or re-recorded since: the next read re-checks
            raise
        meta = _st_metadata(data)
        if meta.get("key") != key.canonical() or meta.get("step") != str(step):
            raise CacheKeyMismatch(f"{entry['object']} holds {meta.get('key')} step {meta.get('step')}")
        if "stencil.format" in meta:
            return tensorfile.decode(data)
        return st_load(data)

    def step_header(self, key: TemplateCacheKey, step: int) -> tuple[str, tensorfile.TensorHeader]:
        """(object, verified header) of a committed step, read with ranged GETs only."""
        entry = self.cached_manifest(key)["steps"].get(str(step))  # type: ignore[union-attr]
        if entry is None:
            raise CacheNotFound(f"step {step} not in cache {key.digest()}")
        obj = str(entry["object"])
        try:
            header = tensorfile.read_header(self.store, obj)
        except ObjectNotFound:
            self._forget_manifest(key)
            raise
        if header.metadata.get("key") != key.canonical() or header.metadata.get("step") != str(step):
            raise CacheKeyMismatch(f"{obj} holds {header.metadata.get('key')} step {header.metadata.get('step')}")
        return obj, header

    def read_tensors(self, obj: str, header: tensorfile.TensorHeader, names: list[str]) -> dict[str, torch.Tensor]:
        """Some tensors of a step object (one ranged GET per contiguous run), hash-verified."""
        return tensorfile.read_tensors(self.store, obj, names, header)

    def list_templates(self) -> list[TemplateCacheKey]:
        """Keys of every committed cache under the prefix."""
        keys = []
        for obj in self.store.list(self.prefix + "/"):
            if obj.endswith("/" + MANIFEST):
                keys.append(TemplateCacheKey.from_dict(json.loads(self.store.get(obj))["key"]))
        return keys

    def delete(self, key: TemplateCacheKey) -> int:
        """Remove a template's cache (manifest first, so readers never see a half-deleted one)."""
        had_manifest = self.store.exists(self.manifest_object(key))
        self.store.delete(self.manifest_object(key))
        self._forget_manifest(key)
        return self.store.delete_prefix(self._dir(key)) + int(had_manifest)
