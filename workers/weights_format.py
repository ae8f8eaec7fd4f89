"""What an uploaded weights file is: safetensors (its header checked as safetensors checks it) or,
only when it is not, what it looks like, for a refusal that says what to upload instead.

Every path that receives weights from users asks this module first: LoRA adapters
(``workers/adapters/convert.py``), ControlNets (``workers/controlnets/registry.py``) and
single-file checkpoints (``workers/models/loader.py``). A file is safetensors when its header
parses the way safetensors' own reader requires (``SafeTensors::read_metadata``): an 8-byte
little-endian length within the file and under 100 MB, a UTF-8 JSON object whose optional
``__metadata__`` maps strings to strings and whose other entries are tensors with a known dtype,
a shape whose byte size is their ``data_offsets`` span, and spans that tile the data section with
no gap or overlap up to the file's last byte (stricter than safetensors: no name twice). Magic
bytes are looked at only after that fails: the first byte of a valid file is the low byte of its
header length, and a length ending in 0x80 begins like a pickle, so sniffing first refused one
valid file in 256.

Nothing here unpickles or extracts anything: a zip is only listed, to tell a torch.save checkpoint
(``archive/data.pkl`` inside) from other archives.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
_SNIFF_BYTES = 64 * 1024         # what is read of a file that is not safetensors, to say what it is

# Bits per element of every dtype safetensors reads (safetensors/src/tensor.rs, ``Dtype::bitsize``).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

# What legacy (non-zip) torch.save writes first: protocol 2, then the pickled magic number.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]  # relative to the end of the header, as in the file


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked header: every tensor's entry and the ``__metadata__`` strings."""

    header_bytes: int  # the JSON header's length, the value of the 8-byte prefix
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


class MalformedSafetensors(ValueError):
    """The bytes do not parse as safetensors; the message says where they stop doing so."""

    def __init__(self, reason: str, *, truncated: bool = False) -> None:
        super().__init__(reason)
        self.truncated = truncated


class NotSafetensors(ValueError):
    """A refused upload: the message names the file, what it looks like and what to upload instead."""


def check_weights(source: bytes | Path, *, name: str, instead: str,
                  error: type[ValueError] = NotSafetensors) -> SafetensorsHeader:
    """The header of ``source`` (the file's bytes, or its path: then only the header is read), or
    ``error`` (the receiving path's refusal): "<name> is <what it looks like>: <instead>"."""
    try:
        return read_header(source)
    except MalformedSafetensors as exc:
        raise error(f"{name} is {looks_like(source, exc)}: {instead}") from None


def read_header(source: bytes | Path) -> SafetensorsHeader:
    """The checked header of a safetensors file, or ``MalformedSafetensors`` saying why not."""
    if isinstance(source, Path):
        size = source.stat().st_size
        with open(source, "rb") as fh:
            prefix = fh.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            if n <= MAX_HEADER_BYTES and 8 + n <= size:
                prefix += fh.read(n)
        return parse_header(prefix, size)
    return parse_header(bytes(source), len(source))


def parse_header(prefix: bytes, size: int) -> SafetensorsHeader:
    """Check the header at the start of ``prefix`` (at least the length and the header) of a file
    of ``size`` bytes, as safetensors' reader does."""
    if size < 8:
        raise MalformedSafetensors(f"{size} bytes, shorter than the 8-byte header length", truncated=True)
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise MalformedSafetensors(f"header length {n} is over safetensors' {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        raise MalformedSafetensors(f"its header is {n} bytes, the file has {size - 8} after the length",
                                   truncated=True)
    try:
        header = json.loads(prefix[8:8 + n].decode("utf-8"), object_pairs_hook=_unique_keys)
    except MalformedSafetensors:
        raise
    except UnicodeDecodeError:
        raise MalformedSafetensors("its header is not UTF-8") from None
    except ValueError as exc:
        raise MalformedSafetensors(f"its header is not JSON: {exc}") from None
    except RecursionError:
        raise MalformedSafetensors("its header is not JSON that can be read (nested too deeply)") from None
    if not isinstance(header, dict):
        raise MalformedSafetensors("its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise MalformedSafetensors("its __metadata__ does not map strings to strings")
    tensors = {name: _entry(name, info) for name, info in header.items()}
    end = 0
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].data_offsets):
        begin, stop = t.data_offsets
        if begin != end:
            raise MalformedSafetensors(f"tensor {_short(name)} starts at byte {begin} of the data, the tensors "
                                       f"before it end at {end} (a gap or an overlap)")
        end = stop
    data = size - 8 - n
    if end != data:
        raise MalformedSafetensors(f"its tensors take {end} bytes, {data} follow the header", truncated=end > data)
    return SafetensorsHeader(n, tensors, dict(metadata))


def looks_like(source: bytes | Path, error: MalformedSafetensors) -> str:
    """What a file that is not safetensors (``error`` says why not) looks like, for a refusal."""
    if isinstance(source, Path):
        size = source.stat().st_size
        with open(source, "rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    else:
        size, head = len(source), bytes(source[:_SNIFF_BYTES])
    if size and _begins_like_safetensors(head):
        return f"a {'truncated' if error.truncated else 'damaged'} safetensors file ({error})"
    return f"{_other_format(source, head)}, not a safetensors file"


def _other_format(source: bytes | Path, head: bytes) -> str:
    if not head:
        return "an empty file"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return _zip_kind(source)
    if head.startswith(_LEGACY_TORCH_MAGIC):
        return "a pickle-based checkpoint (legacy torch.save format: loading it can run code)"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a pickle-based checkpoint (pickle protocol {head[1]}: loading it can run code)"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer (the weights themselves were not downloaded: `git lfs pull`)"
    if head.lstrip()[:15].lower().startswith((b"<!doctype html", b"<html")):
        return "an HTML page (a download that saved a web page?)"
    return "a file of unknown format"


def _begins_like_safetensors(head: bytes) -> bool:
    """A plausible header length followed by the start of a JSON object: a damaged safetensors file."""
    n = int.from_bytes(head[:8], "little") if len(head) >= 9 else 0
    return 2 <= n <= MAX_HEADER_BYTES and head[8:].lstrip(b" \t\r\n")[:1] == b"{"


def _zip_kind(source: bytes | Path) -> str:
    try:
        with zipfile.ZipFile(source if isinstance(source, Path) else io.BytesIO(source)) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return "a damaged zip archive"
    if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        return "a pickle-based checkpoint (zip-based torch.save format, a pickle inside: loading it can run code)"
    return "a zip archive (unpack it)"


def _entry(name: str, info: Any) -> TensorEntry:
    if not isinstance(info, dict):
        raise MalformedSafetensors(f"tensor {_short(name)} is not described by an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise MalformedSafetensors(f"tensor {_short(name)} has an unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_size(d) for d in shape):
        raise MalformedSafetensors(f"tensor {_short(name)} has a shape that is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_size(d) for d in offsets)
            and offsets[0] <= offsets[1]):
        raise MalformedSafetensors(f"tensor {_short(name)} has data_offsets that are not [begin, end]")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise MalformedSafetensors(f"tensor {_short(name)} is {dtype} {shape}, {bits / 8:g} bytes, but its "
                                   f"data_offsets span {offsets[1] - offsets[0]}")
    return TensorEntry(dtype, tuple(shape), (offsets[0], offsets[1]))


def _size(value: Any) -> bool:
    return type(value) is int and value >= 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects without repeated keys (which entry would count is the reader's guess)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise MalformedSafetensors(f"its header names {_short(key)} twice")
        out[key] = value
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "MalformedSafetensors", "NotSafetensors", "SafetensorsHeader",
           "TensorEntry", "check_weights", "looks_like", "parse_header", "read_header"]
