"""Temporal reuse inside the mask: per plan unit (a UNet's ``Transformer2DModel``, a Flux block) and
per patch of masked tokens, a step may take a patch's activations from the job's own previous step
instead of computing them.

Why: a mask-aware edit computes every masked token at every step, although a transformer's output
at most tokens moves little between adjacent steps (PatchedServe reuses patches, FORA and DeepCache
reuse block outputs at fixed intervals, TeaCache skips whole steps).

What is reused: the job's cache already supplies unmasked tokens as the template's activation of
this step plus the job's offset (``runner_base.OffsetCache``). A reused masked token is supplied
the same way with a *recent* offset: ``cached(t) + rel``, where ``rel`` = own - cached at the last
step that computed the token. So a reused patch follows the template's motion from step to step
and keeps how far this edit was from it one step ago. K, V and the unit's output Y are treated
alike, so the next block's attention and ``proj_out`` read consistent values. Flux caches no hidden
states: there a reused token's block output is its input plus the block's last residual
(``flux_reuse.py``; ``UnitReuse.combine`` with ``residual``), its K and V as above.

Static shapes, no host sync: a patch is ``PATCH`` consecutive masked-token positions. Which patches
a step computes is decided on the host *after* the previous step's one read (the engine reads each
job's per-patch errors there, copied without a sync), so the step's index tensors have host-known
sizes (rounded up to token buckets where steps are graph-captured); every write is an
``index_copy_`` of a known shape; the buffers are bounded per job (one ``[rows, M, C]`` tensor per
cached name of the units it runs, M = the level's computed-token count).

The rule (``workers/maskaware/reuse_rule.py``) sees, per patch, the relative error that reuse
would have made at the last step that computed it (``err``: |own - predicted| / |own| over the
patch's tokens and channels of the unit's output Y), how old the offset was then, the step, the
level, the guidance and how many steps in a row the patch has been reused (``run``). A patch is
reused for at most ``MAX_RUN`` steps in a row; refresh steps, the first masked step after a
refresh and the last step compute everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from workers.maskaware.buckets import ALIGN, token_bucket

PATCH = ALIGN  # masked-token positions per patch (a token bucket is whole patches)
MAX_RUN = 2  # steps in a row a patch may be reused before it computes again
FEATURES = ("progress", "err", "err_age", "unit_err", "unit_err_max", "level_share", "unit_depth", "guidance", "run")


class ReuseRule(Protocol):
    """Decides, for every patch computed this step, whether the next step may reuse it."""

    name: str

    def reuse(self, features: np.ndarray) -> np.ndarray:
        """``features``: [patches, len(FEATURES)] -> bool [patches] (True: reuse next step)."""


@dataclass
class UnitReuse:
    """One job's reuse state of one plan unit (its level's masked positions, offsets, errors)."""

    n: int  # tokens at the unit's level
    m: int  # computed masked positions (bucket padding included)
    depth: float  # position of the unit in the model's unit order, 0..1
    idx_all: torch.Tensor  # [m] token indices of the level's masked positions
    pos: torch.Tensor  # [patches, PATCH] positions of each patch (the last one clamped to m - 1)
    weight: torch.Tensor  # [patches, PATCH, 1]: 1 at a patch's real tokens, 0 at padding (clamped or bucket)
    err: torch.Tensor  # [patches] float32 on the device: this step's measured error per computed patch
    real: int = 0  # real masked positions (the rest of the ``m``: bucket padding, copies of the last real one)
    rel: dict[str, torch.Tensor] = field(default_factory=dict)  # cached name -> [rows, m, C] recent offset
    last_err: np.ndarray = field(default_factory=lambda: np.zeros(0))
    err_age: np.ndarray = field(default_factory=lambda: np.zeros(0))  # offset's age when measured (0: the refresh's)
    last_computed: np.ndarray = field(default_factory=lambda: np.zeros(0, int))  # step, -1: none since the refresh
    run: np.ndarray = field(default_factory=lambda: np.zeros(0, int))  # steps reused in a row up to this one
    reuse_next: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    # this step:
    step: int = -1
    computed: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # host: patches computed
    sub: torch.Tensor | None = None  # [k] positions computed (None: all)
    ids: torch.Tensor | None = None  # [k / PATCH] patch ids computed (None: all)
    idx: torch.Tensor | None = None  # [k] token indices computed
    k: int = 0
    measured: bool = False  # the step wrote ``err`` (the unit's Y was merged)
    # training records (``record``): the error of the offset two steps old, as after a reused step
    rel2: dict[str, torch.Tensor] | None = None
    err2: torch.Tensor | None = None

    @property
    def patches(self) -> int:
        return int(self.pos.shape[0])

    def merge(self, name: str, measure: bool, cached: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """``cached`` [rows, N, C] (writable) with the unit's masked tokens: reused ones from the
        recent offset, computed ones ``fresh`` [rows, k, C]; updates the offset and, for the unit's
        output (``measure``), the per-patch error reuse would have made at the computed patches."""
        full = self.combine(name, measure, cached.index_select(1, self.idx_all), fresh)
        return cached.index_copy_(1, self.idx_all, full)

    def combine(self, name: str, measure: bool, base: torch.Tensor, fresh: torch.Tensor,
                residual: bool = False) -> torch.Tensor:
        """The unit's value at all its ``m`` positions [rows, m, C]: ``fresh`` [rows, k, C] at the
        computed ones, ``base + rel`` at the reused ones (``base``: the template's cache plus the
        refresh offset, or, with ``residual``, the unit's own input: then ``rel`` is the unit's
        residual and the error is measured against it, not against the whole value); ``rel``
        becomes ``fresh - base`` at the computed positions."""
        rel = self.rel.get(name)
        if rel is None or rel.shape != base.shape or rel.dtype != base.dtype:
            rel = self.rel[name] = torch.zeros_like(base)
        if self.sub is None:
            flat = self.pos.reshape(-1)
            delta = fresh - base
            norm = delta.index_select(1, flat) if residual and measure else None
            if self.rel2 is not None:  # training records: the offset of two steps ago too
                rel2 = self.rel2.setdefault(name, torch.zeros_like(base))
                if measure:
                    _errors(self, fresh.index_select(1, flat), (base + rel2).index_select(1, flat), None, self.err2,
                            norm)
                rel2.copy_(rel)
            if measure:
                _errors(self, fresh.index_select(1, flat), (base + rel).index_select(1, flat), None, norm=norm)
            rel.copy_(delta)
            out = fresh
        else:
            out = base + rel  # reused positions (computed ones overwritten below)
            base_c = base.index_select(1, self.sub)
            delta = fresh - base_c
            if measure:
                _errors(self, fresh, base_c + rel.index_select(1, self.sub), self.ids,
                        norm=delta if residual else None)
            rel.index_copy_(1, self.sub, delta)
            out.index_copy_(1, self.sub, fresh)
            if 0 < self.real < self.m:  # padding repeats the last real token: keep the copies equal
                out[:, self.real:] = out[:, self.real - 1:self.real]
        if measure:
            self.measured = True
        return out


class TemporalReuse:
    """Per-job reuse state and decisions (one per masked job that asked for it)."""

    def __init__(self, rule: ReuseRule, steps: int, refresh: frozenset[int], guidance: float, units: list[str],
                 bucketed: bool = False, max_tokens: int = 0) -> None:
        self.rule = rule
        # A recording rule (``ops/train/reuse_rule.py``: never reuses, ``observe``s every step's
        # errors, the two-steps-old offset's too) collects the rule's training data.
        self.record = bool(getattr(rule, "record", False))
        self.steps = steps
        self.refresh = refresh
        self.guidance = guidance
        self.unit_order = {u: i / max(1, len(units) - 1) for i, u in enumerate(units)}
        self.bucketed = bucketed
        self.max_tokens = max_tokens  # tokens at the finest level (level shares)
        self.units: dict[str, UnitReuse] = {}
        self.step = -1
        self.allowed = False  # this step may reuse (decided after the previous step)
        self.reused = 0  # (unit, patch) computations reused so far
        self.total = 0  # (unit, patch) computations so far, reused or not
        self._host: torch.Tensor | None = None  # this step's errors, copied to the host without a sync
        self._order: list[str] = []

    # -- the step ------------------------------------------------------------------------------------
    def begin(self, step: int) -> "TemporalReuse":
        """Called when the job's masked step is grouped; the blocks then ask ``plan`` per unit."""
        self.step = step
        for u in self.units.values():
            u.measured = False
        return self

    def plan(self, unit: str, idx_all: torch.Tensor, m: int, n: int, masked: int | None = None) -> UnitReuse:
        """This step's computed positions of ``unit`` (built once per step, at its first block);
        ``masked``: the real masked tokens among the ``m`` positions (the rest: bucket padding)."""
        u = self.units.get(unit)
        if u is None or u.m != m or u.n != n:
            u = self.units[unit] = self._new_unit(unit, idx_all, m, n, m if masked is None else masked)
        if u.step == self.step:
            return u
        u.step = self.step
        reuse = u.reuse_next if self.allowed else np.zeros(u.patches, bool)
        u.computed = ~reuse
        if not reuse.any():
            u.sub, u.ids, u.idx, u.k = None, None, u.idx_all, u.m
            return u
        ids = np.flatnonzero(u.computed)
        if self.bucketed:  # whole token buckets: recompute the riskiest reused patches to fill one
            want = token_bucket(len(ids) * PATCH, u.patches * PATCH + 1) // PATCH
            extra = np.flatnonzero(reuse)[np.argsort(-u.last_err[reuse], kind="stable")][:max(0, want - len(ids))]
            u.computed[extra] = True
            ids = np.flatnonzero(u.computed)
        dev = u.idx_all.device
        host = torch.as_tensor(ids, dtype=torch.long)
        u.ids = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
        u.sub = u.pos.index_select(0, u.ids).reshape(-1)
        u.idx = u.idx_all.index_select(0, u.sub)
        u.k = int(u.sub.numel())
        return u

    def _new_unit(self, unit: str, idx_all: torch.Tensor, m: int, n: int, masked: int) -> UnitReuse:
        patches = max(1, math.ceil(m / PATCH))
        dev = idx_all.device
        positions = torch.arange(patches * PATCH, device=dev)
        weight = (positions < masked).to(torch.float32).view(patches, PATCH, 1)
        pos = positions.clamp_(max=m - 1).view(patches, PATCH)
        extra: dict[str, Any] = dict(rel2={}, err2=torch.zeros(patches, device=dev)) if self.record else {}
        return UnitReuse(**extra, n=n, m=m, depth=self.unit_order.get(unit, 0.5), idx_all=idx_all, pos=pos,
                         weight=weight, real=masked,
                         err=torch.zeros(patches, dtype=torch.float32, device=idx_all.device),
                         last_err=np.full(patches, np.inf), err_age=np.zeros(patches),
                         last_computed=np.full(patches, -1), run=np.zeros(patches, int),
                         reuse_next=np.zeros(patches, bool), computed=np.ones(patches, bool))

    # -- after the step --------------------------------------------------------------------------------
    def collect(self, step: int) -> None:
        """Start copying step ``step``'s errors to the host (no sync: the engine's one read of the
        step completes it)."""
        self._order = [name for name, u in self.units.items() if u.step == step and u.measured]
        if not self._order:
            self._host = None
            return
        parts = [self.units[name].err for name in self._order]
        if self.record:
            parts += [self.units[name].err2 for name in self._order]  # type: ignore[misc]
        flat = torch.cat(parts)
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host = host.copy_(flat, non_blocking=True)
        else:
            self._host = flat.clone()

    def decide(self, step: int) -> None:
        """After step ``step`` completed (its read done): record the measured errors and decide which
        patches step ``step + 1`` reuses."""
        nxt = step + 1
        self.allowed = (nxt < self.steps - 1 and nxt not in self.refresh and nxt - 1 not in self.refresh
                        and self._host is not None)
        errors = self._host.numpy() if self._host is not None else np.zeros(0)
        off = 0
        touched = set(self._order)
        deciding: list[UnitReuse] = []
        for name, u in self.units.items():
            if u.step != step:
                u.reuse_next[:] = False
                continue
            c = u.computed
            self.total += u.patches
            self.reused += int((~c).sum())
            u.run = np.where(c, 0, u.run + 1)
            if name not in touched:  # computed off the reuse path (e.g. lockstep): nothing measured
                u.last_computed[c] = step
                u.last_err[c] = np.inf
                u.reuse_next[:] = False
                continue
            e = errors[off:off + u.patches]
            if self.record:
                half = len(errors) // 2
                self.rule.observe({"step": step, "guidance": self.guidance, "steps": self.steps, "unit": name,
                                   "n": u.n, "depth": u.depth, "patches": u.patches, "err": e.copy(),
                                   "err2": errors[half + off:half + off + u.patches].copy(),
                                   "age": np.where(u.last_computed >= 0, step - u.last_computed, 0)})
            off += u.patches
            u.err_age[c] = np.where(u.last_computed[c] >= 0, step - u.last_computed[c], 0)
            u.last_err[c] = e[c]
            u.last_computed[c] = step
            u.reuse_next[:] = False
            if self.allowed:
                deciding.append(u)
        self._host = None
        if deciding:  # one rule call for every unit of the job (the rule decides patch by patch)
            decided = self.rule.reuse(np.concatenate([self.features(u, nxt) for u in deciding]))
            start = 0
            for u in deciding:
                # at most MAX_RUN reused steps in a row, and only with a measured error
                u.reuse_next = decided[start:start + u.patches] & (u.run < MAX_RUN) & np.isfinite(u.last_err)
                start += u.patches

    def features(self, u: UnitReuse, nxt: int) -> np.ndarray:
        """The rule's inputs for every patch of ``u`` (``FEATURES``), deciding step ``nxt``."""
        err = np.nan_to_num(u.last_err, posinf=1.0)
        unit_err, unit_max = float(err.mean()), float(err.max())
        share = u.n / self.max_tokens if self.max_tokens else 1.0
        cols = [np.full(u.patches, nxt / max(1, self.steps - 1)), err, u.err_age.astype(float),
                np.full(u.patches, unit_err), np.full(u.patches, unit_max), np.full(u.patches, share),
                np.full(u.patches, u.depth), np.full(u.patches, self.guidance), u.run.astype(float)]
        return np.stack(cols, axis=1)

    def reset(self) -> None:
        """After a refresh step: the offsets restart from the job's new anchor."""
        self.units.clear()
        self.allowed = False
        self._host = None

    @property
    def share(self) -> float:
        """Share of (step, unit, patch) computations reused."""
        return self.reused / self.total if self.total else 0.0


def _errors(u: UnitReuse, fresh: torch.Tensor, pred: torch.Tensor, ids: torch.Tensor | None,
            into: torch.Tensor | None = None, norm: torch.Tensor | None = None) -> None:
    """Relative L2 error of ``pred`` against ``fresh`` per patch ([rows, patches * PATCH, C]),
    relative to ``fresh`` or to ``norm`` (e.g. the unit's residual) where given."""
    rows, k, c = fresh.shape
    w = u.weight if ids is None else u.weight.index_select(0, ids)  # padding counts for nothing
    f = fresh.float().view(rows, k // PATCH, PATCH, c)
    d = f - pred.float().view(rows, k // PATCH, PATCH, c)
    ref = f if norm is None else norm.float().view(rows, k // PATCH, PATCH, c)
    err = ((d.square() * w).sum((0, 2, 3)) / (ref.square() * w).sum((0, 2, 3)).clamp_min(1e-12)).sqrt()
    out = u.err if into is None else into
    if ids is None:
        out.copy_(err)
    else:
        out.index_copy_(0, ids, err)


def supports(maskaware: Any) -> bool:
    """Whether a mask-aware controller applies temporal reuse (SD-family UNets with cached K/V, Flux)."""
    return getattr(maskaware, "temporal_reuse", False)


__all__ = ["FEATURES", "PATCH", "ReuseRule", "TemporalReuse", "UnitReuse", "supports"]
