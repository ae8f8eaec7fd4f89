"""The mixed-size benchmark's paired rounds (``--rounds``): each round's (c)/(b) ratio is reported
from that round's own pair of replays, and the table's numbers are the means over the rounds."""

from __future__ import annotations

import pytest

from ops.bench.mixed_sizes import _mean_of_rounds, paired_rounds


def test_rounds_are_averaged_and_paired_round_by_round() -> None:
    b = _mean_of_rounds([{"throughput": 8.0, "slo": 0.5}, {"throughput": 6.0, "slo": 0.3}])
    c = _mean_of_rounds([{"throughput": 8.8, "slo": 0.4}, {"throughput": 5.7, "slo": 0.2}])
    assert b["throughput"] == pytest.approx(7.0) and c["slo"] == pytest.approx(0.3)
    line, = paired_rounds({"1.4": {"bucketed": b, "mixed": c}})
    # per round 1.100 and 0.950 (mean 1.025), not the ratio of the means (14.5 / 14 = 1.036)
    assert "1.100, 0.950" in line and "mean 1.025" in line and "6.000-8.000" in line


def test_one_round_adds_no_paired_line() -> None:
    one = _mean_of_rounds([{"throughput": 8.0}])
    assert paired_rounds({"1.4": {"bucketed": one, "mixed": one}}) == []
