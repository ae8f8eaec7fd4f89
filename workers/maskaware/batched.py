"""Batch-wide token indices of one UNet level: the masked jobs of a call gathered, written into
their caches and attended with a few kernels per block, not a few per job.

Why: on a GPU a diffusion step at service batch sizes is bound by the host's kernel launches.
Job by job, a masked block gathers each job's tokens, writes its fresh K, V and output into its
cache and runs its two attention calls: about six launches per job and block, so at 8 jobs the
mask-aware step launched 2.4x the kernels of the full step it was meant to undercut.

How: the masked jobs of a step are staged into one name-major buffer (``workers/engine/staging``),
so a cached tensor of adjacent jobs is one ``[rows, N, C]`` slab. Per level this module builds,
once per batch composition and on the host, the integer indices that serve every block of the
level:

- ``gather``: every masked job's token rows in the packed order, as (batch row, token) pairs of
  the block input ``[B, N, C]`` (one indexing kernel; the input is often a strided view);
- per *slab* (consecutive jobs whose caches are adjacent in one buffer and whose rows are adjacent
  in the batch): the same tokens as flat positions in the slab ``[R * N, C]`` (one ``index_copy_``
  per cached tensor writes every job's fresh tokens);
- *runs*: consecutive jobs of a slab computing one token count, one attention call each.

Runs form where jobs' counts are close: a job is padded up to its run's largest count (its last
token index repeated, as ``buckets.padded`` does: a repeated token computes the same values from
the same inputs, and writing them twice writes the same values) as long as the run's padded token
rows stay within ``buckets.GROWTH`` of its real ones, or add at most ``FREE_PAD_ROWS`` (at the
coarse levels a few dozen token rows cost the GPU less than the launches of another run). The
engine orders masked jobs by their counts (``runner_base._step_order``), so similar jobs are
adjacent. Padding changes which GEMM shapes a job meets, so a step that keeps each job's
arithmetic its own (``adapters.layout.wanted``: adapter terms or batch invariance) pads nothing and
runs only jobs of equal counts together.

*Ragged* levels (``ragged=True``, where a variable-length attention kernel exists: CUDA) drop
runs: a slab's rows are attended in one variable-length call whose per-row query counts are
device data (``cu`` offsets in the index tensor, ``workers/maskaware/varlen.py``), and the slab's
token rows are padded up to a bucket of their total (``buckets.token_bucket`` of ``rows * n``),
spread over its rows (a row never past ``n``; a row's pads repeat its last token). What fixes the
level's shapes is then the slab's rows and that bucket, not each job's count: a job joining or
leaving a steady batch, or swapped for one of another mask, keeps the captured graph whenever the
total stays in its bucket (``workers/engine/graph_calls``).

The indices of every level go to the device in one copy; a steady batch reuses them (the memo is
keyed by the composition), and a graph-captured step takes them as one of its inputs
(``workers/engine/graph_calls``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from app.storage.hostcache import to_device
from workers.maskaware.buckets import GROWTH, padded, token_bucket

# Padded token rows a run may add whatever its size: a few microseconds of a block's GEMMs at the
# widest SD/SDXL level (C = 1280), less than the two launches (attention, its output copy) per
# block that a separate run costs.
FREE_PAD_ROWS = 64


@dataclass(frozen=True)
class Member:
    """A masked group of one level as the index builder sees it."""

    g: int  # group index in the call
    start: int  # first batch row
    rows: int
    indices: torch.Tensor  # host int64, sorted: the tokens it computes at this level
    adjacent: bool  # its cache's rows follow the previous member's in one staged buffer


@dataclass(frozen=True)
class Run:
    """Consecutive members of a slab computing ``m`` tokens per row: one attention call."""

    first: int  # member index
    count: int
    rows: int
    row: int  # first row in its slab
    m: int
    packed: int  # first packed token row


@dataclass(frozen=True)
class Slab:
    """Consecutive members whose caches are one slab and whose batch rows are adjacent."""

    first: int
    count: int
    start: int  # first batch row
    rows: int
    packed: int  # first packed token row
    tokens: int  # packed token rows
    scatter: int  # offset of its flat slab positions in the index tensor
    cu: int = -1  # ragged: offset of its rows' cumulative query counts (rows + 1) in the index tensor


@dataclass(frozen=True)
class LevelIndex:
    """Where a level's indices sit in the index tensor, and how its members group."""

    n: int
    members: tuple[tuple[int, int, int, int], ...]  # (group, start, rows, m) in packed order
    slabs: tuple[Slab, ...]
    runs: tuple[Run, ...]
    tokens: int  # packed token rows (the gather's length)
    gather: int  # offset of the gather's batch rows, then its tokens, in the index tensor
    ragged: bool = False  # one variable-length attention call per slab; counts are device data

    @property
    def structure(self) -> Hashable:
        """What fixes the level's shapes and control flow (a graph signature's part): ragged, each
        member's count is not part of it (its queries' extent is read on the device)."""
        members = tuple((g, s, r, 0) for g, s, r, _m in self.members) if self.ragged else self.members
        return (self.n, members, self.slabs, self.runs, self.tokens, self.gather, self.ragged)

    @functools.cached_property
    def slab_runs(self) -> tuple[tuple[Slab, tuple[Run, ...]], ...]:
        """Each slab with its runs (derived once: every block of the level reads it)."""
        return tuple((s, tuple(r for r in self.runs if s.first <= r.first < s.first + s.count)) for s in self.slabs)


def build(n: int, members: Sequence[Member], pad: bool, offset: int = 0,
          ragged: bool = False, target: int | None = None) -> tuple[LevelIndex, list[torch.Tensor]]:
    """A level's index layout and its host index pieces (to be concatenated in order, starting at
    ``offset`` in the index tensor). ``pad``: jobs of different counts may share a run.
    ``ragged`` (requires ``pad``): one variable-length attention call per slab (module doc);
    ``target``: its token rows padded further, to this total (a captured graph's, ``graph_calls``)."""
    if ragged:
        if not pad:
            raise ValueError("a ragged level pads its slabs: it needs pad=True")
        return _build_ragged(n, members, offset, target)
    slabs_of = _slabs_of(members)
    m_of = [int(mem.indices.numel()) for mem in members]
    runs_of: list[list[int]] = []  # member indices per run, within slabs
    for slab in slabs_of:
        run: list[int] = []
        for i in slab:
            if run and _joins(members, m_of, run, i, pad):
                run.append(i)
            else:
                run = [i]
                runs_of.append(run)
    padded_m = list(m_of)
    for run in runs_of:
        top = max(m_of[i] for i in run)
        for i in run:
            padded_m[i] = top
    pieces: list[torch.Tensor] = []
    rows_idx = [padded(mem.indices, padded_m[i]) for i, mem in enumerate(members)]
    gather_rows, gather_tokens = [], []
    for i, mem in enumerate(members):
        for r in range(mem.rows):
            gather_rows.append(torch.full((padded_m[i],), mem.start + r, dtype=torch.long))
            gather_tokens.append(rows_idx[i])
    tokens = sum(int(t.numel()) for t in gather_tokens)
    pieces += gather_rows + gather_tokens
    cursor = offset + 2 * tokens
    packed_at, p = [], 0
    for i, mem in enumerate(members):
        packed_at.append(p)
        p += mem.rows * padded_m[i]
    slabs: list[Slab] = []
    slab_row: dict[int, int] = {}
    for slab in slabs_of:
        row = 0
        scatter = []
        for i in slab:
            slab_row[i] = row
            scatter += [(row + r) * n + rows_idx[i] for r in range(members[i].rows)]
            row += members[i].rows
        size = sum(int(t.numel()) for t in scatter)
        first = members[slab[0]]
        slabs.append(Slab(slab[0], len(slab), first.start, row, packed_at[slab[0]], size, cursor))
        pieces += scatter
        cursor += size
    runs = tuple(Run(run[0], len(run), sum(members[i].rows for i in run), slab_row[run[0]], padded_m[run[0]],
                     packed_at[run[0]]) for run in runs_of)
    level = LevelIndex(n, tuple((mem.g, mem.start, mem.rows, padded_m[i]) for i, mem in enumerate(members)),
                       tuple(slabs), runs, tokens, offset)
    return level, pieces


def _slabs_of(members: Sequence[Member]) -> list[list[int]]:
    """Member indices per slab: consecutive members adjacent in one buffer and in the batch."""
    slabs_of: list[list[int]] = []
    for i, mem in enumerate(members):
        prev = members[i - 1] if i else None
        if prev is not None and mem.adjacent and mem.start == prev.start + prev.rows:
            slabs_of[-1].append(i)
        else:
            slabs_of.append([i])
    return slabs_of


def row_lengths(real: Sequence[int], n: int, target: int | None = None) -> list[int]:
    """Query rows per batch row of a ragged slab: ``real`` (each row's masked tokens) with the
    slab's total padded up to its bucket (or ``target``), the pads given to the last rows first (a
    row at most ``n``). Deterministic in ``real``, so a composition always gets the same layout."""
    total = sum(real)
    if target is None:
        target = token_bucket(total, len(real) * n) if total else 0
    lengths, short = list(real), target - total
    for r in range(len(lengths) - 1, -1, -1):
        if short <= 0:
            break
        add = min(short, n - lengths[r])
        lengths[r] += add
        short -= add
    return lengths


def _build_ragged(n: int, members: Sequence[Member], offset: int,
                  target: int | None = None) -> tuple[LevelIndex, list[torch.Tensor]]:
    """``build`` for a ragged level: per slab one run; pads spread over rows (``row_lengths``); a
    ``target`` beyond the slabs' buckets pads the last slab further."""
    slabs_of = _slabs_of(members)
    m_of = [int(mem.indices.numel()) for mem in members]
    reals = [[m_of[i] for i in slab for _ in range(members[i].rows)] for slab in slabs_of]
    targets = [token_bucket(sum(real), len(real) * n) if sum(real) else 0 for real in reals]
    if target is not None:
        targets[-1] += max(0, target - sum(targets))
    gather_rows: list[torch.Tensor] = []
    gather_tokens: list[torch.Tensor] = []
    scatters: list[list[torch.Tensor]] = []
    cus: list[torch.Tensor] = []
    spans: list[tuple[int, int, int]] = []  # per slab: first packed row, token rows, rows
    packed = 0
    for slab, real, slab_target in zip(slabs_of, reals, targets):
        lengths = iter(row_lengths(real, n, slab_target))
        scatter, cu, row, first = [], [0], 0, packed
        for i in slab:
            mem = members[i]
            for r in range(mem.rows):
                length = next(lengths)
                tokens = padded(mem.indices, length)
                gather_rows.append(torch.full((length,), mem.start + r, dtype=torch.long))
                gather_tokens.append(tokens)
                scatter.append((row + r) * n + tokens)
                cu.append(cu[-1] + length)
                packed += length
            row += mem.rows
        scatters.append(scatter)
        cus.append(torch.tensor(cu, dtype=torch.long))
        spans.append((first, packed - first, row))
    tokens = packed
    pieces: list[torch.Tensor] = gather_rows + gather_tokens
    cursor = offset + 2 * tokens
    slabs: list[Slab] = []
    for slab, scatter, cu, (first, size, rows) in zip(slabs_of, scatters, cus, spans):
        pieces += scatter + [cu]
        slabs.append(Slab(slab[0], len(slab), members[slab[0]].start, rows, first, size, cursor, cursor + size))
        cursor += size + int(cu.numel())
    runs = tuple(Run(s.first, s.count, s.rows, 0, 0, s.packed) for s in slabs)
    level = LevelIndex(n, tuple((mem.g, mem.start, mem.rows, m_of[i]) for i, mem in enumerate(members)),
                       tuple(slabs), runs, tokens, offset, ragged=True)
    return level, pieces


def _joins(members: Sequence[Member], m_of: list[int], run: list[int], i: int, pad: bool) -> bool:
    """Whether member ``i`` joins ``run``: equal counts, or (``pad``) the run's padded token rows
    stay within ``GROWTH`` of its real ones or add at most ``FREE_PAD_ROWS``."""
    if m_of[i] == m_of[run[-1]] and all(m_of[j] == m_of[i] for j in run):
        return True
    if not pad:
        return False
    idx = [*run, i]
    real = sum(members[j].rows * m_of[j] for j in idx)
    top = max(m_of[j] for j in idx)
    used = top * sum(members[j].rows for j in idx)
    return used <= GROWTH * real or used - real <= FREE_PAD_ROWS


@dataclass
class BatchIndex:
    """Every level's ``LevelIndex`` of one call and the device tensor holding their positions."""

    levels: dict[Hashable, LevelIndex]
    data: torch.Tensor
    _views: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def _view(self, offset: int, length: int) -> torch.Tensor:
        """A slice of ``data``, made once (a steady step dispatches no view operators for it)."""
        view = self._views.get((offset, length))
        if view is None:
            view = self._views[(offset, length)] = self.data.narrow(0, offset, length)
        return view

    def gather(self, level: LevelIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch rows, tokens) of the level's packed token rows."""
        return self._view(level.gather, level.tokens), self._view(level.gather + level.tokens, level.tokens)

    def scatter(self, slab: Slab) -> torch.Tensor:
        return self._view(slab.scatter, slab.tokens)

    def cu(self, slab: Slab) -> torch.Tensor:
        """A ragged slab's cumulative query rows per batch row (``rows + 1`` values, from 0)."""
        return self._view(slab.cu, slab.rows + 1)

    @property
    def ragged(self) -> bool:
        return any(level.ragged for level in self.levels.values())

    def over(self, data: torch.Tensor) -> "BatchIndex":
        """The same layout reading positions from ``data`` (a captured step's static buffer)."""
        return BatchIndex(self.levels, data)

    @property
    def structure(self) -> Hashable:
        return tuple((key, level.structure) for key, level in self.levels.items())

    @property
    def tokens(self) -> dict[Hashable, int]:
        """Each level's packed token rows, by level key."""
        return {key: level.tokens for key, level in self.levels.items()}


def structure_tokens(structure: Hashable) -> dict[Hashable, int]:
    """``BatchIndex.tokens`` read back from its ``structure`` (a captured graph's signature part)."""
    return {key: level[4] for key, level in structure}  # type: ignore[attr-defined]


def assemble(levels: dict[Hashable, tuple[int, Sequence[Member], bool]], device: torch.device,
             ragged: bool = False, targets: Mapping[Hashable, int] | None = None) -> BatchIndex:
    """The ``BatchIndex`` of ``levels`` (key -> (tokens per row, members, pad)), uploaded in one
    copy; ``ragged``: levels that pad are ragged (module doc); ``targets``: ragged levels' token
    totals padded further (``build``)."""
    layout: dict[Hashable, LevelIndex] = {}
    pieces: list[torch.Tensor] = []
    offset = 0
    for key, (n, members, pad) in levels.items():
        level, parts = build(n, members, pad, offset, ragged=ragged and pad, target=(targets or {}).get(key))
        layout[key] = level
        pieces += parts
        offset += sum(int(t.numel()) for t in parts)
    host = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    return BatchIndex(layout, to_device(host, device) if host.numel() else host.to(device))


class IndexMemo:
    """Built ``BatchIndex`` es by composition (an LRU): a steady batch builds its indices once."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._memo: OrderedDict[Hashable, tuple[BatchIndex, object]] = OrderedDict()
        self.builds = 0

    def get(self, key: Hashable, build_levels: "callable", device: torch.device, keep: object = None,
            ragged: bool = False, targets: Mapping[Hashable, int] | None = None) -> BatchIndex:
        """The memoized index of ``key``, else ``assemble(build_levels(), ragged=ragged, targets=targets)``
        (``keep``: objects whose identity ``key`` names, held so that no other object takes their
        identity meanwhile; ``key`` must name ``ragged`` and ``targets``)."""
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
            return hit[0]
        index = assemble(build_levels(), device, ragged=ragged, targets=targets)
        self.builds += 1
        self._memo[key] = (index, keep)
        while len(self._memo) > self.capacity:
            self._memo.popitem(last=False)
        return index


__all__ = ["FREE_PAD_ROWS", "BatchIndex", "IndexMemo", "LevelIndex", "Member", "Run", "Slab", "assemble", "build",
           "row_lengths", "structure_tokens"]
