"""Host tensors onto the engine's device without waiting for the device.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory synchronises the stream: the host
waits for every kernel queued before the copy. On the engine thread that is the step in flight, so
admitting a job (or building its indices) would stall the pipeline the late read keeps full
(``workers/engine/settle.py``).
From pinned memory the copy is queued like a kernel and the host goes on; the caching host allocator
keeps the pinned block until the copy has run. Elsewhere (the CPU) a tensor is converted as usual.
"""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor.to(device, dtype)``, queued without a wait where ``device`` is a GPU."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, dtype) if dtype is not None else tensor.to(device)
    host = tensor if tensor.is_pinned() else tensor.pin_memory()
    return host.to(device, dtype, non_blocking=True) if dtype is not None else host.to(device, non_blocking=True)


__all__ = ["upload"]
