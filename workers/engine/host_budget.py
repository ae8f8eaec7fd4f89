"""The host-RAM tier's byte budget when ``STENCIL_HOST_CACHE_BYTES=0`` (auto): from the machine.

Why: a fixed 2 GiB held one float32 SD-class template (BENCHMARKS.md), while GPU hosts have
tens to hundreds of GiB of RAM that would otherwise sit idle. Auto budget per GPU worker:

    budget = fraction * physical memory / workers_per_host - model weight bytes

clamped to at most available memory (``MemAvailable``) minus a reserve, and to at least
``floor`` bytes. ``fraction`` (the service's: 0.5, ``workers.gpu_tasks.HOST_CACHE_FRACTION``) leaves the other half
to the OS page cache, Celery CPU tasks (VAE, text encoders) and the worker's own buffers; the
model's weights are subtracted because on a CPU device they live in the same RAM (on a GPU host
they are staged through it at load). ``workers_per_host``: one GPU worker per visible device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

GiB = 1024**3
RESERVE_BYTES = 1 * GiB  # left free beside the budget whatever the fraction says
FLOOR_BYTES = 256 * 1024**2  # a budget below one step of a large model is useless; never less


def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(physical, available) memory in bytes (Linux ``/proc/meminfo``; sysconf elsewhere)."""
    try:
        fields = {}
        for line in Path(path).read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
        total = fields["MemTotal"]
        return total, fields.get("MemAvailable", total)
    except (OSError, KeyError, ValueError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else pages
        return pages * size, avail * size


def weight_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the parameters and buffers of ``modules``."""
    total = 0
    for m in modules:
        total += sum(p.numel() * p.element_size() for p in m.parameters())
        total += sum(b.numel() * b.element_size() for b in m.buffers())
    return total


def auto_budget(total: int, available: int, weights: int, fraction: float = 0.5,
                workers_per_host: int = 1) -> int:
    """The module docstring's formula (pure: tests feed it numbers)."""
    if not 0 < fraction <= 1 or workers_per_host < 1:
        raise ValueError("fraction must be in (0, 1] and workers_per_host >= 1")
    share = int(fraction * total / workers_per_host) - weights
    cap = available - RESERVE_BYTES - weights
    return max(FLOOR_BYTES, min(share, cap))


def host_cache_budget(configured: int, fraction: float, modules: Iterable[torch.nn.Module] = (),
                      device: str = "cpu", meminfo: tuple[int, int] | None = None) -> int:
    """The host tier's budget: ``configured`` if > 0, else the auto budget (logged either way)."""
    if configured > 0:
        log.info("host cache budget %.2f GiB (configured)", configured / GiB)
        return configured
    total, available = meminfo if meminfo is not None else read_meminfo()
    weights = weight_bytes(modules)
    workers = torch.cuda.device_count() if device.startswith("cuda") and torch.cuda.is_available() else 1
    budget = auto_budget(total, available, weights, fraction, max(1, workers))
    log.info("host cache budget %.2f GiB (auto: %.2f x %.1f GiB physical / %d worker(s) - %.2f GiB weights, "
             "%.1f GiB available)", budget / GiB, fraction, total / GiB, workers, weights / GiB, available / GiB)
    return budget


__all__ = ["auto_budget", "host_cache_budget", "read_meminfo", "weight_bytes"]
