"""Report files: whole Markdown files, marked sections of shared ones, and plots."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write(out: str | Path, text: str | Sequence[str], *, append: bool = False) -> None:
    """A report: lines (joined, newline-terminated) or text as it is; ``out`` '' = standard output."""
    if not isinstance(text, str):
        text = "\n".join(text) + "\n"
    if not out:
        sys.stdout.write(text)
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as fh:
        fh.write(text)
    log.info("wrote %s", path)


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


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close a figure (every plot of the reports: same layout and resolution)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
