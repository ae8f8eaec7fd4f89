"""Which job a tensor's rows belong to, so per-row adapter terms land on the right rows.

A batched step mixes jobs with different adapter sets. A module that adds a job's low-rank term
(``workers/adapters/patcher.py``) must know, for the input it is given, which contiguous ranges
of rows belong to which job. The runner declares the batch's rows once per step; code that
repacks tokens (the mask-aware controllers: ragged packs of masked tokens, row subsets) declares
the layout of what it feeds to modules. Layouts nest (a per-thread stack, innermost wins).

Two kinds:
- ``rows``: spans over dim 0 (batch rows; any trailing shape: tokens, channels, pixels);
- ``flat``: spans over the flattened leading dims (``x.reshape(-1, x.shape[-1])``): token packs.

Building layouts costs a little Python per call, so the controllers only build them while some
job of the step has terms (``wanted``); otherwise every ``use`` is a no-op.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_local = threading.local()


@dataclass(frozen=True)
class Layout:
    flat: bool
    spans: tuple[tuple[int, int, int], ...]  # (job group, start, stop), contiguous, in order
    total: int


def _merge(pairs: Iterable[tuple[int, int]], flat: bool) -> Layout:
    spans: list[tuple[int, int, int]] = []
    pos = 0
    for group, n in pairs:
        if n <= 0:
            continue
        if spans and spans[-1][0] == group and spans[-1][2] == pos:
            spans[-1] = (group, spans[-1][1], pos + n)
        else:
            spans.append((group, pos, pos + n))
        pos += n
    return Layout(flat, tuple(spans), pos)


def rows(pairs: Iterable[tuple[int, int]]) -> Layout:
    """Batch rows: consecutive ``(group, number of rows)``."""
    return _merge(pairs, flat=False)


def row_groups(groups: Iterable[int]) -> Layout:
    """Batch rows given one group id per row (e.g. a row subset)."""
    return _merge(((g, 1) for g in groups), flat=False)


def flat(pairs: Iterable[tuple[int, int]]) -> Layout:
    """A token pack: consecutive ``(group, number of tokens)`` over the flattened leading dims."""
    return _merge(pairs, flat=True)


def wanted() -> bool:
    """Whether any module needs layouts now (some job of the current step has adapter terms)."""
    return bool(getattr(_local, "wanted", False))


def set_wanted(value: bool) -> None:
    _local.wanted = value


def current() -> Layout | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def use(layout: Layout | None) -> Iterator[None]:
    """Make ``layout`` the current one inside the block (None: leave the current one)."""
    if layout is None:
        yield
        return
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(layout)
    try:
        yield
    finally:
        stack.pop()


__all__ = ["Layout", "current", "flat", "row_groups", "rows", "set_wanted", "use", "wanted"]
