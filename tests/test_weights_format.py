"""The safetensors header check (``workers/weights_format.py``) against safetensors' own reader: it
accepts what the reader loads and refuses what it refuses, saying why; files that are not
safetensors are named for what they look like."""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save

from workers.weights_format import MalformedSafetensors, NotSafetensors, check_weights, read_header


def _file(header: dict[str, Any], data_bytes: int, *, pad: bytes = b"") -> bytes:
    text = json.dumps(header).encode() + pad
    return len(text).to_bytes(8, "little") + text + bytes(data_bytes)


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
I8_3 = {"dtype": "I8", "shape": [3], "data_offsets": [16, 19]}

VALID = {
    "two tensors": _file({"a": F32_2x2, "b": I8_3}, 19),
    "in any order": _file({"b": I8_3, "a": F32_2x2}, 19),
    "with metadata": _file({"__metadata__": {"format": "pt"}, "a": F32_2x2}, 16),
    "null metadata": _file({"__metadata__": None, "a": F32_2x2}, 16),
    "no tensors": _file({}, 0),
    "an empty tensor": _file({"e": {"dtype": "F16", "shape": [0, 4], "data_offsets": [0, 0]}, "a": F32_2x2}, 16),
    "a scalar": _file({"s": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]}}, 2),
    "header padded with spaces": _file({"a": F32_2x2}, 16, pad=b"   "),
}

INVALID = {
    "unknown dtype": (_file({"a": {**F32_2x2, "dtype": "F7"}}, 16), "unknown dtype 'F7'"),
    "shape against offsets": (_file({"a": {**F32_2x2, "shape": [2, 3]}}, 16), "is F32 [2, 3], 24 bytes"),
    "a gap": (_file({"a": F32_2x2, "b": {**I8_3, "data_offsets": [17, 20]}}, 20), "a gap or an overlap"),
    "an overlap": (_file({"a": F32_2x2, "b": {**I8_3, "data_offsets": [15, 18]}}, 18), "a gap or an overlap"),
    "offsets backwards": (_file({"a": {**F32_2x2, "data_offsets": [16, 0]}}, 16), "not [begin, end]"),
    "negative size": (_file({"a": {**F32_2x2, "shape": [-2, -2]}}, 16), "not a list of sizes"),
    "bytes past the tensors": (_file({"a": F32_2x2}, 17), "its tensors take 16 bytes, 17 follow the header"),
    "tensors past the end": (_file({"a": F32_2x2}, 15), "its tensors take 16 bytes, 15 follow the header"),
    "header past the end": (b"\x00\x01" + bytes(6) + b"{}", "its header is 256 bytes, the file has 2"),
    "header over 100 MB": ((10 ** 9).to_bytes(8, "little") + b"{}", "over safetensors' 100000000-byte limit"),
    "not an object": (_file([1, 2], 0), "not a JSON object"),  # type: ignore[arg-type]
    "not JSON": (b"\x04" + bytes(7) + b"{a:1", "not JSON"),
    "not UTF-8": (b"\x04" + bytes(7) + b'{"\xff"', "not UTF-8"),
    "nested too deeply": (b"\x40\x0d\x03" + bytes(5) + b"[" * 200_000, "nested too deeply"),
    "metadata values": (_file({"__metadata__": {"n": 1}}, 0), "does not map strings to strings"),
    "a tensor that is a string": (_file({"a": "F32"}, 0), "is not described by an object"),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_headers_are_read_as_safetensors_reads_them(name: str, tmp_path: Path) -> None:
    path = _written(tmp_path / "f.safetensors", VALID[name])
    header = read_header(VALID[name])
    with safe_open(str(path), "pt") as fh:
        theirs = {k: (fh.get_slice(k).get_dtype(), tuple(fh.get_slice(k).get_shape())) for k in fh.keys()}
        assert header.metadata == (fh.metadata() or {})
    assert {k: (v.dtype, v.shape) for k, v in header.tensors.items()} == theirs
    assert read_header(path) == header   # from a path, only the header is read


@pytest.mark.parametrize("name", INVALID)
def test_inconsistent_headers_are_refused_as_safetensors_refuses_them(name: str) -> None:
    data, reason = INVALID[name]
    with pytest.raises(MalformedSafetensors, match=re.escape(reason)):
        read_header(data)
    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error types
        load(data)


def test_a_name_given_twice_is_refused() -> None:
    """Stricter than safetensors, which keeps one of them: the checks would see the other."""
    text = b'{"a": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}, ' \
           b'"a": {"dtype": "I8", "shape": [2], "data_offsets": [1, 3]}}'
    with pytest.raises(MalformedSafetensors, match="names 'a' twice"):
        read_header(len(text).to_bytes(8, "little") + text + bytes(3))


def test_refusals_name_other_formats(tmp_path: Path) -> None:
    cases: dict[str, tuple[bytes, str]] = {
        "empty": (b"", "an empty file"),
        "lfs": (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n", "a Git LFS pointer"),
        "html": (b"<!DOCTYPE html><html><body>Not found</body></html>", "an HTML page"),
        "zip": (_zipped({"model/weights.safetensors": save({"a": torch.zeros(1)})}), "a zip archive (unpack it)"),
        "pickle": (pickle.dumps({"a": 1}, protocol=4), "a pickle-based checkpoint (pickle protocol 4"),
    }
    for what, (data, reason) in cases.items():
        for source in (data, _written(tmp_path / what, data)):
            with pytest.raises(NotSafetensors, match=f"^f is {re.escape(reason)}.*, not a safetensors file: do y$"):
                check_weights(source, name="f", instead="do y")


def _zipped(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buf.getvalue()


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
