"""Checking a configured torch device on this host, importing torch only: a process configured for
a device it lacks stops with the reason before it imports diffusers or loads a model."""

from __future__ import annotations

import torch


class DeviceUnavailable(RuntimeError):
    """A configured device this host does not have (e.g. ``cuda`` on a CPU-only host)."""


def resolve_device(name: str, setting: str = "STENCIL_DEVICE") -> torch.device:
    """The torch device named by a setting, checked to exist here: a process configured for a GPU it
    does not see stops with the reason instead of failing every job later."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceUnavailable(f"{setting}={name!r} is not a torch device name ({exc})") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"{setting}={name!r} but CUDA is not available on this host (torch "
                                    f"{torch.__version__}, {torch.cuda.device_count()} GPUs visible)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"{setting}={name!r} but only {torch.cuda.device_count()} GPUs are visible")
    elif device.type not in ("cpu", "mps", "xpu"):
        raise DeviceUnavailable(f"{setting}={name!r}: stages run on cpu, cuda[:N], mps or xpu")
    elif device.type != "cpu" and not getattr(torch, device.type).is_available():
        raise DeviceUnavailable(f"{setting}={name!r} but {device.type} is not available on this host")
    return device


__all__ = ["DeviceUnavailable", "resolve_device"]
