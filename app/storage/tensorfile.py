"""Safetensors objects with end-to-end integrity, readable one tensor at a time by ranged GETs.

Why: activation caches live in an object store and travel over networks and disks; a flipped
byte must never reach the model as a silently wrong activation. The file is plain safetensors
(any safetensors reader loads it), and its ``__metadata__`` adds:

- ``stencil.sha256.<name>``: sha256 of each tensor's raw little-endian bytes, checked on every
  read of that tensor, so a single-tensor ranged read is verified without reading the rest;
- ``stencil.header_sha256``: sha256 over the parsed header (names, dtypes, shapes, offsets, other
  metadata), so a corrupted dtype or shape (which leaves the tensor bytes intact) is caught too.

Reading never unpickles anything: bytes are only interpreted through the dtype table below.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from app.storage.base import ObjectStore

FORMAT = "stencil.tensorfile.v1"
_HASH_PREFIX = "stencil.sha256."
_HEADER_HASH = "stencil.header_sha256"
_FORMAT_KEY = "stencil.format"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_PREFETCH = 64 * 1024  # first ranged GET: length prefix and, usually, the whole header

if sys.byteorder != "little":  # safetensors is little-endian; raw views below assume it
    raise ImportError("tensorfile requires a little-endian host")

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class CorruptObject(ValueError):
    """The stored bytes do not match what was written (hash, size or header mismatch)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are, relative to the start of the object."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorHeader:
    """The parsed, verified header; pass it to ``read_tensor`` to skip re-reading it."""

    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def total_size(self) -> int:
        return self.data_start + sum(t.nbytes for t in self.tensors.values())


def _raw_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as safetensors stores them (contiguous, little-endian), no extra copy."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _header_digest(entries: Mapping[str, object], metadata: Mapping[str, str]) -> str:
    """Canonical digest of everything in the header except the digest itself."""
    meta = {k: v for k, v in metadata.items() if k != _HEADER_HASH}
    canonical = json.dumps({"t": entries, "m": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize ``tensors`` as safetensors bytes carrying per-tensor and header hashes.

    ``metadata`` (string to string) travels in the header, e.g. the cache-validity key.
    Tensors are laid out by descending element size, then name, so each one stays aligned.
    """
    user_meta = dict(metadata or {})
    for key, value in user_meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("metadata must map str to str")
        if key.startswith("stencil."):
            raise ValueError(f"metadata key {key!r} is reserved")
    views: dict[str, memoryview] = {}
    entries: dict[str, dict[str, object]] = {}
    meta: dict[str, str] = {_FORMAT_KEY: FORMAT, **user_meta}
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    offset = 0
    for name in order:
        tensor = tensors[name]
        if name == "__metadata__" or not isinstance(name, str):
            raise ValueError(f"invalid tensor name {name!r}")
        if tensor.dtype not in _NAMES:
            raise TypeError(f"unsupported dtype {tensor.dtype} for {name!r}")
        view = _raw_view(tensor)
        views[name] = view
        entries[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        meta[_HASH_PREFIX + name] = hashlib.sha256(view).hexdigest()
        offset += view.nbytes
    meta[_HEADER_HASH] = _header_digest(entries, meta)
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # keeps the data section 8-byte aligned
    return b"".join([struct.pack("<Q", len(header)), header, *(views[n] for n in order)])


def _parse_header(raw: bytes, header_len: int) -> TensorHeader:
    """Validate the JSON header's structure and digest; raise ``CorruptObject`` on any doubt."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptObject(f"header is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise CorruptObject("header is not a JSON object")
    meta = obj.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptObject("missing or malformed __metadata__")
    if meta.get(_FORMAT_KEY) != FORMAT:
        raise CorruptObject(f"not a {FORMAT} object (format={meta.get(_FORMAT_KEY)!r})")
    if meta.get(_HEADER_HASH) != _header_digest(obj, meta):
        raise CorruptObject("header digest mismatch")
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(f"malformed entry for {name!r}") from exc
        if dtype not in _DTYPES or not isinstance(shape, list):
            raise CorruptObject(f"bad dtype/shape for {name!r}")
        if not all(type(d) is int and d >= 0 for d in [*shape, begin, end]):
            raise CorruptObject(f"bad shape/offsets for {name!r}")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
        if end - begin != numel * itemsize:
            raise CorruptObject(f"size of {name!r} does not match its dtype and shape")
        digest = meta.get(_HASH_PREFIX + name)
        if digest is None:
            raise CorruptObject(f"no sha256 recorded for {name!r}")
        tensors[name] = TensorInfo(
            dtype, tuple(shape), data_start + begin, data_start + end, digest
        )
    # safetensors requires the data section to be covered exactly, without holes or overlaps.
    cursor = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != cursor:
            raise CorruptObject("tensor offsets overlap or leave holes")
        cursor = info.end
    hashed = {k[len(_HASH_PREFIX) :] for k in meta if k.startswith(_HASH_PREFIX)}
    if hashed != set(tensors):
        raise CorruptObject("hash entries do not match the tensors")
    user = {k: v for k, v in meta.items() if not k.startswith("stencil.")}
    return TensorHeader(data_start=data_start, tensors=tensors, metadata=user)


def _header_len(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise CorruptObject("object shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0 or n > _MAX_HEADER:
        raise CorruptObject(f"implausible header length {n}")
    return n


def _to_tensor(data: bytes | memoryview, info: TensorInfo, name: str) -> torch.Tensor:
    if len(data) != info.nbytes:
        raise CorruptObject(f"{name!r}: expected {info.nbytes} bytes, got {len(data)} (truncated)")
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise CorruptObject(f"{name!r}: sha256 mismatch")
    dtype = _DTYPES[info.dtype]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    # bytearray: a private, writable copy (frombuffer on immutable bytes would alias + warn).
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(info.shape)


def decode_header(data: bytes) -> TensorHeader:
    """Parse and verify the header of an in-memory tensorfile."""
    n = _header_len(data)
    if len(data) < 8 + n:
        raise CorruptObject("object shorter than its header")
    return _parse_header(data[8 : 8 + n], n)


def decode(data: bytes) -> dict[str, torch.Tensor]:
    """Verify and load every tensor of an in-memory tensorfile (e.g. bytes kept in Redis)."""
    header = decode_header(data)
    if len(data) != header.total_size:
        raise CorruptObject(f"object is {len(data)} bytes, header describes {header.total_size}")
    view = memoryview(data)
    return {
        name: _to_tensor(view[info.start : info.end], info, name)
        for name, info in header.tensors.items()
    }


def read_header(store: ObjectStore, key: str) -> TensorHeader:
    """Read the header with ranged GETs: one speculative 64 KiB read, a second if it is larger."""
    prefix = store.get(key, 0, _PREFETCH)
    n = _header_len(prefix)
    raw = prefix[8 : 8 + n]
    if len(raw) < n and len(prefix) == _PREFETCH:
        raw += store.get(key, len(prefix), 8 + n)
    if len(raw) != n:
        raise CorruptObject(f"{key}: object shorter than its header")
    return _parse_header(raw, n)


def read_tensor(
    store: ObjectStore, key: str, name: str, header: TensorHeader | None = None
) -> torch.Tensor:
    """Read exactly one tensor's byte range and verify its hash.

    Raises ``KeyError`` if the (valid) file has no such tensor, ``CorruptObject`` on mismatch.
    """
    header = header or read_header(store, key)
    info = header.tensors.get(name)
    if info is None:
        raise KeyError(f"{key}: no tensor {name!r}")
    return _to_tensor(store.get(key, info.start, info.end), info, name)


def read_tensors(
    store: ObjectStore, key: str, names: list[str], header: TensorHeader | None = None
) -> dict[str, torch.Tensor]:
    """Read several tensors with one ranged GET per contiguous run of their bytes.

    Why: a plan unit's tensors (one transformer's K/V/Y) sit next to each other in the file
    (names share a prefix and the layout is sorted by name), so a unit costs one request, not
    one per tensor; each tensor is still verified by its own hash.
    """
    header = header or read_header(store, key)
    infos = []
    for name in names:
        info = header.tensors.get(name)
        if info is None:
            raise KeyError(f"{key}: no tensor {name!r}")
        infos.append((info.start, info.end, name, info))
    infos.sort()
    out: dict[str, torch.Tensor] = {}
    i = 0
    while i < len(infos):
        j = i
        while j + 1 < len(infos) and infos[j + 1][0] == infos[j][1]:
            j += 1
        begin, end = infos[i][0], infos[j][1]
        data = memoryview(store.get(key, begin, end))
        for start, stop, name, info in infos[i : j + 1]:
            out[name] = _to_tensor(data[start - begin : stop - begin], info, name)
        i = j + 1
    return {name: out[name] for name in names}


def read_all(store: ObjectStore, key: str) -> dict[str, torch.Tensor]:
    """One GET of the whole object, every tensor verified."""
    try:
        return decode(store.get(key))
    except CorruptObject as exc:
        raise CorruptObject(f"{key}: {exc}") from exc


__all__ = [
    "CorruptObject",
    "FORMAT",
    "TensorHeader",
    "TensorInfo",
    "decode",
    "decode_header",
    "encode",
    "read_all",
    "read_header",
    "read_tensor",
    "read_tensors",
]
