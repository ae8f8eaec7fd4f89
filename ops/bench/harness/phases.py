"""Where a job's time went, from its record: every transition stamps ``ts_<status>``
(``app/jobs.py``), so the time a job spent in a status is the next stamp minus its own.

A Stencil job passes queued -> routed -> preparing -> waiting -> denoising -> finalizing -> done
(stages on the GPU host: routed before prepared); the stock baseline worker queued -> routed ->
denoising -> done, its one pipeline call (text and VAE encodes, steps, decode) all in
``denoising``. The reports group the statuses into the phases below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

# phase -> the statuses whose time it sums
PHASES: dict[str, tuple[str, ...]] = {
    "queue": ("queued", "routed"),  # before any work: dispatch, the worker's or stage pool's queue
    "prepare": ("preparing",),  # text encoders, VAE encode, the cache plan
    "slot wait": ("waiting",),  # prepared, waiting for a place in the engine's batch
    "denoise": ("denoising",),  # the engine's steps (stock: the whole pipeline call)
    "finalize": ("finalizing",),  # VAE decode, paste-back, the result stored
}


def time_in_status(fields: Mapping[str, str]) -> dict[str, float]:
    """Seconds spent in each status the record's stamps show (the last stamp's status: none)."""
    stamps = sorted((float(v), k[3:]) for k, v in fields.items() if k.startswith("ts_") and v)
    return {status: round(t2 - t1, 6) for (t1, status), (t2, _) in zip(stamps, stamps[1:])}


def job_phases(fields: Mapping[str, str]) -> dict[str, float]:
    """Seconds per phase of ``PHASES`` that the job went through (absent phases left out)."""
    spent = time_in_status(fields)
    return {phase: sum(spent[s] for s in statuses if s in spent) for phase, statuses in PHASES.items()
            if any(s in spent for s in statuses)}


def mean_phases(rows: Iterable[Mapping[str, object]]) -> dict[str, float]:
    """Mean seconds per phase over rows (each with a ``phases`` dict), over the rows that have it."""
    per: dict[str, list[float]] = {}
    for row in rows:
        for phase, seconds in dict(row.get("phases") or {}).items():  # type: ignore[call-overload]
            per.setdefault(phase, []).append(float(seconds))
    return {phase: float(np.mean(per[phase])) for phase in PHASES if phase in per}


def phase_table(named: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Markdown rows: one per name, the mean seconds of each phase ('-' where a system has none)."""
    lines = ["| run | " + " | ".join(f"{p} s" for p in PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for name, means in named.items():
        cells = [f"{means[p]:.3f}" if p in means else "-" for p in PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


__all__ = ["PHASES", "job_phases", "mean_phases", "phase_table", "time_in_status"]
