"""What every model family's runner shares: per-job cache modes, transactional steps, results.

A runner owns a denoiser and executes ONE denoising step for a whole batch of jobs. Each job runs
in one of three modes. ``full``: normal compute. ``record`` (a template warm-up): normal compute,
and this step's activations go to the template's cache. ``masked`` (an edit of a warmed template):
only the job's masked tokens are computed in the transformer blocks; unmasked tokens come from
the template cache for the job's own current step. If that step's cache is not resident in host
RAM yet, the job computes the step fully instead of waiting (never a stall, never a wrong cache);
the job's state counts such steps.

Refresh steps (``meta["refresh_steps"]``, chosen by the fidelity policy, ``app/fidelity.py``): a
masked job computes those steps fully, recording its own activations like a warm-up would; from
then on its cache is the template's of the current step plus the offset (own - template) at the
last refresh (``OffsetCache``). The offset needs the template's cache of the refresh step; until
that is resident the job's steps compute fully (``_resolve``: never a wait in the step loop,
never a stale offset). An exact cache (recorded for this very edit) has no refresh steps.

A step is transactional: new latents are committed only after every job's update was launched, and
scheduler/generator state is rolled back on failure, so the engine can retry job by job to
isolate a failing job exactly. Whether each job's new latents are finite is read, on a GPU, one step
later (``workers/engine/settle.py``): the device runs a step while the host builds the next.

The load/compute plan (``cache_plan``, DESIGN.md pitfall 10). With a model that exposes plan
units (``MaskAwareUNet.units``: one per ``Transformer2DModel``) and a provider that loads them
block by block, a masked job whose step is not wholly resident does not simply fall back:
- ``"plan"`` (default): before the step, ``plan_optimal`` decides per unit whether the batch's
  non-resident jobs wait for that unit's load (cached compute) or compute it fully, from the
  online cost model (``UnitCostModel``: measured seconds per unit as a function of computed
  token rows, which covers batch size and mask ratio) and the store's measured bandwidth and
  latency; resident units are always used, units the plan skips are computed fully. Until the
  cost model has seen a unit (or the store's bandwidth is unknown) it behaves like ``resident``.
- ``"all"``: wait for every unit's load (block-wise pipelining; a baseline).
- ``"resident"``: use what is resident, never wait (per unit).
- ``"step"``: the per-step rule only (whole step resident or full compute).
Waiting is bounded: a unit that is not there by its deadline (its planned compute start plus what
the cache saves on it, and never past the step-wide bound) is computed fully, so a slow or failed
store can never stall the loop for long, and the result is correct either way.

Ahead of time (``"plan"``): while step s computes, step s+1 of the batch's masked jobs is planned
with the copy stream's expected idle time as its lead and its chosen units are queued behind step
s's (``_plan_ahead``); loads start after background fetches already on the link
(``copy_busy_s``). When loading a step takes longer than computing it (``link_bound``, measured),
running jobs get no whole-step background prefetch: whole steps would arrive late and hold the
link, so only the units the plan picks are loaded, one step ahead. Waiting jobs still prefetch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.adapters import layout
from workers.adapters.patcher import install as install_row_aware
from workers.engine.bandwidth import host_read_gbps
from workers.engine.job import EngineJob
from workers.engine.plan import RESIDENT, UNAVAILABLE, BlockCost, StepPlan, Tier, UnitCostModel, plan_optimal
from workers.engine.settle import LaunchedStep, finite_flags, read_failures, to_host
from workers.engine.staging import CacheStager, Offset
from workers.engine.stepper import make_stepper, step_batch
from workers.engine.template_cache import CacheRecorder, StepCacheProvider, UnitCache, key_stored_steps
from workers.maskaware.activation_store import TemplateCacheKey
from workers.maskaware.reuse import ReuseRule, TemporalReuse
from workers.maskaware.reuse import supports as reuse_supported
from workers.maskaware.reuse_rule import default_rule

log = logging.getLogger(__name__)

CACHE_PLANS = ("plan", "all", "resident", "step")


@dataclass
class PlanJob:
    """One job's rows as the plan sees them (see ``unit_costs``)."""

    rows: int
    token_mask: Any = None  # None: computes every token of every unit
    slot: tuple[str, int] | None = None  # (cache digest, step) it loads from, if pending
    resident: set[str] | None = None  # pending jobs: units already resident; None: all resident
    full_units: frozenset[str] = frozenset()  # units its cache does not store: always computed fully
    codec: str = ""  # storage codec of its cache (bytes to load); "" = the model's dtype
    shared: frozenset[str] = frozenset()  # names its cache stores with one row (bit-equal rows)


REFERENCE_RATIO = 0.2  # the edit a warm-up's stored units are planned for (FlashPS's headline ratio)


@dataclass(frozen=True)
class RatioMask:
    """A token mask that only knows its size: ``count(n)`` = round(ratio * n) (planning only)."""

    ratio: float

    def count(self, n: int) -> int:
        return int(round(self.ratio * n))


GAP = "gap:"  # plan blocks for the compute between units (ResNets, convs): always computed


def unit_costs(ctrl: Any, cost: UnitCostModel, jobs: list[PlanJob], latent_hw: tuple[int, int],
               store: Tier | None) -> list[BlockCost] | None:
    """The plan's input for one step of a batch: per unit, the batch's time if the pending jobs
    use the cache (after loading what is not resident) or compute fully, and the bytes to load
    (deduplicated per cache slot); before each unit a fixed block for the other compute since the
    previous one (loads overlap with it too). None if any time is unknown (never plan with
    guesses)."""
    blocks = []
    batch_rows = sum(j.rows for j in jobs)
    for u in ctrl.units:
        gap = cost.predict(GAP + u, batch_rows)
        if gap is None:
            return None
        blocks.append(BlockCost(GAP + u, gap, gap, 0, UNAVAILABLE))
        n = ctrl.unit_tokens(u, latent_hw)
        base = extra_cached = extra_full = nbytes = 0
        slots: set[tuple[str, int]] = set()
        for j in jobs:
            if j.token_mask is None:
                base += j.rows * n
                continue
            if u in j.full_units:
                base += j.rows * n
                continue
            m = j.rows * j.token_mask.count(n)
            if j.resident is None or u in j.resident:
                base += m
                continue
            extra_cached += m
            extra_full += j.rows * n
            if j.slot not in slots:
                slots.add(j.slot)  # type: ignore[arg-type]
                kwargs: dict[str, Any] = {"codec": j.codec} if j.codec else {}
                if j.shared:
                    kwargs["shared"] = j.shared
                nbytes += ctrl.unit_nbytes(u, latent_hw, j.rows, **kwargs)
        cached = cost.predict(u, base + extra_cached)
        full = cost.predict(u, base + extra_full)
        if cached is None or full is None:
            return None
        tier = RESIDENT if nbytes == 0 else (store if store is not None else UNAVAILABLE)
        blocks.append(BlockCost(u, cached, full, nbytes, tier))
    return blocks


@dataclass
class JobState:
    """Per-job denoising state common to all families (subclasses add model inputs)."""

    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    generator: torch.Generator
    mode: str = "full"  # full | record | masked
    cache_key: TemplateCacheKey | None = None
    token_masks: Any = None
    masked_steps: int = 0
    fallback_steps: int = 0
    commit: Future | None = None
    refresh: frozenset[int] = frozenset()  # masked mode: steps computed fully to re-anchor the cache
    delta: dict[str, torch.Tensor] | None = None  # own minus template activations at the last refresh
    anchor: tuple[int, dict[str, torch.Tensor]] | None = None  # a refresh whose template step is not resident
    refresh_steps: int = 0
    adapters: tuple[tuple[str, float], ...] = ()  # the job's LoRA set ((id, scale), ...)
    lora_late: bool = False  # may start before its adapters are loaded (``late`` patch policy)
    lora_applied: int | None = None  # step from which the adapters apply (None: not yet)
    lora_cutoff: int = 0  # late jobs: the step by which they must apply (they wait there otherwise)
    extra: dict[str, Any] = field(default_factory=dict)
    stepper: Any = None  # ``workers.engine.stepper``: the scheduler's update with precomputed scalars
    model_times: torch.Tensor | None = None  # the timesteps on the compute device (the model's input)
    reuse: TemporalReuse | None = None  # masked mode, ``turbo``: patches taken from the job's last step
    failure: Exception | None = None  # why a read of its steps failed it (``settle``)

    def __post_init__(self) -> None:
        if self.stepper is None:  # the scheduler and schedule as given (tests build states directly)
            self.stepper = make_stepper(self.scheduler, self.timesteps, self.generator)

    @property
    def rows(self) -> int:
        return 1


def observe_context(cost: UnitCostModel, ctx: Any) -> None:
    """Feed one mask-aware call's measured unit times (minus load waits) and the compute between
    units to the cost model."""
    resolve = getattr(ctx, "resolve_timings", None)
    if resolve is not None:
        resolve()
    device_timed = getattr(ctx, "device_timed", False)  # device time excludes the host's load waits
    for unit, seconds in ctx.unit_seconds.items():
        rows = ctx.unit_tokens.get(unit)
        if rows:
            cost.observe(unit, rows, seconds if device_timed else seconds - ctx.unit_wait.get(unit, 0.0))
    for unit, seconds in getattr(ctx, "unit_gap", {}).items():
        cost.observe(GAP + unit, ctx.total_rows, seconds)


class BaseRunner(ABC):
    """Cache-mode bookkeeping and the transactional step; subclasses run the model."""

    def __init__(self, maskaware: Any = None, caches: StepCacheProvider | None = None,
                 recorder: CacheRecorder | None = None, dilation: int = 0, prefetch_steps: int = 4,
                 cache_plan: str = "plan", max_wait_s: float = 5.0, lora: Any = None, adapters: Any = None,
                 lora_late_max_fraction: float = 0.3, read_gbps: float | None = 0.0,
                 batch_invariant: bool | None = None) -> None:
        if cache_plan not in CACHE_PLANS:
            raise ValueError(f"cache_plan must be one of {CACHE_PLANS}, got {cache_plan!r}")
        self.lora = lora  # workers.adapters.patcher.LoraPatcher (installed before the mask-aware hooks)
        self._batch_invariant = batch_invariant  # None: by the model's dtype (``_init_invariance``)
        self.batch_invariant = False
        self.adapters = adapters  # workers.adapters.bank.AdapterBank
        self.lora_late_max_fraction = lora_late_max_fraction
        self.maskaware = maskaware
        self.caches = caches
        self.recorder = recorder
        self.dilation = dilation
        self.prefetch_steps = prefetch_steps
        self.cache_plan = cache_plan
        self.max_wait_s = max_wait_s
        # Warm-ups store only the units worth reading at this speed (``_select_units``); None (the
        # service's): the host-to-device copy measured on first use (``workers/engine/bandwidth.py``);
        # 0: store every unit.
        self.read_gbps = read_gbps
        self._stager: CacheStager | None = None
        self.unit_cost = UnitCostModel()
        self.last_plan: StepPlan | None = None
        self.last_ahead: tuple[float, StepPlan] | None = None  # (lead_s, plan) of the last step ahead
        self._step_s: float | None = None  # measured step time (EMA): the lead when nothing loads
        self._step_plan: StepPlan | None = None  # this step's plan, if it planned loads
        self.link_bound = False  # measured: loading a step takes longer than computing it
        self._ahead: dict[tuple[str, int], set[str]] = {}  # (cache, step) -> units chosen a step ahead
        self.last_ctx: Any = None  # the mask-aware context of the last step (set by _forward)
        self.last_step_graph = "off"  # how the last step's denoiser call ran (``graphs.StepGraphs.last``)
        self._launched: list[LaunchedStep] = []  # steps launched and not read yet (``settle``)
        self._failures: list[tuple[EngineJob, Exception]] = []  # found by reads, until ``failures``
        self._read: list[tuple[list[EngineJob], float]] = []  # steps read and their time, until ``read_steps``
        self._last_read = 0.0  # when the last read returned (monotonic)
        self._units_on = (cache_plan != "step" and hasattr(maskaware, "units")
                          and hasattr(caches, "set_units") and hasattr(caches, "unit_status"))
        # What a provider loads: the plan's units, and with mask-aware ResNets one more group
        # (``MaskAwareUNet.loaded_units``), loaded with the units the plan waits for.
        loaded = getattr(maskaware, "loaded_units", None)
        self._loaded: dict[str, list[str]] = loaded() if loaded is not None else {}
        self._extra_loads = [u for u in self._loaded if u not in getattr(maskaware, "units", ())]
        if self._units_on:
            caches.set_units(self._loaded or {u: maskaware.unit_tensor_names(u)  # type: ignore[union-attr]
                                              for u in maskaware.units})

    def _init_invariance(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Batched steps multiply each job's rows on their own (``workers/adapters/layout.py``): asked
        for, or by default in half precision off CUDA (``Settings.batch_invariant_for``). Needs the
        row-aware modules (installed here if the mask-aware controller has not)."""
        wanted = self._batch_invariant
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.batch_invariant = (dtype in (torch.float16, torch.bfloat16) and not on_cuda) if wanted is None else wanted
        if self.batch_invariant:
            install_row_aware(model)

    _bucket_tokens: bool | None = None

    @property
    def bucket_tokens(self) -> bool:
        """Masked jobs compute token counts rounded up to token buckets
        (``workers/maskaware/buckets.py``): where steps are graph-captured (a graph then serves
        every mask of its buckets, not only the batch it was captured for), unless the model's
        batch indices are ragged there (a graph's shapes then name no job's count: only the
        batch's total is bucketed, ``workers/maskaware/batched.py``)."""
        if self._bucket_tokens is not None:
            return self._bucket_tokens
        ragged_on = getattr(self.maskaware, "ragged_on", None)
        ragged = ragged_on is not None and ragged_on(getattr(self, "device", "cpu"))
        return getattr(self, "graphs", None) is not None and not ragged

    @bucket_tokens.setter
    def bucket_tokens(self, on: bool) -> None:
        self._bucket_tokens = on

    # -- family-specific -------------------------------------------------------------------------
    @abstractmethod
    def init_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> JobState: ...

    @abstractmethod
    def _forward(self, batch: list[EngineJob], groups: list[Any] | None) -> tuple[Any, list[Any]]:
        """One denoiser call for the batch; returns (model output rows, recorded caches). The output is
        one tensor of all rows in batch order, or (jobs of different sizes) a list of each job's rows."""

    @abstractmethod
    def _guided_batch(self, batch: list[EngineJob], output: Any) -> list[torch.Tensor]:
        """Every job's model output from its rows (classifier-free guidance, if any), in batch order
        (``output``: the step's rows in batch order, or one tensor per job; ``job_rows``), launched
        once for the whole batch."""

    @abstractmethod
    def _row_group(self, rows: int, mode: str, token_mask: Any = None, cache: Any = None) -> Any: ...

    @abstractmethod
    def _token_masks(self, st: JobState, tensors: dict[str, torch.Tensor]) -> Any: ...

    # -- adapters ------------------------------------------------------------------------------------
    def _init_adapters(self, st: JobState, meta: dict[str, Any]) -> None:
        adapters = tuple((str(i), float(c)) for i, c in meta.get("loras") or ())
        if not adapters:
            st.lora_applied = 0
            return
        if self.lora is None or self.adapters is None:
            raise ValueError("this worker does not apply LoRA adapters")
        st.adapters = adapters
        st.lora_late = meta.get("lora_patch") == "late"
        st.lora_cutoff = int(self.lora_late_max_fraction * len(st.timesteps))
        self.adapters.prefetch(i for i, _ in adapters)

    def ready(self, job: EngineJob) -> bool:
        """May the job be admitted now? An exact job's adapters must be resident (loading never
        stalls a step); a late one starts without them. Raises if an adapter will never load."""
        st: JobState = job.state
        if not st.adapters or st.lora_applied is not None:
            return True
        ids = [i for i, _ in st.adapters]
        why = self.adapters.failure(ids)
        if why:
            raise RuntimeError(why)
        if self.adapters.ready(ids):
            return True
        self.adapters.prefetch(ids)
        return st.lora_late

    def runnable(self, job: EngineJob) -> bool:
        """May an admitted job take this step? A late job past its cutoff waits for its adapters."""
        st: JobState = job.state
        if st.lora_applied is not None or not st.adapters:
            return True
        if self.adapters.ready(i for i, _ in st.adapters):
            return True
        return job.steps_done < st.lora_cutoff

    def _apply_adapters(self, batch: list[EngineJob]) -> list[EngineJob]:
        """Order the batch by adapter set (each set's rows contiguous), apply late adapters that
        arrived, and set up the patcher's merge and per-row terms for this step."""
        from workers.adapters.patcher import GroupDemand

        if self.lora is None:
            return batch
        for job in batch:
            st: JobState = job.state
            if st.lora_applied is None and self.adapters.ready(i for i, _ in st.adapters):
                st.lora_applied = job.steps_done
        batch = sorted(batch, key=lambda j: self._effective(j.state))
        demands = [GroupDemand(self._effective(j.state), float(j.state.rows * self.masked_tokens(j.state)[0]),
                               j.remaining) for j in batch]
        if not any(d.adapters for d in demands) and not self.lora.merged:
            self.lora.clear()
            return batch
        merged = self.lora.prepare(demands)
        for job, demand in zip(batch, demands):
            if demand.adapters:
                key = "lora_merged_steps" if demand.adapters == merged else "lora_term_steps"
                job.state.extra[key] = job.state.extra.get(key, 0) + 1
        return batch

    def weights_swapped(self) -> bool:
        """Whether the model's weights hold a merged adapter set this step (``MergedWeights`` points
        them at a slot): a captured graph reads the weights it was captured with, by address."""
        return self.lora is not None and bool(self.lora.merged)

    def _owned(self, out: Any) -> Any:
        """A call's output that must outlive the step's next call: a replayed graph's output may
        lie in memory another graph of the shared pool uses as scratch, so it is copied out."""
        graphs = getattr(self, "graphs", None)
        if graphs is None or graphs.last == "eager":
            return out
        return out.clone()

    @staticmethod
    def _effective(st: JobState) -> tuple[tuple[str, float], ...]:
        return st.adapters if st.lora_applied is not None else ()

    # -- cache modes ---------------------------------------------------------------------------------
    def _init_cache_mode(self, st: JobState, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        mode = str(meta.get("cache_mode", "full"))
        if mode == "full":
            return
        if mode not in ("record", "masked"):
            raise ValueError(f"unknown cache mode {mode!r}")
        if self.maskaware is None or (mode == "masked" and self.caches is None) or \
                (mode == "record" and self.recorder is None):
            log.info("mask-aware inference is off on this worker: %s job runs full compute", mode)
            st.extra["cache_note"] = "mask-aware off on worker"
            return
        key = TemplateCacheKey.from_dict(dict(meta["cache_key"]))  # type: ignore[arg-type]
        base = key.layout.split("/")[0]  # "/noise-<seed>": the warm-up's noise (cpu_tasks)
        base, _, recorded_in = base.partition("@")  # "@bfloat16": recorded in that compute dtype
        layout = getattr(self.maskaware, "cache_layout", base)
        if base != layout:
            raise ValueError(f"cache layout {key.layout} does not match the worker's {layout}")
        dtype = getattr(self, "dtype", None)
        if dtype is not None and (recorded_in or "float32") != str(dtype).removeprefix("torch."):
            raise ValueError(f"cache {key.layout} was recorded in {recorded_in or 'float32'}, "
                             f"this worker computes in {dtype} (STENCIL_DTYPE differs between processes)")
        if key.steps not in (len(st.timesteps) + int(meta["t_start"]), len(st.timesteps)):
            raise ValueError("cache key steps do not match the job")
        st.mode, st.cache_key = mode, key
        if mode == "record":
            self._select_units(st, key)
        if mode == "masked":
            absent = self._absent_units(key)
            if absent:
                st.extra["absent_units"] = absent
            st.refresh = frozenset(int(s) for s in meta.get("refresh_steps", ()))
            st.token_masks = self._token_masks(st, tensors)
            prepare = getattr(st.token_masks, "prepare", None)
            if prepare is not None:  # counts and device indices now, never inside a step
                prepare(getattr(self, "device", "cpu"))
            if meta.get("temporal_reuse") and reuse_supported(self.maskaware):
                st.reuse = TemporalReuse(self.reuse_rule or default_rule(self.maskaware.reuse_family),
                                         len(st.timesteps), st.refresh, float(meta.get("guidance", 0.0)),
                                         self.maskaware.reuse_units, bucketed=self.bucket_tokens,
                                         max_tokens=self._full_tokens(st))
            self.caches.prefetch(key, range(self.prefetch_steps))  # type: ignore[union-attr]

    def _absent_units(self, key: TemplateCacheKey) -> frozenset[str]:
        """Plan units the cache's warm-up did not store (edits compute them fully)."""
        units = getattr(self.maskaware, "units", None)
        stored = getattr(self.caches, "stored_units", None)
        if not units or stored is None:
            return frozenset()
        kept = stored(key)
        return frozenset() if kept is None else frozenset(u for u in units if u not in kept)

    @property
    def stager(self) -> CacheStager:
        """Moves masked jobs' step caches to the device (``workers/engine/staging.py``); private,
        writable copies for models that write their fresh tokens into the cache."""
        if self._stager is None:
            self._stager = CacheStager(getattr(self, "device", "cpu"), writable=self.writable_caches)
        return self._stager

    writable_caches = False  # the model writes fresh tokens into staged caches (SD-family UNets)
    reuse_rule: ReuseRule | None = None  # temporal reuse's rule; None: the shipped one (benchmarks swap it)

    def _read_speed(self) -> float:
        """GB/s at which a step reads its cache (``read_gbps``, else measured once)."""
        if self.read_gbps is None:
            self.read_gbps = host_read_gbps(str(getattr(self, "device", "cpu")))
        return self.read_gbps

    def _select_units(self, st: JobState, key: TemplateCacheKey) -> None:
        """A template warm-up stores only the units whose read at ``_read_speed`` (host RAM to the
        compute device: what a step pays, prefetch hiding the store) is cheaper than recomputing
        them (``store_units``): with the plan's cost model (the
        online ``UnitCostModel`` and ``Tier.load_time``, as ``unit_costs`` builds the plan's input)
        for one step of an edit of this size at mask ratio ``REFERENCE_RATIO`` whose cache is not
        resident, a unit is kept iff ``load_s < full_s - cached_s``. Such a unit is what the plan
        loads on a busy link; a unit whose load costs more than the compute it saves would only
        ever be loaded on an idle link, so storing it buys little and costs host-tier room. Without
        measured unit costs yet, or for exact-region warm-ups (one edit's own recording, kept
        complete like their codec), every unit is stored."""
        units = getattr(self.maskaware, "units", None)
        if not units or key.exact_region or st.latents.dim() != 4:
            return
        gbps = self._read_speed()
        if gbps <= 0:
            return
        codec = getattr(self.recorder, "codec_for", lambda _k: "")(key)
        latent_hw = (int(st.latents.shape[-2]), int(st.latents.shape[-1]))
        # A warm-up whose rows see bit-equal inputs (prompt "" and negative prompt "") records
        # bit-equal rows, which the recorder stores once (``cache_codec.share_rows``).
        shared = (frozenset(self.maskaware.tensor_names())
                  if getattr(self.recorder, "share_rows", False) and self._rows_alike(st) else frozenset())
        job = PlanJob(st.rows, RatioMask(REFERENCE_RATIO), ("warm-up", 0), set(), codec=codec, shared=shared)
        blocks = unit_costs(self.maskaware, self.unit_cost, [job], latent_hw, Tier("host", gbps * 1e9))
        if blocks is None:
            log.info("warm-up %s: unit costs not measured yet, storing every unit", key.digest())
            return
        chosen = [b.name for b in blocks
                  if not b.name.startswith(GAP) and b.load_s < b.full_s - b.cached_s]
        # Groups a provider loads besides the plan's units (mask-aware ResNets' tensors) are always
        # stored: a masked step reads them whatever the plan loads.
        chosen += self._extra_loads
        st.extra["store_names"] = {n for u in chosen
                                   for n in self._loaded.get(u) or self.maskaware.unit_tensor_names(u)}
        set_units = getattr(self.recorder, "set_units", None)
        if set_units is not None:
            set_units(key, chosen)
        log.info("warm-up %s at %.3g GB/s: storing %d of %d units", key.digest(), gbps, len(chosen), len(units))

    def prefetch(self, job: EngineJob) -> None:
        """Start loading the next steps' caches of a (waiting or running) masked job. On a link
        slower than compute (``link_bound``) a running job's steps are left to the plan, which
        loads only the units that pay off, one step ahead (``_plan_ahead``)."""
        st: JobState = job.state
        if self.link_bound:
            return
        if st.mode == "masked" and self.caches is not None and st.cache_key is not None:
            self.caches.prefetch(st.cache_key, range(job.steps_done, job.steps_done + self.prefetch_steps))

    def _group(self, job: EngineJob) -> Any:
        st: JobState = job.state
        if st.mode == "record":  # steps its cache does not store (STENCIL_CACHE_STEPS) capture nothing
            keep = key_stored_steps(st.cache_key) if st.cache_key is not None else None
            return self._row_group(st.rows, "record" if keep is None or job.steps_done in keep else "full")
        if st.mode == "masked" and job.steps_done in st.refresh:
            return self._row_group(st.rows, "record")  # full compute; its activations re-anchor
        if st.mode == "masked" and not self._resolve(st):
            st.extra["fallback_pending"] = True  # no valid offset yet: compute fully (exact)
            st.extra["no_offset"] = True
            return self._row_group(st.rows, "full")
        if st.mode == "masked":
            assert self.caches is not None and st.cache_key is not None
            # Block-wise loading: the plan queues this step's unit loads before its background
            # completion (``_plan_groups``), so the copy stream is not raced for the first unit.
            cache = self.caches.ready(st.cache_key, job.steps_done, fetch=not self._units_on)
            if cache is not None:
                return _ToStage(cache)
            st.extra["fallback_pending"] = True
        return self._row_group(st.rows, "full")

    def _groups(self, batch: list[EngineJob]) -> list[Any]:
        """Each job's row group; the masked jobs' caches staged together, in the order the step
        runs them (``_step_order``), so that adjacent jobs share slabs (``staging``)."""
        groups = [self._group(job) for job in batch]
        pending = sorted((i for i, g in enumerate(groups) if isinstance(g, _ToStage)),
                         key=lambda i: _count_key(batch[i].state.token_masks))
        staged = self.stager.take_batch([(batch[i].job_id, batch[i].steps_done, groups[i].cache, batch[i].state.delta)
                                         for i in pending])
        for i, cache in zip(pending, staged):
            st = batch[i].state
            groups[i] = self._row_group(st.rows, "masked", st.token_masks, cache)
        return groups

    def _plan_groups(self, batch: list[EngineJob], groups: list[Any]) -> list[Any]:
        """Per-unit plan for masked jobs whose step is not wholly resident (module doc)."""
        pending = []
        for i, job in enumerate(batch):
            st: JobState = job.state
            if st.mode == "masked" and st.extra.get("fallback_pending") and not st.extra.get("no_offset"):
                resident, failed = self.caches.unit_status(st.cache_key, job.steps_done)  # type: ignore[union-attr]
                if not failed:
                    pending.append((i, resident))
        if not pending or not _one_shape(batch):  # the unit plan's costs are per latent size
            return groups
        pending_idx = {i for i, _ in pending}
        plan_jobs = []
        for i, job in enumerate(batch):
            st = job.state
            if getattr(groups[i], "mode", "full") == "masked":
                plan_jobs.append(PlanJob(st.rows, st.token_masks, full_units=st.extra.get("absent_units", frozenset())))
            elif i not in pending_idx:
                plan_jobs.append(PlanJob(st.rows))
        for i, resident in pending:
            st = batch[i].state
            plan_jobs.append(PlanJob(st.rows, st.token_masks, (st.cache_key.digest(), batch[i].steps_done), resident,
                                     st.extra.get("absent_units", frozenset()), self._codec(st), self._shared(st)))
        units = self.maskaware.units
        extra = self._extra_loads
        latent_hw = (int(batch[0].state.latents.shape[-2]), int(batch[0].state.latents.shape[-1]))
        chosen: set[str]
        deadline: float | dict[str, float]
        self.last_plan = None
        if self.cache_plan == "all":
            chosen, deadline = set(units), time.monotonic() + self.max_wait_s
        else:
            chosen, deadline = set(), -math.inf
            blocks = None
            if self.cache_plan == "plan":
                blocks = unit_costs(self.maskaware, self.unit_cost, plan_jobs, latent_hw,
                                    self.caches.store_tier())  # type: ignore[union-attr]
            if blocks is not None:
                now = time.monotonic()
                plan = plan_optimal(blocks, copy_busy_s=self._link_busy())
                self.last_plan = self._step_plan = plan
                chosen = {b.name for b, use in zip(blocks, plan.use_cache) if use and not b.name.startswith(GAP)}
                # Bounded wait, per unit: past its planned compute start plus the time the cache
                # saves on it (full - cached), waiting costs more than computing it fully; and
                # never past the step-wide bound (the prediction with slack for model error).
                step_bound = now + min(self.max_wait_s, 0.05 + 2 * plan.predicted_s)
                deadline = {b.name: min(step_bound, now + t.compute_start_s + max(0.0, b.full_s - b.cached_s))
                            for b, t in zip(blocks, plan.timeline) if b.name in chosen}
                deadline.update({u: step_bound for u in extra})
        names = self.maskaware.tensor_names()
        requested: list[tuple[TemplateCacheKey, int, list[str]]] = []
        seen: set[tuple[str, int]] = set()
        for i, resident in pending:
            job, st = batch[i], batch[i].state
            slot = (st.cache_key.digest(), job.steps_done)
            ahead = self._ahead.get(slot)
            # Planned a step ahead: keep that choice (loads were queued for it, and adding units
            # now would queue them ahead of the next step's); only drop what the plan now skips.
            absent = st.extra.get("absent_units", frozenset())
            want = [u for u in units if u in chosen and u not in resident and u not in absent
                    and (ahead is None or u in ahead)]
            if chosen:  # groups outside the plan's units are read by any masked step: first in the queue
                want = [u for u in extra if u not in resident] + want
            if want and slot not in seen:
                seen.add(slot)
                requested.append((st.cache_key, job.steps_done, want))
            cache = UnitCache(self.caches, st.cache_key, job.steps_done, names,  # type: ignore[arg-type]
                              wait_units=want, deadline=deadline)
            st.extra["unit_cache"] = cache
            groups[i] = self._row_group(st.rows, "masked", st.token_masks,
                                        cache if st.delta is None else OffsetCache(cache, st.delta))
        for u in extra + list(units):  # one queue in block order across the batch's caches (the copy stream)
            for key, step, want in requested:
                if u in want:
                    self.caches.load_units(key, step, [u], complete=False)  # type: ignore[union-attr]
        if not self.link_bound:  # then the rest of each step in the background
            for i, _resident in pending:
                self.caches.prefetch(batch[i].state.cache_key, [batch[i].steps_done])  # type: ignore[union-attr]
        return groups

    def _plan_ahead(self, batch: list[EngineJob], step_started: float) -> None:
        """Plan step s+1 of this batch's masked jobs now and queue its chosen unit loads behind
        step s's, so the copy stream does not idle between steps (the plan's ``lead_s``: how long
        the stream is free before step s+1 starts). At step s+1, ``_plan_groups`` finds those
        units resident (or re-plans the rest with lead 0); whole steps ahead stay with background
        prefetch. Only with ``cache_plan="plan"`` and a trained cost model."""
        self._ahead = {}  # the previous lookahead was consumed by this step's ``_plan_groups``
        if self.cache_plan != "plan" or self.caches is None or not _one_shape(batch):
            return
        ahead: list[tuple[int, set[str]]] = []
        plan_jobs = []
        for i, job in enumerate(batch):
            st: JobState = job.state
            nxt = job.steps_done + 1
            if st.mode != "masked" or st.cache_key is None or nxt >= len(st.timesteps):
                plan_jobs.append(PlanJob(st.rows))
                continue
            resident, failed = self.caches.unit_status(st.cache_key, nxt)
            absent = st.extra.get("absent_units", frozenset())
            if failed or set(self.maskaware.units) <= resident | absent:
                plan_jobs.append(PlanJob(st.rows, st.token_masks, full_units=absent))
                continue
            ahead.append((i, resident | absent))
            plan_jobs.append(PlanJob(st.rows, st.token_masks, (st.cache_key.digest(), nxt), resident, absent,
                                     self._codec(st), self._shared(st)))
        if not ahead:
            self.link_bound = False  # the next steps are already resident: the link keeps up
            return
        latent_hw = (int(batch[0].state.latents.shape[-2]), int(batch[0].state.latents.shape[-1]))
        tier = self.caches.store_tier()
        blocks = unit_costs(self.maskaware, self.unit_cost, plan_jobs, latent_hw, tier)
        if blocks is None:
            return
        # Link slower than compute: a whole step takes longer to load than to compute, so whole
        # steps fetched ahead arrive late and hold the link the plan's unit loads need.
        # (One request per step, as background prefetch reads it.)
        step_bytes = sum(b.load_bytes for b in blocks)
        self.link_bound = (tier is not None and self._step_s is not None and step_bytes > 0
                           and tier.load_time(step_bytes) > self._step_s)
        if self._step_plan is not None:  # this step loads too: the stream frees when its loads end
            lead = self._step_plan.next_lead_s(time.monotonic() - step_started)
        else:  # nothing loads this step: the stream is free for the whole step
            lead = self._step_s if self._step_s is not None else 0.0
        busy = self._link_busy()
        plan = plan_optimal(blocks, lead_s=max(0.0, lead - busy), copy_busy_s=max(0.0, busy - lead))
        chosen = [b.name for b, use in zip(blocks, plan.use_cache) if use and not b.name.startswith(GAP)]
        self.last_ahead = (lead, plan)
        self._ahead = {(batch[i].state.cache_key.digest(), batch[i].steps_done + 1): set(chosen)  # type: ignore[union-attr]
                       for i, _resident in ahead}
        seen: set[tuple[str, int]] = set()
        for u in chosen:
            for i, resident in ahead:
                job, st = batch[i], batch[i].state
                slot = (st.cache_key.digest(), job.steps_done + 1)  # type: ignore[union-attr]
                if u not in resident and (slot, u) not in seen:
                    seen.add((slot, u))  # type: ignore[arg-type]
                    self.caches.load_units(st.cache_key, job.steps_done + 1, [u], complete=False)  # type: ignore[arg-type]

    def _codec(self, st: JobState) -> str:
        codec_of = getattr(self.caches, "codec_of", None)
        return codec_of(st.cache_key) if codec_of is not None and st.cache_key is not None else ""

    def _shared(self, st: JobState) -> frozenset[str]:
        """Names the job's cache stores with one row (manifest ``shared_rows``): fewer bytes to load."""
        shared_of = getattr(self.caches, "shared_rows_of", None)
        return shared_of(st.cache_key) if shared_of is not None and st.cache_key is not None else frozenset()

    def _rows_alike(self, st: JobState) -> bool:
        """Whether every row of the job gets bit-equal inputs (then its recording's rows are
        expected bit-equal). Families with more than one row per job say so; default: no."""
        return False

    def _link_busy(self) -> float:
        busy = getattr(self.caches, "link_busy_s", None)
        return float(busy()) if busy is not None else 0.0

    # -- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, batch: list[EngineJob]) -> None:
        """One denoising step for every job of ``batch`` in a single denoiser call."""
        if not batch:
            return
        for job in batch:  # a retried step starts clean
            job.state.extra.pop("fallback_pending", None)
            job.state.extra.pop("no_offset", None)
            job.state.extra.pop("unit_cache", None)
        started = time.monotonic()
        self._step_plan = None
        batch = self._apply_adapters(batch)
        groups = self._groups(batch) if self.maskaware is not None else None
        if groups is not None and self._units_on:
            groups = self._plan_groups(batch, groups)
            self._plan_ahead(batch, started)
        if groups is not None:
            for i, (job, group) in enumerate(zip(batch, groups)):
                absent = job.state.extra.get("absent_units")
                if absent and getattr(group, "mode", "") == "masked":
                    group.full_units = frozenset(group.full_units) | absent
                if job.state.reuse is not None and getattr(group, "mode", "") == "masked":
                    groups[i] = dataclasses.replace(group, reuse=job.state.reuse.begin(job.steps_done))
        self.last_ctx = None
        graphs = getattr(self, "graphs", None)
        if graphs is not None:
            graphs.last = "eager"  # a step that never reaches the graphs (not graphable) runs eagerly
        if groups is not None:
            batch, groups = _step_order(batch, groups)
        layout.set_invariant(self.batch_invariant and len(batch) > 1)
        rows = layout.rows((g, job.state.rows) for g, job in enumerate(batch)) if layout.wanted() else None
        try:
            with layout.use(rows):
                output, recorded = self._forward(batch, groups)
        finally:
            layout.set_invariant(False)
            if self.lora is not None:
                self.lora.finish()  # also ends the step's layout demand (thread-local)
        self.last_step_graph = "off" if graphs is None else graphs.last
        if self.last_step_graph == "replayed":
            for job in batch:
                job.state.extra["graph_replayed_steps"] = job.state.extra.get("graph_replayed_steps", 0) + 1
        if self.caches is not None and self.stager.asynchronous:
            self._stage_ahead(batch)
        # Schedulers with state (not covered by ``stepper``) roll back if the step fails, so a retry is exact.
        snapshots = [(job.state, dict(job.state.scheduler.__dict__), job.state.generator.get_state())
                     for job in batch if not job.state.stepper.stateless]
        for job in batch:  # the reuse errors ride on the step's one read (copied without a sync)
            if job.state.reuse is not None:
                job.state.reuse.collect(job.steps_done)
        try:
            preds = self._guided_batch(batch, output)
            if graphs is not None and graphs.last != "eager":  # a scheduler with state keeps its input
                preds = [p if job.state.stepper.stateless else p.clone() for job, p in zip(batch, preds)]
            news = step_batch([(job.state.stepper, job.steps_done, pred, job.state.latents)
                               for job, pred in zip(batch, preds)])
            flags, ready = to_host(finite_flags(news))
            launched = LaunchedStep(list(batch), [int(job.steps_done) for job in batch], flags, started, ready,
                                    self.last_ctx if self._units_on else None)
            # Read now: on the CPU (the work is done), or for temporal reuse (it picks the next step's
            # patches from this step's errors). Otherwise read the previous step, queued ahead of this one.
            read_now = not self.read_late or any(job.state.reuse is not None for job in batch)
            if not read_now:
                self.settle()
        except Exception:
            for st, sched_dict, gen_state in snapshots:
                st.scheduler.__dict__.update(sched_dict)
                st.generator.set_state(gen_state)
            raise
        for job, new in zip(batch, news):
            job.state.latents = new
        self._launched.append(launched)
        self._after_step(batch, recorded, launched)
        if read_now:
            self.settle()

    _read_late: bool | None = None

    @property
    def read_late(self) -> bool:
        """Whether a step's flags are read one step late (``workers/engine/settle.py``): where the
        device runs apart from the host (CUDA). On the CPU a step's work is done when it returns, so
        it is read at once and its finished jobs are handed over without waiting for the next step."""
        if self._read_late is not None:
            return self._read_late
        return torch.device(getattr(self, "device", "cpu")).type == "cuda"

    @read_late.setter
    def read_late(self, on: bool) -> None:
        self._read_late = on

    def settle(self) -> None:
        """Read every launched step (waiting for its device work) in one read: fail its jobs whose
        latents are not finite, commit the warm-ups it finished, learn its unit times. Called by the
        next step after launching, by ``result``, and by the engine when it idles."""
        pending = self._launched
        if not pending:
            return
        failed = read_failures(pending)  # raises on a device fault: the steps stay unread
        self._launched = []
        failed = [(job, exc) for job, exc in failed if job.state.failure is None]  # once, at its first
        for job, exc in failed:
            job.state.failure = exc
        self._failures += failed
        now = time.monotonic()
        for k, launched in enumerate(pending):
            for job, index in launched.decide:
                job.state.reuse.decide(index)
            for job in launched.commits:
                if job.state.failure is None:
                    job.state.commit = self.recorder.commit(job.state.cache_key)  # type: ignore[union-attr]
            # From its start (or the last read, if the device was still busy then) to its read; of
            # steps read together, each but the last ends where the next began on the host.
            end = pending[k + 1].started if k + 1 < len(pending) else now
            took = max(0.0, end - max(launched.started, self._last_read))
            self._last_read = end
            self._read.append((launched.batch, took))
            if self._units_on:  # the step's device work has completed
                if launched.ctx is not None and (getattr(launched.ctx, "unit_seconds", None)
                                                 or getattr(launched.ctx, "_spans", None)):
                    observe_context(self.unit_cost, launched.ctx)
                self._step_s = took if self._step_s is None else 0.7 * self._step_s + 0.3 * took
        del self._read[:-64]  # kept for the engine; direct callers never collect them

    def unread(self, job: EngineJob) -> bool:
        """Whether a step of the job was launched and not read yet."""
        return any(j is job for launched in self._launched for j in launched.batch)

    def failures(self) -> list[tuple[EngineJob, Exception]]:
        """Jobs that reads since the last call found failed (the engine fails them)."""
        out, self._failures = self._failures, []
        return out

    def read_steps(self) -> list[tuple[list[EngineJob], float]]:
        """Steps read since the last call, each with the seconds it took: from its start (or the
        read before it, while the device was still busy with that step) to its read."""
        out, self._read = self._read, []
        return out

    def _stage_ahead(self, batch: list[EngineJob]) -> None:
        """While this step computes, stage each masked job's next step whose cache is resident
        (a side stream: the copy and decode overlap with the step; ``staging``)."""
        self.stager.reset()
        entries = []
        for job in batch:  # in step order: the next step keeps it (``_step_order``), so slabs line up
            st: JobState = job.state
            nxt = job.steps_done + 1
            if (st.mode != "masked" or st.cache_key is None or nxt >= len(st.timesteps) or nxt in st.refresh
                    or st.anchor is not None or job.steps_done in st.refresh):  # a refresh: a new offset
                continue
            cache = self.caches.peek(st.cache_key, nxt)  # type: ignore[union-attr]
            if cache is not None:
                entries.append((job.job_id, nxt, cache, st.delta))
        self.stager.ahead_batch(entries)

    def _after_step(self, batch: list[EngineJob], recorded: list[Any], launched: LaunchedStep) -> None:
        """The host's bookkeeping of a launched step; what needs its results goes on ``launched``."""
        for i, job in enumerate(batch):
            st: JobState = job.state
            if st.mode == "masked" and recorded and recorded[i] is not None:  # a refresh step
                self._anchor(job, recorded[i])
                if st.reuse is not None:
                    st.reuse.reset()
                self.prefetch(job)
            elif st.mode == "masked":
                if st.reuse is not None:
                    launched.decide.append((job, int(job.steps_done)))
                units = st.extra.pop("unit_cache", None)
                pending = st.extra.pop("fallback_pending", False)
                n_units = len(getattr(self.maskaware, "units", ()))
                if units is not None:  # planned step: partly cached (or all units computed fully)
                    used = len(units.used)
                    pending = used == 0
                    st.extra["cached_units"] = st.extra.get("cached_units", 0) + used
                    st.extra["wait_s"] = st.extra.get("wait_s", 0.0) + units.waited_s
                    st.extra["missed_units"] = st.extra.get("missed_units", 0) + len(units.missed)
                elif not pending:  # the whole step was resident: its fetch was hidden
                    n_stored = n_units - len(st.extra.get("absent_units", ()))
                    st.extra["cached_units"] = st.extra.get("cached_units", 0) + n_stored
                    st.extra["resident_steps"] = st.extra.get("resident_steps", 0) + 1
                    pending = n_units > 0 and n_stored == 0  # its warm-up stored no unit: a full step
                st.extra["total_units"] = st.extra.get("total_units", 0) + n_units
                if pending:
                    st.fallback_steps += 1
                else:
                    st.masked_steps += 1
                self.prefetch(job)
            elif st.mode == "record":
                assert self.recorder is not None and st.cache_key is not None
                step_index = int(job.steps_done)
                if recorded and recorded[i] is not None:  # a step its cache stores (``_group``)
                    keep = st.extra.get("store_names")
                    tensors = recorded[i] if keep is None else {n: t for n, t in recorded[i].items() if n in keep}
                    self.recorder.put(st.cache_key, step_index, tensors)
                if step_index + 1 == len(st.timesteps):
                    launched.commits.append(job)  # once the step reads finite (``settle``)

    def _anchor(self, job: EngineJob, own: dict[str, torch.Tensor]) -> None:
        """After a refresh step: keep the job's own activations until the template's cache of the
        same step is resident, then store their difference as the job's offset (``_resolve``)."""
        st: JobState = job.state
        st.refresh_steps += 1
        st.delta = None
        st.anchor = (int(job.steps_done), own)
        if not self._resolve(st) and self.caches is not None and st.cache_key is not None:
            self.caches.prefetch(st.cache_key, [int(job.steps_done)])

    def _resolve(self, st: JobState) -> bool:
        """Turn a pending anchor into the offset if the template's step is resident (no waiting in
        the step loop: until then the job's masked steps compute fully, which is always correct)."""
        if st.anchor is None:
            return True
        step, own = st.anchor
        tpl = self.caches.ready(st.cache_key, step) if self.caches is not None else None  # type: ignore[arg-type]
        if tpl is None:
            return False
        st.delta = Offset.made_now({n: own[n] - tpl[n].to(own[n]) for n in own if n in tpl})
        st.anchor = None
        return True

    def masked_tokens(self, st: JobState) -> tuple[int, ...]:
        """Tokens the job computes per step at each level (all of them unless masked)."""
        masks = st.token_masks
        if masks is None:
            return (self._full_tokens(st),)
        if hasattr(masks, "counts"):
            return masks.counts()  # computed once per job (``TokenMasks``)
        counted = st.extra.get("masked_tokens")
        if counted is None:
            counted = st.extra["masked_tokens"] = (int(masks.sum()),)
        return counted

    def _full_tokens(self, st: JobState) -> int:
        shape = st.latents.shape
        return int(shape[-2] * shape[-1]) if st.latents.dim() == 4 else int(shape[1])

    def result(self, job: EngineJob) -> dict[str, Any]:
        """The job's outcome once its last step was read; raises why it failed, if it did."""
        st: JobState = job.state
        if self.unread(job):
            self.settle()
        if st.failure is not None:
            raise st.failure
        total = st.extra.get("total_units", 0)
        return {"latents": st.latents, "commit": st.commit, "mode": st.mode,
                "masked_steps": st.masked_steps, "fallback_steps": st.fallback_steps,
                "refresh_steps": st.refresh_steps,
                "note": st.extra.get("cache_note", ""),
                # Share of (step, unit) computations that used the cache; 0..1, "" if none.
                "cached_unit_share": (st.extra.get("cached_units", 0) / total) if total else None,
                "resident_steps": st.extra.get("resident_steps", 0),
                "cache_store_bytes": (self.caches.store_bytes_of(st.cache_key)
                                      if self.caches is not None and st.cache_key is not None and st.mode == "masked"
                                      else 0),
                "load_wait_s": st.extra.get("wait_s", 0.0),
                "lora_applied_step": st.lora_applied if st.adapters else None,
                "lora_merged_steps": st.extra.get("lora_merged_steps", 0),
                "lora_term_steps": st.extra.get("lora_term_steps", 0),
                # temporal reuse (``turbo``): (step, unit, patch) computations taken from the last step
                "reused_patches": st.reuse.reused if st.reuse is not None else None,
                "reused_share": st.reuse.share if st.reuse is not None else None,
                # steps replayed from a captured CUDA graph (the rest ran eagerly or were captured)
                "graph_replayed_steps": st.extra.get("graph_replayed_steps", 0)}


class OffsetCache(Mapping[str, torch.Tensor]):
    """A template step cache shifted by a job's offset (``JobState.delta``): the template's
    activations at this step plus how far the job's own were from the template's at its last
    refresh. Each tensor is shifted once per step (the controllers may read a name twice)."""

    def __init__(self, base: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
        self.base = base
        self.delta = delta
        self._shifted: dict[str, torch.Tensor] = {}
        acquire = getattr(base, "acquire_unit", None)
        if acquire is not None:  # block-wise loading (``UnitCache``): the plan asks per unit
            self.acquire_unit = acquire

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._shifted.get(name)
        if t is None:
            base, d = self.base[name], self.delta.get(name)
            t = base if d is None else d + base.to(d)
            self._shifted[name] = t
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def _step_order(batch: list[EngineJob], groups: list[Any]) -> tuple[list[EngineJob], list[Any]]:
    """The step's jobs with those computing fully (refresh steps, records, fallbacks) first, then
    the masked ones by token counts, largest first (the order their caches were staged in,
    ``_groups``). A graph's signature then depends on how many jobs compute fully, not on where they
    sit, and jobs of similar counts are adjacent: the model runs them as one padded run
    (``MaskAwareUNet``). Every job's results are its own rows, whatever their position."""
    def key(i: int) -> tuple[int, tuple[int, ...]]:
        group = groups[i]
        if getattr(group, "mode", "full") != "masked":
            return (0, ())
        return (1, _count_key(group.token_mask))
    order = sorted(range(len(batch)), key=key)
    return [batch[i] for i in order], [groups[i] for i in order]


def _count_key(token_mask: Any) -> tuple[int, ...]:
    """Sort key of a masked job: its computed tokens per level, largest first (SD token masks;
    other models' masks sort as equal)."""
    counts = getattr(token_mask, "counts", None)
    return tuple(-c for c in counts()) if callable(counts) else ()


class _ToStage:
    """A masked job whose step cache is ready, to be staged with the step's other masked jobs."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache


def _one_shape(batch: list[EngineJob]) -> bool:
    """All jobs of the batch have one latent size (the load/compute plan is per size)."""
    return len({tuple(job.state.latents.shape[-2:]) for job in batch}) == 1


def job_rows(batch: list[EngineJob], output: Any) -> list[torch.Tensor]:
    """Each job's rows of the step's output (views, no copy)."""
    if isinstance(output, list):
        return output
    rows, row = [], 0
    for job in batch:
        rows.append(output[row:row + job.state.rows])
        row += job.state.rows
    return rows
