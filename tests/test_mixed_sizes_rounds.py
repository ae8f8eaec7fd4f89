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


def test_rounds_pair_slo_of_c_and_d_with_each_replays_bias() -> None:
    c = _mean_of_rounds([{"throughput": 4.0, "slo": 0.897, "step_bias": 0.003},
                         {"throughput": 4.0, "slo": 0.80, "step_bias": -0.05}])
    d = _mean_of_rounds([{"throughput": 4.0, "slo": 0.859, "step_bias": -0.143},
                         {"throughput": 4.0, "slo": 0.969, "step_bias": -0.04}])
    lines = paired_rounds({"0.7": {"mixed": c, "mixed-slo": d}})
    assert lines == ["- SLO satisfaction by round at load 0.70, (c) / (d): 89.7% / 85.9%, bias (c) +0%, "
                     "bias (d) -14%; 80.0% / 96.9%, bias (c) -5%, bias (d) -4%."]


def test_a_miss_is_lost_to_the_queue_when_its_first_step_came_too_late_to_make_it_alone() -> None:
    from ops.bench.mixed_sizes import Outcome

    queued = Outcome(arrival=0.0, deadline=5.0, finish=6.0, start=4.5, alone=1.0)
    in_batch = Outcome(arrival=0.0, deadline=5.0, finish=6.0, start=3.5, alone=1.0)
    never = Outcome(arrival=0.0, deadline=5.0, alone=1.0)
    met = Outcome(arrival=0.0, deadline=5.0, finish=4.9, start=4.5, alone=1.0)
    assert [o.missed_queued for o in (queued, in_batch, never, met)] == [True, False, True, False]


def test_real_from_takes_an_earlier_runs_real_part_runs_only_the_simulations_and_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    from pathlib import Path

    from ops.bench.mixed_sizes import main

    earlier = Path(__file__).resolve().parents[1] / "docs/bench/mixed_sizes.json"
    out, js = tmp_path / "report.md", tmp_path / "report.json"
    assert main(["--quick", "--parts", "sim", "--real-from", str(earlier), "--out", str(out), "--json", str(js)]) == 0
    text = out.read_text()
    assert "## Real run on this machine" in text and "`--real-from`" in text and "## Simulation" in text
    written = json.loads(js.read_text())
    assert written["real"] == json.loads(earlier.read_text())["real"] and written["real_from"] == str(earlier)
    with pytest.raises(SystemExit):  # the real run and an earlier one's numbers: one or the other
        main(["--quick", "--parts", "real,sim", "--real-from", str(earlier), "--out", str(out)])
