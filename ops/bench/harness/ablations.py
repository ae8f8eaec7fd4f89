"""Engine settings changed for one run of a benchmark (ablations, not deployment settings): each a
context manager that restores the engine's value."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from workers.engine import graph_calls
from workers.maskaware import buckets


@contextlib.contextmanager
def widen_limit(limit: float) -> Iterator[None]:
    """Steps replay wider batches' graphs padded by at most ``limit`` for the block's duration (the
    ``--widen`` ablation; 1 = never)."""
    saved, graph_calls.WIDEN_LIMIT = graph_calls.WIDEN_LIMIT, limit
    try:
        yield
    finally:
        graph_calls.WIDEN_LIMIT = saved


@contextlib.contextmanager
def bucket_growth(growth: float) -> Iterator[None]:
    """Token buckets growing by ``growth`` for the block's duration (the ``--growth`` ablation)."""
    saved, buckets.GROWTH = buckets.GROWTH, growth
    try:
        yield
    finally:
        buckets.GROWTH = saved


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers (an option's values)."""
    return [float(v) for v in text.split(",")]


def add_options(p: argparse.ArgumentParser, scope: str = "") -> None:
    """``--growth G,..`` and ``--widen L,..``, each defaulting to the engine's value; ``scope``: when
    they apply (e.g. "with --loads: ")."""
    p.add_argument("--growth", type=floats, default=[buckets.GROWTH],
                   help=f"ablation, {scope}token buckets growing by G (the engine's: {buckets.GROWTH})")
    p.add_argument("--widen", type=floats, default=[graph_calls.WIDEN_LIMIT],
                   help=f"ablation, {scope}a step padded by at most L x to replay a wider batch's graph "
                        f"(the engine's: {graph_calls.WIDEN_LIMIT}; 1 = off)")


__all__ = ["add_options", "bucket_growth", "floats", "widen_limit"]
