"""Online calibration of the step-time predictor: predictions x an EWMA of measured / predicted.

Why. The predictor is fitted offline (``stencil profile``) and the machine it serves drifts from
the fit: clocks and neighbours change, and the profile times each batch after a warm repeat while
the engine never repeats a batch (cold caches). On this CPU the engine's steps ran 2-23% slower
than the fresh fit predicted (``docs/bench/mixed_sizes.md``, predictor bias), so every SLO decision
(admit, refuse, defer) was made on optimistic finish times. A multiplicative factor learned from
the engine's own steps removes that bias without refitting; the fit still carries the shape
(which batch costs more than which). The factor is clamped so one outlier step (a page fault, a
descheduled thread) cannot swing it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

Predictor = Callable[[Sequence[Any]], float]
# How far measured steps may pull the fit (one outlier step cannot swing the factor beyond this).
BOUNDS = (0.5, 2.0)
# The service's EWMA weight per measured step (0 = the fit as is); ops/bench/mixed_sizes.py takes
# others as an option.
STEP_TIME_CALIBRATION = 0.05


class CalibratedStepTime:
    """``BatchScheduler(step_time=...)`` wrapper; the engine calls ``observe(batch, seconds)`` after
    each step. ``weight``: the EWMA weight of one step (0 = never corrects)."""

    def __init__(self, base: Predictor, weight: float, *, bounds: tuple[float, float] = BOUNDS) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"calibration weight must be in [0, 1], got {weight}")
        self.base = base
        self.weight = weight
        self.low, self.high = bounds
        self.factor = 1.0
        self.steps = 0
        self._lock = threading.Lock()
        sets = getattr(base, "predict_sets", None)
        if sets is not None:
            self.predict_sets = lambda jobs, subsets: sets(jobs, subsets) * self.factor

    def __call__(self, jobs: Sequence[Any]) -> float:
        return self.base(jobs) * self.factor

    def observe(self, jobs: Sequence[Any], seconds: float) -> None:
        """One measured step of ``jobs`` (the runner's step alone, on the predictor's clock)."""
        if not jobs or seconds <= 0.0 or self.weight == 0.0:
            return
        predicted = self.base(jobs)
        if predicted <= 0.0:
            return
        ratio = min(max(seconds / predicted, self.low), self.high)
        with self._lock:
            self.factor += self.weight * (ratio - self.factor)
            self.steps += 1


def calibrated(predictor: Predictor | None, weight: float) -> Predictor | None:
    """``predictor`` corrected online with EWMA ``weight`` (the engine's, the simulator's and the
    benchmark's one way to build it); as is when there is none or the weight is 0."""
    if predictor is None or weight <= 0.0:
        return predictor
    return CalibratedStepTime(predictor, weight)


__all__ = ["BOUNDS", "CalibratedStepTime", "calibrated"]
