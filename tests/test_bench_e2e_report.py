"""The e2e report's judgement logic: which rate the stock sustains, and the ratios it claims; the reports' plots."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from ops.bench.e2e import write_report
from ops.bench.harness.engine import curve_table
from ops.bench.harness.openloop import claims, sustained
from ops.bench.harness.report import finish_axes, pyplot, save_figure


def _s(jobs: int, done: int, mean: float, p95: float, queueing: float, throughput: float) -> dict:
    return {"summary": {"jobs": jobs, "done": done, "mean": mean, "p50": mean, "p95": p95, "p99": p95,
                        "queueing": queueing, "throughput": throughput, "gpu_busy": 0.5}, "rows": []}


def _report() -> dict:
    return {
        "command": "python -m ops.bench.e2e --out x", "capacity_stock": 1.0, "machine": "test", "elapsed_s": 1.0,
        "args": {"trace": "spring", "quick": True, "out": "x", "workers": 2, "max_batch": 4, "steps": 10,
                 "guidance": 7.5, "size": 256, "jobs": 24},
        "results": {
            # 0.5: fine; 0.9: fine (throughput keeps up, queueing moderate); 2.0: overloaded.
            "stock": {"0.5000": _s(24, 24, 3.0, 5.0, 0.5, 0.5), "0.9000": _s(24, 24, 8.0, 12.0, 4.0, 0.88),
                      "2.0000": _s(24, 24, 30.0, 50.0, 28.0, 1.0)},
            "full-static": {"0.5000": _s(24, 24, 2.0, 4.0, 0.2, 0.5), "0.9000": _s(24, 24, 4.0, 8.0, 1.0, 0.9),
                            "2.0000": _s(24, 24, 10.0, 20.0, 8.0, 1.5)},
            "full-continuous": {"0.5000": _s(24, 24, 2.0, 3.0, 0.1, 0.5), "0.9000": _s(24, 24, 3.0, 6.0, 0.5, 0.9),
                                "2.0000": _s(24, 24, 9.0, 15.0, 6.0, 1.6)},
            "stencil": {"0.5000": _s(24, 24, 0.5, 0.8, 0.0, 0.5), "0.9000": _s(24, 24, 0.8, 1.2, 0.1, 0.9),
                        "2.0000": _s(24, 23, 2.0, 3.0, 0.5, 1.9)},
        },
    }


def test_sustained_rate_is_the_highest_that_keeps_up() -> None:
    report = _report()
    assert sustained(report, "stock") == "0.9000"
    # A system that drops a job at a rate does not sustain it.
    assert sustained(report, "stencil") == "0.9000"


def test_stock_never_sustains_a_rate_above_its_closed_loop_capacity() -> None:
    """A short run 10% above capacity can look fine (the queue has not grown yet); it is not sustained."""
    report = _report()
    report["results"]["stock"]["1.1000"] = _s(24, 24, 9.0, 13.0, 4.5, 1.0)
    assert sustained(report, "stock") == "0.9000"
    report["capacity_stock"] = 1.2
    assert sustained(report, "stock") == "1.1000"


def test_claims_compare_at_the_stocks_sustained_rate() -> None:
    lines = claims(_report())
    stencil = next(line for line in lines if line.startswith("- `stencil`"))
    assert "10.0x lower" in stencil  # 8.0 / 0.8
    # Throughput at equal P95 counts only rates where every job completed: 0.9 (not 1.9 at 2.0).
    assert "0.900/s (1.02x the stock's)" in stencil
    cont = [line for line in lines if "continuous vs static" in line]
    assert any("6.00 s vs 8.00 s (25% lower)" in line for line in cont)


def test_curve_table_reports_gain_over_batch_one() -> None:
    rows = [{"engine": "stock", "batch": 1, "jobs_per_s": 2.0}, {"engine": "stock", "batch": 4, "jobs_per_s": 5.0},
            {"engine": "stencil-full", "batch": 1, "jobs_per_s": 1.0},
            {"engine": "stencil-full", "batch": 4, "jobs_per_s": 1.0}]
    table = curve_table(rows)
    assert "| stock | 2.000 (1.00x) | 5.000 (2.50x) |" in table
    assert "| stencil-full | 1.000 (1.00x) | 1.000 (1.00x) |" in table


def test_write_report_renders_tables_and_plots(tmp_path: Path) -> None:
    report = _report()
    report["batch_curve"] = [{"engine": "stock", "batch": b, "jobs_per_s": float(b)} for b in (1, 2)]
    path = write_report(report, tmp_path)
    text = path.read_text()
    assert "| stencil | 0.900 | 24/24 |" in text
    assert "Command: `python -m ops.bench.e2e --out x` on test" in text
    assert "Throughput vs batch size" in text
    for png in ("latency_vs_rate.png", "throughput_vs_batch.png"):
        assert (tmp_path / png).stat().st_size > 1000
        with Image.open(tmp_path / png) as plot:  # the reports' plots are tracked: written as palette PNGs
            assert plot.mode == "P" and plot.width > 500


def test_a_palette_plot_keeps_what_was_drawn(tmp_path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1, 2], [0, 2, 1], color="tab:red", label="a line")
    finish_axes(ax, "x", "y", legend=0)
    fig.tight_layout()  # as save_figure lays it out
    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=110)
    save_figure(fig, tmp_path / "plot.png")
    rendered.seek(0)
    with Image.open(rendered) as rgba, Image.open(tmp_path / "plot.png") as palette:
        drawn = np.asarray(rgba.convert("RGB"), dtype=np.int16)
        written = np.asarray(palette.convert("RGB"), dtype=np.int16)
    assert written.shape == drawn.shape
    difference = np.abs(written - drawn).max(axis=2)
    assert np.mean(difference > 16) < 0.005  # anti-aliased edges may snap to a neighbouring colour
    assert (tmp_path / "plot.png").stat().st_size < len(rendered.getvalue())
