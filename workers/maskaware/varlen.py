"""Attention of a ragged slab: every batch row's masked queries against that row's keys, in one call.

Why: a batch of masked jobs has a different query count per row. Attended run by run (jobs of
close counts padded together, ``batched.py``), the step's shapes name every job's count, so a
captured CUDA graph serves only the batch it was captured for, and under continuous batching
almost every step is a new batch. A variable-length attention kernel reads the per-row query
extents (``cu_q``: cumulative counts) from the device, so the call's shapes are the slab's total
query rows and its rows alone, and one call serves every row.

Kernels: on CUDA, FlashAttention-2's variable-length forward (``aten._flash_attention_forward``
with cumulative sequence lengths, what ``torch.nn.attention.varlen`` wraps) for 16-bit inputs on
Ampere or newer, the memory-efficient kernel's (``aten._efficient_attention_forward``) otherwise. Elsewhere (the CPU: no
such kernel) each row is attended with SDPA over extents read from ``cu_q``: a host read, free on
the CPU, which keeps graph stand-ins (``graphs.EagerReplay``) exact when they replay another
composition of the same shapes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)
HEAD_ALIGN = 8  # head sizes the CUDA kernels take (16-bit elements: 16-byte loads)


def device_kernel(device: torch.device) -> bool:
    """Whether ``device`` has a variable-length attention kernel (graph-safe: extents on the device)."""
    return device.type == "cuda"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, heads: int, max_q: int,
           memo: dict | None = None) -> torch.Tensor:
    """``q`` [T, C] (the rows' queries, packed in row order), ``k``/``v`` [R, L, C] (each row's keys),
    ``cu_q`` [R + 1] (row r's queries are ``q[cu_q[r]:cu_q[r + 1]]``, ``cu_q[R] == T``) -> [T, C].
    ``max_q``: a bound on any row's queries (the level's tokens: a fixed shape, not the batch's
    largest count). ``memo``: per-call cache of the int32 extents (a level's blocks share them)."""
    rows, length, width = k.shape
    hd = width // heads
    if device_kernel(q.device):
        cu_q32, cu_k32 = _extents(cu_q, rows, length, memo)
        qh = q.view(-1, heads, hd)
        kh = k.reshape(rows * length, heads, hd)
        vh = v.reshape(rows * length, heads, hd)
        if hd % HEAD_ALIGN:
            # Both kernels need a head size (and head stride) of a multiple of 8 in 16-bit: zero
            # columns change no dot product and give zero output columns, cut off again.
            pad = HEAD_ALIGN - hd % HEAD_ALIGN
            qh, kh, vh = (F.pad(t, (0, pad)) for t in (qh, kh, vh))
        scale = hd ** -0.5
        if q.dtype in FLASH_DTYPES and qh.shape[-1] <= 256 and _flash_capable(q.device):
            out = torch.ops.aten._flash_attention_forward(
                qh, kh, vh, cu_q32, cu_k32, max_q, length, 0.0, False, False, scale=scale)[0]
        else:
            out = torch.ops.aten._efficient_attention_forward(
                qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), None, cu_q32, cu_k32, max_q, length,
                0.0, 0, scale=scale)[0].squeeze(0)
        return out[..., :hd].reshape(-1, width).to(q.dtype)
    bounds = cu_q.tolist()  # the CPU: a free read (module doc)
    out = torch.empty_like(q)
    for r in range(rows):
        lo, hi = bounds[r], bounds[r + 1]
        if hi == lo:
            continue
        qh = q[lo:hi].view(1, hi - lo, heads, hd).transpose(1, 2)
        kh = k[r:r + 1].view(1, length, heads, hd).transpose(1, 2)
        vh = v[r:r + 1].view(1, length, heads, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=None, dropout_p=0.0, is_causal=False)
        out[lo:hi] = o.transpose(1, 2).reshape(hi - lo, width)
    return out


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    """FlashAttention-2 runs on Ampere (compute capability 8.0) and newer."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _extents(cu_q: torch.Tensor, rows: int, length: int,
             memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``cu_q`` as int32, ``[0, L, 2L, ..., R L]`` as int32) on the device, made once per call."""
    key = (cu_q.data_ptr(), cu_q.storage_offset(), rows, length)
    hit = None if memo is None else memo.get(key)
    if hit is None:
        cu_k = torch.arange(0, (rows + 1) * length, length, device=cu_q.device, dtype=torch.int32)
        hit = (cu_q.to(torch.int32), cu_k)
        if memo is not None:
            memo[key] = hit
    return hit


__all__ = ["attend", "device_kernel"]
