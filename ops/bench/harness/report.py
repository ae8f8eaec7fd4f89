"""Report files: sections of Markdown files that several commands write, and plots (whole files: ``cli.Run``)."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
from pathlib import Path
from typing import Any

from PIL import Image

log = logging.getLogger(__name__)


class Stopped(BaseException):
    """A signal ended the run (a BaseException: no ``except Exception`` on the way swallows it)."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM (a stage's time limit) into ``Stopped``, so that the run writes what it measured."""
    def stop(*_: Any) -> None:
        raise Stopped("SIGTERM")

    signal.signal(signal.SIGTERM, stop)


WARNING_MARKS = (" WARNING ", " ERROR ", " CRITICAL ", "WARNING/", "ERROR/", "CRITICAL/", "Traceback", "Error: ")


def log_digest(logs: Path, marked: int = 30, tail: int = 8) -> str:
    """Each ``*.log`` under ``logs``: its last ``marked`` lines at WARNING and above (Python's and
    Celery's formats, tracebacks' first and last lines) and its last ``tail`` lines; for a run whose
    process logs will not come back with its results."""
    parts = []
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        lines = path.read_text(errors="replace").splitlines()
        flagged = [line for line in lines if any(m in line for m in WARNING_MARKS)]
        parts.append(f"--- {path.name}: {len(lines)} lines, {len(flagged)} at WARNING and above ---")
        parts += flagged[-marked:]
        parts.append(f"--- {path.name}: last {min(tail, len(lines))} lines ---")
        parts += lines[-tail:]
    return "\n".join(parts) or f"(no logs in {logs})"


def write_run(out: str, json_path: str, lines: list[str], data: Any) -> None:
    """A run's Markdown report (``lines``) and its JSON (``data``), each where given; benchmarks that
    write them after every part, so that a run cut short keeps what it measured."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("\n".join(lines) + "\n")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(data, indent=1, default=float))


def rounded(data: Any, digits: int = 6) -> Any:
    """``data`` with every float rounded to ``digits`` significant digits: per-job records (seconds,
    ratios) carry no more than that, and the repository's size budget counts their bytes."""
    if isinstance(data, float):
        return float(f"{data:.{digits}g}")
    if isinstance(data, dict):
        return {k: rounded(v, digits) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [rounded(v, digits) for v in data]
    return data


def replace_section(path: Path, name: str, text: str) -> None:
    """Replace ``<!-- name:begin -->...<!-- name:end -->`` in ``path`` (append if missing): several
    commands write one report, each its own section."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else (old.rstrip() + "\n\n" + block + "\n").lstrip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
    log.info("wrote section %s of %s", name, path)


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib's pyplot on the Agg backend (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_axes(ax: Any, xlabel: str, ylabel: str, legend: float | None = None) -> None:
    """The reports' axes: labels, a light grid, and a legend when ``legend`` is given (its font size, 0 = default)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend is not None:
        ax.legend(fontsize=legend or None)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> str:
    """Lay out, write and close a figure (every plot of the reports: same layout and resolution); its file name."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=dpi)
    pyplot().close(fig)
    rendered.seek(0)
    write_palette_png(Image.open(rendered), path)
    return path.name


def write_palette_png(image: Image.Image, path: Path) -> None:
    """A plot as a 256-colour PNG: flat lines and text lose nothing visible, and the file is half the
    size of matplotlib's RGBA one (the reports are tracked files, and the repository has a size limit)."""
    palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(path, format="PNG", optimize=True)
