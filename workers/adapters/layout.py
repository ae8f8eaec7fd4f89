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
job of the step has terms or the step computes its GEMMs job by job (``wanted``); otherwise every
``use`` is a no-op.

Job-by-job GEMMs (``invariant``): a batched matmul does not compute a row the way the same row
alone is computed. The kernel a library picks, and the order in which it sums, depends on the
number of rows and on where a row falls in its tiles (oneDNN's AMX bf16 kernels here: the same row
at rows 64-127 of a 128-row product and at rows 0-63 of a 64-row one differ in the last bit). In
float32 that last bit never reaches a pixel; in half precision, 5 Flux steps amplify it to 7/255.
With ``invariant`` set, the row-aware ``nn.Linear`` of ``workers/adapters/patcher.py`` multiplies
each job's rows on their own, in the order the stock pipeline feeds them: a job's result no longer
depends on what it was batched with.
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
    """Whether any module needs layouts now: some job of the current step has adapter terms, or the
    step computes its GEMMs job by job (``invariant``)."""
    return bool(getattr(_local, "wanted", False) or getattr(_local, "invariant", False))


def set_wanted(value: bool) -> None:
    """The adapter patcher's demand (its terms need the rows of each job)."""
    _local.wanted = value


def invariant() -> bool:
    """Whether row-aware modules multiply each job's rows on their own (module doc)."""
    return bool(getattr(_local, "invariant", False))


def set_invariant(value: bool) -> None:
    """Set by the runner around a batched step of a half-precision model (``STENCIL_BATCH_INVARIANT``)."""
    _local.invariant = value


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


__all__ = ["Layout", "current", "flat", "invariant", "row_groups", "rows", "set_invariant", "set_wanted", "use",
           "wanted"]
