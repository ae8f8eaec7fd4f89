"""Online calibration of SLO admission's step-time predictor (app/calibration.py): the engine feeds
its measured steps back, and predictions converge to the machine's real step time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from app.calibration import STEP_TIME_CALIBRATION, CalibratedStepTime
from workers.engine.engine import Engine
from workers.engine.job import EngineJob
from workers.engine.scheduler import BatchScheduler


def _fit(jobs: Sequence[Any]) -> float:
    """An offline fit: 10 ms + 5 ms per job."""
    return 0.010 + 0.005 * len(jobs)


def test_predictions_converge_to_the_measured_step_time() -> None:
    cal = CalibratedStepTime(_fit, 0.1)
    jobs = [object()] * 4
    assert cal(jobs) == pytest.approx(0.030)
    for _ in range(100):  # this machine is 30% slower than the fit
        cal.observe(jobs, 1.3 * _fit(jobs))
    assert cal.factor == pytest.approx(1.3, rel=1e-3)
    assert cal([object()]) == pytest.approx(1.3 * 0.015, rel=1e-3)  # the fit's shape is kept


def test_outliers_are_clamped_and_weight_zero_keeps_the_fit() -> None:
    cal = CalibratedStepTime(_fit, 1.0)
    cal.observe([object()], 100.0)  # a descheduled thread: one absurd step
    assert cal.factor == 2.0
    off = CalibratedStepTime(_fit, 0.0)
    off.observe([object()], 1.0)
    assert off.factor == 1.0 and off.steps == 0
    with pytest.raises(ValueError, match="calibration weight"):
        CalibratedStepTime(_fit, 1.5)


def test_predict_sets_is_scaled_too() -> None:
    import numpy as np

    def base(jobs: Sequence[Any]) -> float:
        return 1.0

    base.predict_sets = lambda jobs, sets: np.ones(len(sets))  # type: ignore[attr-defined]
    cal = CalibratedStepTime(base, 1.0)
    cal.observe([object()], 1.5)
    assert list(cal.predict_sets([], [[0], [1]])) == [1.5, 1.5]


class _SlowRunner:
    """A runner whose every step takes 20 ms on the engine's (fake) clock."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def init_state(self, tensors: dict, meta: dict) -> dict:
        return {}

    def step(self, batch: list[EngineJob]) -> None:
        self.clock[0] += 0.020

    def result(self, job: EngineJob) -> str:
        return job.job_id


def test_the_engine_feeds_its_measured_steps_back() -> None:
    now = [0.0]
    cal = CalibratedStepTime(lambda jobs: 0.010, 0.5)  # the fit says 10 ms, the machine takes 20
    sched = BatchScheduler(4, "continuous", step_time=cal, clock=lambda: 1e9)
    engine = Engine(_SlowRunner(now), sched, clock=lambda: now[0])  # type: ignore[arg-type]
    engine.submit("j0", {}, {}, total_steps=6)
    engine._drain_inbox(block=False)
    while engine.step_once():
        pass
    assert cal.steps == 6 and cal.factor == pytest.approx(2.0, rel=0.05)


def test_the_service_default_corrects() -> None:
    assert 0.0 < STEP_TIME_CALIBRATION <= 0.2


def test_the_engine_publishes_its_factor_and_the_dispatcher_reads_it() -> None:
    from app.dispatcher import parse_worker_hash
    from workers.gpu_tasks import RedisEngineHooks

    cal = CalibratedStepTime(_fit, 1.0)
    cal.observe([object()], 1.25 * _fit([object()]))
    state = RedisEngineHooks("w0", 30.0, step_time=cal)._state([], [])
    assert parse_worker_hash("w0", state, now=0.0, stale_s=60.0, max_batch=8, known={}).step_time_factor \
        == pytest.approx(1.25)
    # Without SLO admission (no predictor) nothing is published and the fit is taken as is.
    plain = RedisEngineHooks("w1", 30.0)._state([], [])
    assert "step_time_factor" not in plain
    assert parse_worker_hash("w1", plain, now=0.0, stale_s=60.0, max_batch=8, known={}).step_time_factor == 1.0
