"""Engine settings changed for one run of a benchmark (ablations, not deployment settings): each a
context manager that restores the engine's value."""

from __future__ import annotations

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


__all__ = ["bucket_growth", "widen_limit"]
