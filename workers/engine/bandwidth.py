"""How fast a step reads a cached unit from host RAM onto its compute device, measured once.

A template warm-up stores the plan units worth loading (``runner_base._select_units``): a unit's
load must cost less than the compute its cache saves. A step reads its cache from the host-RAM
tier (prefetch hides the object store behind waiting and earlier steps), so the price of a load is
this copy: pinned host memory to the GPU over its bus, or a memory copy where the device is the
CPU. The store's own speed only decides how early to prefetch (``template_cache``).
"""

from __future__ import annotations

import functools
import time

import torch

PROBE_BYTES = 64 << 20


@functools.lru_cache(maxsize=8)
def host_read_gbps(device: str) -> float:
    """Measured GB/s of copying cached bytes from host RAM to ``device`` (median of 5)."""
    dev = torch.device(device)
    n = PROBE_BYTES // 4
    if dev.type == "cuda" and torch.cuda.is_available():
        src = torch.empty(n, dtype=torch.float32, pin_memory=True)
        dst = torch.empty(n, dtype=torch.float32, device=dev)
        times = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = sorted(times[1:])[2]
    else:
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        seconds = sorted(times[1:])[2]
    return PROBE_BYTES / max(seconds, 1e-9) / 1e9


__all__ = ["host_read_gbps"]
