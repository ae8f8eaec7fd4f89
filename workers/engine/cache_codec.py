"""Storage codec of template activation caches, independent of the compute dtype.

Why: a float32 SD-class cache is ~2 GiB per template (BENCHMARKS.md), so a 2 GiB host tier holds
one template and every load moves 4 bytes per value. The codec decides what a step object holds;
the host-RAM tier keeps those (compressed) bytes, so it holds more templates, and tensors are
decoded only when a step or unit is handed to the model (``decode``: the compressed bytes are
moved to the compute device first, then dequantized there, i.e. where staging is cheapest).

Codecs (``STENCIL_CACHE_DTYPE``):
- ``float32``: lossless for float32/float16/bfloat16 compute; exact-region warm-ups are stored in
  the dtype they were recorded in (``lossless_codec``), also lossless.
- ``float16`` / ``bfloat16``: every tensor cast to 16 bits.
- ``int8``: attention K/V (names ending ``.k``, ``.k_roped``, ``.v``) quantized symmetrically to
  8 bits with one float32 scale per channel (last dim) per row, computed over the tokens (the axis
  before the last): K/V have per-channel outliers (KIVI, Liu et al. 2024, section 3), which
  per-channel scales absorb. Other tensors (UNet block outputs ``.y``, Flux ``output``) are kept
  in 16 bits: float16 (more mantissa), bfloat16 for a tensor whose values exceed float16's range.
  The scales travel in the same tensor: ``[..., N, C]`` int8 values followed by ``[..., 4, C]``
  bytes of the float32 scales (``[..., N + 4, C]`` int8), so every cached name is still one tensor
  and ranged unit reads, host-tier byte accounting and the plan's units need no change.

Decoding is selected by the stored dtype (int8 = packed quantized tensor), so a cache is
self-describing; the manifest also records the codec (``"codec"``) for the job record.

Shared CFG rows (``share_rows``). A cached tensor's leading axis holds the job's rows (2 with
classifier-free guidance: uncond, cond). Template warm-ups record with prompt "" and negative
prompt "", so both rows see bit-identical inputs and their activations are usually bit-identical:
storing them twice doubles host-tier, link and store bytes. After encoding, a tensor whose stored
rows are all bit-equal (compared as raw bytes: ``torch.equal`` would take -0.0 for 0.0 and never
NaN for NaN) is stored with one row; rows that differ in any bit are stored in full, so this is
lossless with respect to the codec. A cache records its row count ``rows`` (manifest and object
metadata, ``CacheRecorder``); every tensor of such a cache was recorded with ``rows`` rows, so a
stored tensor with one row where ``rows`` > 1 is a shared one, and decoding expands it back
(``expand_rows``: a zero-copy ``expand``; consumers only read cached tensors, copying them before
any write, ``workers/maskaware/unet.py`` ``_with_fresh``). int8 tensors keep their scales
per row, so a shared row's scales are those of every row. The stored tensor is still one tensor
per name, so ranged unit reads, host-tier byte accounting (the bytes actually held) and the
plan's units need no change; predicted sizes take the shared names (``stored_nbytes(shared=True)``,
``MaskAwareUNet.unit_nbytes(shared=...)``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

CODECS = ("float32", "float16", "bfloat16", "int8")
SCALE_ROWS = 4  # bytes of one float32 scale: rows appended along the token axis
_KV_SUFFIXES = (".k", ".k_roped", ".v")
_FP16_MAX = float(torch.finfo(torch.float16).max)


def rows_equal(t: torch.Tensor) -> bool:
    """True if ``t`` has more than one row (leading axis) and every row is bit-equal to the first."""
    if t.dim() == 0 or t.shape[0] < 2:
        return False
    raw = t.detach().contiguous().reshape(t.shape[0], -1)
    if raw.is_floating_point() or raw.is_complex():  # raw bytes: -0.0 != 0.0, NaN == same NaN
        raw = raw.view(torch.uint8)
    return all(torch.equal(raw[0], raw[i]) for i in range(1, raw.shape[0]))


def share_rows(tensors: Mapping[str, torch.Tensor], rows: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Stored tensors with bit-equal rows kept once (``[rows, ...]`` -> ``[1, ...]``), and the
    names so stored. Every tensor must have ``rows`` rows: a one-row tensor is read as shared."""
    if any(t.dim() == 0 or t.shape[0] != rows for t in tensors.values()):
        raise ValueError(f"every tensor of a {rows}-row cache needs {rows} rows on its leading axis")
    out, shared = {}, []
    for name, t in tensors.items():
        if rows > 1 and rows_equal(t):
            out[name] = t[:1].clone()
            shared.append(name)
        else:
            out[name] = t
    return out, shared


def is_shared(t: torch.Tensor, rows: int) -> bool:
    """A stored tensor holds one shared row: one row in a cache of ``rows`` > 1 rows."""
    return rows > 1 and t.dim() > 0 and t.shape[0] == 1


def expand_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A shared-row tensor as its ``rows`` rows: a zero-copy view (read-only use); any other
    tensor as it is."""
    return t.expand(rows, *t.shape[1:]) if is_shared(t, rows) else t


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"cache codec must be one of {CODECS}, got {codec!r}")
    return codec


def lossless_codec(layout: str) -> str:
    """The codec that stores a recording bit for bit: its compute dtype, which a cache layout names
    after ``@`` when it is not float32 (``workers/cpu_tasks.py``)."""
    recorded_in = layout.split("/")[0].partition("@")[2]
    return recorded_in if recorded_in in ("float16", "bfloat16") else "float32"


def is_kv(name: str) -> bool:
    return name.endswith(_KV_SUFFIXES)


def _sixteen(t: torch.Tensor) -> torch.Tensor:
    """16-bit storage: float16 unless a value would overflow it (then bfloat16's range)."""
    if t.numel() and float(t.detach().abs().amax()) >= _FP16_MAX:
        return t.to(torch.bfloat16)
    return t.to(torch.float16)


def quantize(t: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with per-channel (last dim) scales over the token axis, scales packed after
    the values: ``[..., N, C]`` -> ``[..., N + 4, C]`` int8."""
    if t.dim() < 2:
        raise ValueError("int8 cache tensors need a token and a channel axis")
    x = t.detach().to(torch.float32)
    absmax = x.abs().amax(dim=-2, keepdim=True)  # [..., 1, C]
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    c = x.shape[-1]
    packed_scale = scale.contiguous().view(torch.int8).reshape(*x.shape[:-2], SCALE_ROWS, c)
    return torch.cat([q, packed_scale], dim=-2).contiguous()


def dequantize(t: torch.Tensor, dtype: torch.dtype = torch.float32, rows: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``quantize`` (values within half a quantization step per channel), in one kernel:
    the int8 values times their float32 scales, rounded once to ``dtype`` (what
    ``(q.float() * scale).to(dtype)`` gives, bit for bit). ``rows``: a shared row is expanded to
    the cache's rows; ``out``: written there (the staged slot), else into a new tensor."""
    q, scale = _quantized_parts(t)
    if is_shared(t, rows):
        q, scale = q.expand(rows, *q.shape[1:]), scale.expand(rows, *scale.shape[1:])
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=t.device)
    return torch.mul(q, scale, out=out)


def _quantized_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values ``[..., N, C]``, float32 scales ``[..., 1, C]``) of a quantized tensor: views
    where the scale rows' bytes allow one (no copy), else a copy of the scales."""
    c = t.shape[-1]
    packed = t[..., -SCALE_ROWS:, :].reshape(*t.shape[:-2], 1, SCALE_ROWS * c)
    try:
        scale = packed.view(torch.float32)
    except RuntimeError:  # not 4-byte aligned or not contiguous along the channels: a fresh copy is
        scale = packed.clone(memory_format=torch.contiguous_format).view(torch.float32)  # (contiguous() may not copy)
    return t[..., :-SCALE_ROWS, :], scale


def encode_tensor(name: str, t: torch.Tensor, codec: str) -> torch.Tensor:
    """What the store holds for one cached tensor under ``codec``."""
    if codec == "float32":
        return t.to(torch.float32) if t.is_floating_point() else t
    if codec == "float16":
        return t.to(torch.float16)
    if codec == "bfloat16":
        return t.to(torch.bfloat16)
    if codec == "int8":
        return quantize(t) if is_kv(name) and t.dim() >= 2 else _sixteen(t)
    raise ValueError(f"unknown cache codec {codec!r}")


def encode(tensors: Mapping[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    check_codec(codec)
    return {n: encode_tensor(n, t, codec) for n, t in tensors.items()}


def decode_tensor(t: torch.Tensor, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None, rows: int = 0) -> torch.Tensor:
    """A stored tensor in the compute dtype on ``device`` (moved compressed, decoded there);
    ``rows``: the cache's row count (a shared row is decoded once, then expanded)."""
    if device is not None:
        t = t.to(device, non_blocking=True)
    if t.dtype == torch.int8:
        return expand_rows(dequantize(t, dtype), rows)
    return expand_rows(t.to(dtype), rows)


def decode_into(out: torch.Tensor, t: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``decode_tensor(t)`` written into ``out`` (its device and dtype; a staged cache's slot): the
    copy to the device, and for int8 one dequantizing kernel."""
    if t.dtype == torch.int8:
        return dequantize(t.to(out.device, non_blocking=True), out.dtype, rows, out=out)
    if is_shared(t, rows) and t.device != out.device:
        # the stored row to the device, then broadcast there: an expanded host tensor would be
        # made contiguous in pageable host memory first, and its copy would block the host
        out[:1].copy_(t, non_blocking=True)
        out[1:].copy_(out[:1].expand(rows - 1, *out.shape[1:]))
        return out
    return out.copy_(expand_rows(t, rows), non_blocking=True)


def decode_jobs_into(out: torch.Tensor, t: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``decode_into`` for several jobs' tensors of one layout at once: ``t`` ``[jobs, *stored]``
    on ``out``'s device (a strided view across the jobs' step buffers), ``out`` ``[jobs,
    *decoded]``; one kernel for every job (int8: dequantizing; 16 bits: a converting copy), the
    values of decoding each job's tensor alone, bit for bit."""
    shared = rows > 1 and t.shape[1] == 1
    if t.dtype == torch.int8:
        q, scale = _quantized_parts(t)
        if shared:
            q, scale = q.expand(-1, rows, *q.shape[2:]), scale.expand(-1, rows, *scale.shape[2:])
        return torch.mul(q, scale, out=out)
    return out.copy_(t.expand(-1, rows, *t.shape[2:]) if shared else t)


def decoded_shape(t: torch.Tensor, rows: int = 0) -> tuple[int, ...]:
    """The shape ``decode_tensor`` gives a stored tensor (int8: without its scale rows; a shared
    row: ``rows`` rows)."""
    shape = list(t.shape)
    if t.dtype == torch.int8:
        shape[-2] -= SCALE_ROWS
    if is_shared(t, rows):
        shape[0] = rows
    return tuple(shape)


def needs_decode(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, rows: int = 0,
                 device: torch.device | str | None = None) -> bool:
    """False when every tensor is already in the compute dtype (float32 storage of float32
    compute) on the compute device and none holds shared rows: then the stored tensors are handed
    over as they are (bit for bit, no copy)."""
    where = None if device is None else torch.device(device)
    return any(t.dtype != dtype or is_shared(t, rows) or (where is not None and not _on(t, where))
               for t in tensors.values())


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class DecodedStep(Mapping[str, torch.Tensor]):
    """A read-only view of stored step tensors that decodes each name on first access."""

    def __init__(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, rows: int = 0) -> None:
        self.stored = stored
        self.dtype = dtype
        self.device = device
        self.rows = rows
        self._decoded: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._decoded.get(name)
        if t is None:
            t = self._decoded[name] = decode_tensor(self.stored[name], self.dtype, self.device, self.rows)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.stored

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)


def decoded(stored: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None, rows: int = 0) -> Mapping[str, torch.Tensor]:
    """``stored`` itself if nothing needs decoding, else a lazily decoding view (``rows``: the
    cache's row count, for shared rows; 0 = none shared)."""
    if not needs_decode(stored, dtype, rows, device):
        return stored
    return DecodedStep(stored, dtype, device, rows)


def stored_nbytes(shape: tuple[int, ...], name: str, codec: str, shared: bool = False) -> int:
    """Bytes one cached tensor of ``shape`` takes under ``codec`` (int8: + 4 scale bytes per
    channel per row; 16-bit tensors beside it); ``shared``: its rows are stored once."""
    if shared and shape:
        shape = (1, *shape[1:])
    numel = 1
    for d in shape:
        numel *= d
    if codec == "float32":
        return 4 * numel
    if codec in ("float16", "bfloat16"):
        return 2 * numel
    if codec == "int8":
        if is_kv(name) and len(shape) >= 2:
            return numel + SCALE_ROWS * (numel // shape[-2])
        return 2 * numel
    raise ValueError(f"unknown cache codec {codec!r}")


__all__ = ["CODECS", "DecodedStep", "check_codec", "decode_jobs_into", "decode_tensor", "decoded", "decoded_shape",
           "dequantize", "encode", "encode_tensor", "expand_rows", "is_kv", "is_shared", "needs_decode", "quantize",
           "rows_equal", "share_rows", "stored_nbytes"]
