"""What the GPU benchmarks share: the device to run on and its description, models with random
weights made on the device, a device clock, and the GPU's utilization sampled over a run."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from workers.models import true_size

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def device_of(args: Any) -> torch.device:
    """``--device``: auto = CUDA where available, else the CPU."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def hardware(device: torch.device) -> str:
    """The GPU (name, memory), CUDA, driver, torch and diffusers versions: what a report cites."""
    import diffusers

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, "
                f"driver {driver_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}")
    return f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, diffusers {diffusers.__version__}"


def driver_version() -> str:
    """The NVIDIA driver's version (``nvidia-smi``; torch does not expose it), '?' without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "?"
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out[0] if out else "?"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_on(comp: true_size.Component, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """The component with random weights made on ``device`` (PyTorch's default init there): seconds
    for a 12 B-parameter transformer, where a host init takes minutes."""
    model = true_size.build_meta(comp).to(dtype)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model = model.to_empty(device=device)
    for name, b in buffers.items():
        model.get_buffer(name).copy_(b)
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and any(True for _ in m.parameters(recurse=False)):
                reset()
            else:
                for pname, p in m.named_parameters(recurse=False):
                    if pname == "bias":
                        p.zero_()
                    elif p.dim() == 1:
                        p.fill_(1.0)
                    else:
                        p.normal_(std=0.02)
    return model.eval()


class Clock:
    """Device time of a call: CUDA events around ``reps`` calls (no host work in between besides
    the launches), or the host clock off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], reps: int = 1) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps




class UtilSampler:
    """The GPU's utilization as NVML defines it (the share of each sample period in which a kernel
    ran, from any process: the stack's workers are other processes), sampled by ``nvidia-smi`` every
    ``period_ms`` in the background. ``mean(t0, t1)``: over a window of epoch seconds; NaN off CUDA
    or without ``nvidia-smi``."""

    def __init__(self, device: torch.device, period_ms: int = 100) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen[str] | None = None
        exe = shutil.which("nvidia-smi")
        if device.type != "cuda" or exe is None:
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        index = device.index or 0
        gpu = visible.split(",")[index].strip() if visible else str(index)  # nvidia-smi's own numbering
        self.proc = subprocess.Popen([exe, "-i", gpu, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-lms", str(period_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        threading.Thread(target=self._read, name="nvidia-smi", daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip()) / 100.0))
            except ValueError:
                continue

    def mean(self, t0: float, t1: float) -> float:
        values = [v for t, v in list(self.samples) if t0 <= t <= t1]
        return sum(values) / len(values) if values else math.nan

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
