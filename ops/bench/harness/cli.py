"""The options every benchmark shares, logging, torch threads, and the command line its report cites."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.bench.harness.timing import CLOCKS, uptime

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parser(doc: str | None, *, out: str | None, threads: int | None = 1, seed: int | None = 0,
           clock: str | None = None) -> argparse.ArgumentParser:
    """A parser with the shared options; ``None`` leaves one out (the benchmark defines its own)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest settings: a smoke run in seconds, not a measurement")
    if out is not None:
        p.add_argument("--out", default=out, help="the Markdown report ('' = standard output)")
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch threads (0 = torch's default)")
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed)
    if clock is not None:
        p.add_argument("--clock", choices=("auto", *CLOCKS), default=clock,
                       help="cpu = CPU time of the compute thread (robust to other load, needs --threads 1); "
                            "auto = cpu with one thread, wall otherwise")
    return p


@dataclass
class Run:
    """One invocation of a benchmark: its options, the argv its report cites, its start time."""

    module: str
    args: argparse.Namespace
    argv: list[str]
    t0: float = field(default_factory=time.monotonic)

    @property
    def command(self) -> str:
        """The exact command line (shell-quoted) that repeats this run."""
        return " ".join(["python -m", self.module, *map(shlex.quote, self.argv)])

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def write(self, text: str | Sequence[str], out: str | Path | None = None, *, append: bool = False) -> None:
        """The report (lines: joined, newline-terminated) into ``out``, default ``--out``; '' = standard output."""
        text, out = text if isinstance(text, str) else "\n".join(text) + "\n", self.args.out if out is None else out
        if not out:
            sys.stdout.write(text)
            return
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with Path(out).open("a" if append else "w") as fh:
            fh.write(text)
        log.info("wrote %s", out)


def start(p: argparse.ArgumentParser, argv: Sequence[str] | None, file: str, *, quick: dict[str, Any] | None = None,
          hide: Sequence[str] = ()) -> Run:
    """Parse (``--quick`` switches the defaults to ``quick``; options given still win), then set up
    logging, torch threads and the clock. ``hide``: options (with their value) the cited command
    leaves out, e.g. one that re-renders a saved run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.quick and quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    if getattr(args, "clock", None) == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    if getattr(args, "clock", None) == "cpu" and args.threads != 1:
        p.error("--clock cpu measures the calling thread only: use --threads 1")
    shown = list(argv)
    for option in hide:
        if option in shown:
            i = shown.index(option)
            del shown[i:i + 2]
    return Run(f"ops.bench.{Path(file).stem}", args, shown)


def report_parts(run: Run, title: str, parts: dict[str, Callable[..., list[str]]], *args: Any) -> None:
    """A report of the parts named in ``--parts`` (each returns its Markdown lines), with the command,
    the machine's load before and after, and the total time."""
    lines = [f"# {title}\n", f"Command: `{run.command}`. Load at start: {uptime()}.\n"]
    names = run.args.parts.split(",")
    for k, name in enumerate(names):
        lines += parts[name](run.args, *args)
        if k + 1 < len(names):  # written after each part: a run cut short by its time limit keeps what it measured
            run.write([*lines, f"(Parts not yet run: {', '.join(names[k + 1:])}; {run.elapsed():.0f} s so far.)"])
    lines.append(f"Total {run.elapsed():.0f} s; load at end: {uptime()}.")
    run.write(lines)
