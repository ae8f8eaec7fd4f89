"""Apply per-job LoRA adapter sets to one model inside batched steps: merge in place or add
per-row low-rank terms, chosen per step from measured costs.

Two ways to give a row the adapters of its job (``AdapterSet``: ``(id, scale)`` pairs):
- **merged**: the module's weight is ``W0 + sum(scale * scaling * B @ A)``. Free at compute time,
  but one set for the whole model. The merged weights live beside the pristine ones
  (``workers/adapters/merge.py``): switching is a pointer swap, the pristine weights are never
  written (bit-identical after any number of merges), and a set can be merged in the background
  (``stage``) before a batch needs it.
- **terms**: the base (or merged) weights plus, for the rows of each job whose set differs from the
  merged one, ``(own - merged)`` as low-rank products ``B (A x)``: jobs with different adapters
  share one step. The rows of a job are found through the row layout the caller declares
  (``workers/adapters/layout.py``): the runner's batch rows, or the token packs the mask-aware
  controllers build.

Per step (``prepare``) the patcher picks the merged set ``M`` (none, the current one, or one of the
batch's sets) minimising ``switch(current -> M) + horizon * terms(M)``, where ``terms(M)`` is the
batch's low-rank work given ``M`` and ``horizon`` the steps the batch is expected to keep this
composition; the two costs are FLOP counts turned into seconds by rates measured on this device
(EMA of timed merges and timed term computations). A uniform batch merges; a mixed one usually
runs terms, or merges the set most of its rows share.

Half precision (float16 / bfloat16 models) never merges and applies terms adapter by adapter,
``y + B (A x) * scale`` with the roundings of PEFT's unfused forward, the path diffusers'
``load_lora_weights`` serves: a merged ``round(W + dW)`` or a fused float32-summed term moved bf16
edits 6-10/255 from it, terms in PEFT's order 0/255 (``tests/test_bf16_addons.py``).

How terms reach the computation: ``install`` gives every ``nn.Linear`` / ``nn.Conv2d`` of the
model a forward that adds the module's terms, if any. It must run before the mask-aware hooks are
installed, so that hooks calling a module's original forward on a token pack (diffusers
``ModelHook.fn_ref.original_forward``) still get the terms, and capture hooks record activations
that include them. With no terms the forward is the stock one plus one attribute check. The same
row-aware ``nn.Linear`` multiplies each job's rows on their own when the runner asks for batch
invariance (half precision: ``workers/adapters/layout.py``), so the mask-aware controllers install
it too, adapters or not.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.adapters import layout
from workers.adapters.lora import LoraModule, LoraWeights
from workers.adapters.merge import MergedWeights

log = logging.getLogger(__name__)

AdapterSet = tuple[tuple[str, float], ...]
Resolver = Callable[[str], LoraWeights]


# A module's terms for one group, added one after the other: ``(A, B, scale)`` adds
# ``B (A x) * scale`` (``scale`` None: already folded into B). float32: one fused pair (all the
# group's adapters concatenated, scales in B); half precision: one per adapter, unscaled, as PEFT
# computes ``result + lora_B(lora_A(x)) * scaling``: the same roundings as diffusers' LoRA path.
GroupTerms = list[tuple[torch.Tensor, torch.Tensor, float | None]]
HALF = (torch.float16, torch.bfloat16)
ALL_ROWS = -1  # the group of ``LoraPatcher.apply``: every row of every call


def _add_linear(xs: torch.Tensor, ys: torch.Tensor, terms: GroupTerms) -> None:
    for a, b, scale in terms:
        d = F.linear(F.linear(xs, a), b)
        ys.add_(d if scale is None else d * scale)


def _add_conv(mod: torch.nn.Conv2d, x: torch.Tensor, y: torch.Tensor, terms: GroupTerms) -> None:
    for a, b, scale in terms:
        d = F.conv2d(F.conv2d(x, a, None, mod.stride, mod.padding, mod.dilation, mod.groups), b)
        y.add_(d if scale is None else d * scale)


class _Terms:
    """One module's per-group low-rank terms for the current step: group -> ``GroupTerms``."""

    __slots__ = ("by_group", "patcher", "name")

    def __init__(self, patcher: "LoraPatcher", name: str) -> None:
        self.by_group: dict[int, GroupTerms] = {}
        self.patcher = patcher
        self.name = name

    def linear(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        every = self.by_group.get(ALL_ROWS)
        if every is not None:  # ``LoraPatcher.apply``: no layout, every row
            _add_linear(x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]), every)
            return y
        lay = layout.current()
        if lay is None:
            raise RuntimeError(f"{self.name}: adapter terms but no row layout declared")
        t0 = time.perf_counter()
        if lay.flat:
            xs, ys = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        else:
            xs, ys = x, y
        if xs.shape[0] != lay.total:
            raise ValueError(f"{self.name}: input has {xs.shape[0]} rows, the row layout declares {lay.total}")
        for g, lo, hi in lay.spans:
            terms = self.by_group.get(g)
            if terms:
                _add_linear(xs[lo:hi], ys[lo:hi], terms)
        self.patcher.term_seconds += time.perf_counter() - t0
        return y

    def conv(self, mod: torch.nn.Conv2d, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        every = self.by_group.get(ALL_ROWS)
        if every is not None:  # ``LoraPatcher.apply``: no layout, every row
            _add_conv(mod, x, y, every)
            return y
        lay = layout.current()
        if lay is None or lay.flat or x.shape[0] != lay.total:
            raise ValueError(f"{self.name}: conv adapter terms need a batch-row layout of {x.shape[0]} rows")
        t0 = time.perf_counter()
        for g, lo, hi in lay.spans:
            terms = self.by_group.get(g)
            if terms:
                _add_conv(mod, x[lo:hi], y[lo:hi], terms)
        self.patcher.term_seconds += time.perf_counter() - t0
        return y


@functools.lru_cache(maxsize=256)
def _job_spans(lay: layout.Layout) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each job's row spans of a layout, jobs in order of first appearance (cached: a step reuses
    a handful of layouts across every module)."""
    by_group: dict[int, list[tuple[int, int]]] = {}
    for g, lo, hi in lay.spans:
        by_group.setdefault(g, []).append((lo, hi))
    return tuple(tuple(spans) for spans in by_group.values())


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out[:] = F.linear(x, weight, bias)`` without the intermediate: the product ``F.linear``
    computes for a contiguous input (``addmm``/``mm`` over its rows, leading dims folded), written in
    place."""
    if not (x.is_contiguous() and out.is_contiguous()):
        out.copy_(F.linear(x, weight, bias))
        return
    x2, o2 = x.view(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(x2, weight.t(), out=o2)
    else:
        torch.addmm(bias, x2, weight.t(), out=o2)


def _linear_job_by_job(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with each job's rows multiplied on their own (``layout.invariant``): a job's rows,
    gathered in layout order when they lie in several spans (the single Flux blocks' pack: its
    text, then its image tokens, as the stock block concatenates them), make one product of the
    shape the stock pipeline computes for that job alone. Any other input (no layout, one job, rows
    that do not match the layout) is one product."""
    lay = layout.current()
    if lay is None or len(jobs := _job_spans(lay)) < 2:
        return F.linear(x, weight, bias)
    xs = x.reshape(-1, x.shape[-1]) if lay.flat else x
    if xs.shape[0] != lay.total:
        return F.linear(x, weight, bias)
    out = xs.new_empty((*xs.shape[:-1], weight.shape[0]))
    for spans in jobs:
        if len(spans) == 1:
            lo, hi = spans[0]
            _linear_into(out[lo:hi], xs[lo:hi], weight, bias)
            continue
        y = F.linear(torch.cat([xs[lo:hi] for lo, hi in spans]), weight, bias)
        row = 0
        for lo, hi in spans:
            out[lo:hi] = y[row:row + hi - lo]
            row += hi - lo
    return out.view(*x.shape[:-1], weight.shape[0]) if lay.flat else out


class LoraLinear(torch.nn.Linear):
    """``nn.Linear`` that adds its current adapter terms, and multiplies job by job when the step
    asks for batch invariance (``install``)."""

    _stencil_terms: _Terms | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if layout.invariant():
            y = _linear_job_by_job(input, self.weight, self.bias)
        else:
            y = F.linear(input, self.weight, self.bias)
        terms = self._stencil_terms
        return y if terms is None else terms.linear(input, y)


class LoraConv2d(torch.nn.Conv2d):
    """``nn.Conv2d`` that adds its current adapter terms (``install``)."""

    _stencil_terms: _Terms | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = self._conv_forward(input, self.weight, self.bias)
        terms = self._stencil_terms
        return y if terms is None else terms.conv(self, input, y)


_SWAP = {torch.nn.Linear: LoraLinear, torch.nn.Conv2d: LoraConv2d}


def install(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Give every plain Linear/Conv2d of ``model`` the terms-aware forward (same class otherwise:
    weights, state dict and ``isinstance`` checks are unchanged). Returns path -> module."""
    out = {}
    for path, mod in model.named_modules():
        cls = _SWAP.get(type(mod))
        if cls is not None:
            registry = getattr(mod, "_diffusers_hook", None)
            if registry is not None and registry.hooks:
                # Those hooks captured the stock forward: they would bypass the terms (module doc).
                raise RuntimeError(f"{path} already has diffusers hooks: install adapters before mask-aware hooks")
            mod.__class__ = cls
        if isinstance(mod, (LoraLinear, LoraConv2d)):
            out[path] = mod
    return out


@dataclass
class GroupDemand:
    """One job of the step as the patcher sees it."""

    adapters: AdapterSet
    tokens: float  # token rows the job computes this step (rows x tokens): what terms cost scales with
    remaining: int = 1


@dataclass
class PatchStats:
    merges: int = 0
    merge_seconds: float = 0.0
    term_seconds: float = 0.0
    steps_merged: int = 0
    steps_terms: int = 0
    last_merged: AdapterSet = ()
    device_copies_dropped: int = 0


class _Rate:
    """Seconds per unit of work (EMA), from measurements."""

    def __init__(self, prior: float) -> None:
        self.value = prior
        self.seen = False

    def observe(self, work: float, seconds: float) -> None:
        if work <= 0 or seconds <= 0:
            return
        r = seconds / work
        self.value = r if not self.seen else 0.8 * self.value + 0.2 * r
        self.seen = True


class LoraPatcher:
    """Per-step adapter application for one model (module docstring)."""

    def __init__(self, model: torch.nn.Module, component: str, resolve: Resolver, *,
                 max_term_cache: int = 256, merge_buffers: int = 2,
                 resident: Callable[[], Collection[str]] | None = None) -> None:
        self.model = model
        self.component = component
        self.resolve = resolve
        # The adapters the host tier holds (``AdapterBank.resident``): a device copy of one it has
        # evicted is dropped once no step uses it, so a long tail of adapters does not pile up on the
        # device. None: keep every device copy (a patcher with a fixed set, the CPU's text encoders).
        self.resident = resident
        self.modules = install(model)
        self.weights = MergedWeights(self.modules, self._mods, merge_buffers)
        self._lock = threading.Lock()  # _mods is also called from the background merge thread
        self._active: dict[str, _Terms] = {}  # modules with terms this step
        self._term_cache: dict[tuple[str, AdapterSet], tuple[torch.Tensor, torch.Tensor]] = {}
        self._max_term_cache = max_term_cache
        self._device_mods: dict[str, dict[str, LoraModule]] = {}
        self._units_memo: dict[str, tuple[float, float]] = {}
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # In half precision a merged weight round(W + dW) is not what diffusers computes (PEFT's
        # unfused round(W x) + round(B (A x)) * s): measured 10/255 from it in bf16 after 6 steps,
        # against 0 with terms. Such models serve adapters as terms only, float32 ones choose.
        self.merge_allowed = p.dtype not in HALF
        # Both costs are FLOP counts turned into seconds by rates measured here (one prior for both).
        self.merge_rate = _Rate(2e-10)
        self.term_rate = _Rate(2e-10)
        self.term_seconds = 0.0  # accumulated by the modules' terms during a step
        self._predicted_units = 0.0
        self.stats = PatchStats()

    # -- adapters on the device ----------------------------------------------------------------
    @property
    def merged(self) -> AdapterSet:
        """The set the weights hold now (``()``: the pristine base weights)."""
        return self.weights.current

    @property
    def on_device(self) -> set[str]:
        """The adapters whose factors are on the model's device now."""
        with self._lock:
            return set(self._device_mods)

    def _mods(self, lora_id: str) -> dict[str, LoraModule]:
        with self._lock:
            mods = self._device_mods.get(lora_id)
            if mods is None:
                weights = self.resolve(lora_id)
                mods = {}
                for path, m in weights.modules(self.component).items():
                    if path not in self.modules:
                        raise KeyError(f"adapter {lora_id}: {self.component} has no module {path}")
                    mods[path] = m.to(self.device, self.dtype)
                self._device_mods[lora_id] = mods
            return mods

    def forget(self, lora_id: str) -> None:
        """Drop an adapter's device copy (it must not be merged)."""
        if any(i == lora_id for i, _ in self.merged):
            raise RuntimeError(f"adapter {lora_id} is merged")
        with self._lock:
            self._device_mods.pop(lora_id, None)
        self._units_memo.pop(lora_id, None)
        self._term_cache = {k: v for k, v in self._term_cache.items() if all(i != lora_id for i, _ in k[1])}

    def _drop_evicted(self, used: set[str]) -> None:
        """Forget the device copies of adapters the host tier no longer holds and that neither this
        step nor a merge buffer uses (a later job that needs one reads it again, as a first use does)."""
        unused = [i for i in self._device_mods if i not in used]
        if not unused:  # the usual step: nothing on the device but what it uses
            return
        keep = set(self.resident()) | self.weights.held()  # type: ignore[misc]
        for lora_id in unused:
            if lora_id not in keep:
                self.forget(lora_id)
                self.stats.device_copies_dropped += 1

    def _units(self, lora_id: str) -> tuple[float, float]:
        """(term FLOPs per token row, merge FLOPs) of one adapter on this model."""
        memo = self._units_memo.get(lora_id)
        if memo is None:
            term = merge = 0.0
            for m in self._mods(lora_id).values():
                fan_in = m.down[0].numel()
                term += 2 * m.rank * (fan_in + m.up.shape[0])
                merge += 2 * m.rank * fan_in * m.up.shape[0]
            memo = self._units_memo[lora_id] = (term, merge)
        return memo

    # -- merging -------------------------------------------------------------------------------
    def merge(self, adapters: AdapterSet) -> None:
        """Make the weights hold ``adapters`` (``()``: the pristine base weights), exactly."""
        if adapters == self.merged:
            return
        ids = {i for i, _ in self.merged} | {i for i, _ in adapters}
        before = self.weights.sync_seconds
        t0 = time.perf_counter()
        self.weights.switch(adapters)
        took = time.perf_counter() - t0
        if self.weights.sync_seconds > before:  # a merge on this path (not a swap): calibrate its rate
            self.merge_rate.observe(sum(self._units(i)[1] for i in ids), self.weights.sync_seconds - before)
        self.stats.merges += 1
        self.stats.merge_seconds += took
        log.debug("%s: switched to %s in %.4f s", self.component, adapters, took)

    def stage(self, adapters: AdapterSet) -> bool:
        """Merge ``adapters`` in the background so a later switch to them is a swap. Not in half
        precision: such a model never switches to a merged set, and the merge would take device
        time from the very job that routed it (``stencil.prefetch_loras`` stages on an idle engine)."""
        if not self.merge_allowed:
            return False
        return self.weights.stage(adapters)

    def base_identical(self) -> bool:
        """True when no adapter is merged and every adapted weight is its pristine self."""
        return self.weights.base_identical()

    # -- per-step plan -------------------------------------------------------------------------
    @staticmethod
    def diff(own: AdapterSet, merged: AdapterSet) -> AdapterSet:
        """The term a row needs: its own set minus the merged one, as (id, coefficient) pairs."""
        out = dict(own)
        for i, s in merged:
            out[i] = out.get(i, 0.0) - s
        return tuple(sorted((i, c) for i, c in out.items() if c != 0.0))

    def _term_units(self, groups: Sequence[GroupDemand], merged: AdapterSet) -> float:
        return sum(g.tokens * self._units(i)[0] for g in groups for i, _ in self.diff(g.adapters, merged))

    def choose(self, groups: Sequence[GroupDemand], ready_only: bool = False) -> AdapterSet:
        """The merged set for this step (module doc): least predicted seconds over the horizon.
        Half-precision models never merge (``merge_allowed``)."""
        if not self.merge_allowed:
            return ()
        if not groups:
            return self.merged
        sets = list(dict.fromkeys(g.adapters for g in groups))
        candidates = list(dict.fromkeys([self.merged, (), *sets]))
        if ready_only:
            candidates = [c for c in candidates if self.weights.ready(c)]
        horizon = max(1.0, statistics.median(g.remaining for g in groups))
        best, best_cost = self.merged, math.inf
        for cand in candidates:
            switch = 0.0
            if not self.weights.ready(cand):  # a merge on the critical path, not a swap
                switch = sum(self._units(i)[1] for i in {i for i, _ in cand})
            cost = switch * self.merge_rate.value + horizon * self._term_units(groups, cand) * self.term_rate.value
            if cost < best_cost * (1 - 1e-9):
                best, best_cost = cand, cost
        return best

    def prepare(self, groups: Sequence[GroupDemand]) -> AdapterSet:
        """Set up one step: merge the chosen set and give every module its per-group terms (group =
        index in ``groups``, as the row layouts name them). Returns the merged set."""
        merged = self.choose(groups)
        if not self.weights.ready(merged) and self.stage(merged):
            # Merging it now would stall this step: merge it in the background and run this step
            # with what is ready (terms for the rest); a later step swaps it in at no cost.
            merged = self.choose(groups, ready_only=True)
        self.merge(merged)
        if self.resident is not None:
            self._drop_evicted({i for demand in groups for i, _ in demand.adapters} | {i for i, _ in merged})
        active: dict[str, _Terms] = {}
        for g, demand in enumerate(groups):
            diff = self.diff(demand.adapters, merged)
            if not diff:
                continue
            for path, ab in self._group_terms(diff).items():
                terms = active.get(path)
                if terms is None:
                    terms = active[path] = self._active.get(path) or _Terms(self, f"{self.component}.{path}")
                    terms.by_group.clear()
                terms.by_group[g] = ab
        for path in self._active.keys() - active.keys():
            self.modules[path]._stencil_terms = None
        for path, terms in active.items():
            self.modules[path]._stencil_terms = terms
        self._active = active
        layout.set_wanted(bool(active))
        self._predicted_units = self._term_units(groups, merged) if active else 0.0
        self.term_seconds = 0.0
        if active:
            self.stats.steps_terms += 1
        elif merged:
            self.stats.steps_merged += 1
        self.stats.last_merged = merged
        return merged

    def finish(self) -> None:
        """After the step's forward: calibrate the term rate (predicted units vs measured seconds),
        and withdraw the step's demand for row layouts (a thread-local flag: left set, it would make
        any other model stepped later on this thread take its eager, layout-declaring path)."""
        if self._predicted_units > 0 and self.term_seconds > 0:
            self.term_rate.observe(self._predicted_units, self.term_seconds)
            self.stats.term_seconds += self.term_seconds
        self._predicted_units = 0.0
        layout.set_wanted(False)

    def _group_terms(self, diff: AdapterSet) -> dict[str, GroupTerms]:
        """Per module: A = [A_1; A_2; ...], B = [c_1 s_1 B_1, c_2 s_2 B_2, ...] (one matmul pair);
        in half precision the adapters one by one, unscaled, with their scales (``GroupTerms``)."""
        paths: set[str] = set()
        for i, _ in diff:
            paths.update(self._mods(i))
        out: dict[str, GroupTerms] = {}
        if self.dtype in HALF:
            for path in paths:
                out[path] = [(m.down, m.up, c * m.scaling) for i, c in diff
                             if (m := self._mods(i).get(path)) is not None]
            return out
        for path in paths:
            ab = self._term_cache.get((path, diff))
            if ab is None:
                downs, ups = [], []
                for i, c in diff:
                    m = self._mods(i).get(path)
                    if m is not None:
                        downs.append(m.down)
                        ups.append(m.up * (c * m.scaling))
                ab = (torch.cat(downs), torch.cat(ups, dim=1))
                if len(self._term_cache) >= self._max_term_cache:
                    self._term_cache.pop(next(iter(self._term_cache)))
                self._term_cache[(path, diff)] = ab
            out[path] = [(ab[0], ab[1], None)]
        return out

    def apply(self, adapters: AdapterSet) -> None:
        """The whole model serves ``adapters`` (one job at a time: a CPU worker's text encoder):
        merged where merging is exact (float32), else as terms on every row."""
        if self.merge_allowed:
            self.merge(adapters)
            return
        self.clear()
        self.merge(())
        active: dict[str, _Terms] = {}
        for path, ab in (self._group_terms(adapters) if adapters else {}).items():
            terms = active[path] = _Terms(self, f"{self.component}.{path}")
            terms.by_group[ALL_ROWS] = ab
            self.modules[path]._stencil_terms = terms
        self._active = active

    def clear(self) -> None:
        """No terms (between steps, or a step without adapters); the merged set stays."""
        for path in self._active:
            self.modules[path]._stencil_terms = None
        self._active = {}
        layout.set_wanted(False)


__all__ = ["AdapterSet", "GroupDemand", "LoraConv2d", "LoraLinear", "LoraPatcher", "install"]
