"""Clocks, the side-by-side runner, and the statistics the reports give.

The machine is shared: configurations are measured interleaved (every config once per round, in
a new shuffled order each round) so that drifting load hits all of them alike, and compared as
paired ratios (each sample against its partner of the same round).
"""

from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# cpu: with one torch thread all work runs on the calling thread, so its CPU time counts the work
# done and ignores time lost to other processes; wall time measures the neighbours too.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK_TEXT = {"wall": "wall time (perf_counter)",
              "cpu": "CPU time of the single compute thread (thread_time), insensitive to other load"}


def interleave(rounds: int, configs: Sequence[K], measure: Callable[[K], T], *, rng: random.Random | None = None,
               label: str = "") -> dict[K, list[T]]:
    """Samples per config: each measured once per round, in a new shuffled order per round with ``rng``."""
    samples: dict[K, list[T]] = {c: [] for c in configs}
    for rnd in range(rounds):
        order = list(configs)
        if rng is not None:
            rng.shuffle(order)
        for c in order:
            samples[c].append(measure(c))
        log.info("%sround %d/%d done (load %s)", label, rnd + 1, rounds, loadavg())
    return samples


def median(xs: Iterable[float]) -> float:
    """Median, NaN for no samples."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def paired(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of per-round ratios: robust to load that drifts between rounds."""
    return median(a / b for a, b in zip(num, den))


def linear_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares line through (x, y): slope, intercept, R^2."""
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * np.asarray(x) + intercept
    ss_res = float(((np.asarray(y) - pred) ** 2).sum())
    ss_tot = float(((np.asarray(y) - np.mean(y)) ** 2).sum())
    return float(slope), float(intercept), 1.0 - ss_res / ss_tot if ss_tot else 1.0


def loadavg() -> tuple[float, ...]:
    """The machine's load average (reports give it before and after a run)."""
    return tuple(round(v, 2) for v in os.getloadavg())


def uptime() -> str:
    """``uptime`` output (the machine load during a run)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name (sections of one report may come from different machines)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
