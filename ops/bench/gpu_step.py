"""Per-step cost of full and mask-aware denoising steps on a GPU, eager and replayed as CUDA graphs.

Models: true-size random weights (``workers/models/true_size.py``) materialized directly on the
device in ``--dtype``: SD 1.5 inpainting at 512 px, SDXL inpainting at 1024 px, FLUX.1 Fill at
1024 px (all 19 double + 38 single blocks, T5 text of 512 tokens). One CFG job (two rows) for the
UNets, one row for Flux. The template cache is recorded from the same inputs and staged on the
device as the engine stages it (``CacheStager``: one private flat buffer; masks pooled as the
service pools them). Parts:

- ``step``: per model and mask ratio, the device time of one step (CUDA events, median of
  interleaved rounds) for: full eager, full graph, mask-aware eager, mask-aware graph
  (``StepGraphs``: the engine's graph pool). Speedups are against the full step in the same mode
  and against the full eager step (what the stock pipeline runs).
- ``batch``: SD 1.5 with J jobs (2J rows), full and mask-aware at ratio 0.2, eager and graph; at 8
  jobs on a device with ragged batch indices (CUDA) also the same masked steps with runs (one SDPA
  per run, per-job token buckets): what decides the default layout.
- ``profile``: one step of each kind under ``torch.profiler``: kernels launched, memory copies,
  host synchronisations (``cudaStreamSynchronize`` & co., ``item``/``nonzero``), kernel time, and
  wall time per step (host and device, synchronised): wall / kernel time says how host-bound it is.
- ``dispatch`` (any machine): operators and host-sync operators of one full and one mask-aware
  step at true size, counted by dispatch on the meta device (no memory, no compute).
- ``flops`` (any machine): FLOPs of one full and one mask-aware step per ratio at true size, counted
  on the meta device by PyTorch's FLOP formulas: the speedup a step could reach were it bound by
  its arithmetic alone, with the UNets' ResNets on the whole map and computed at the masked tokens
  too (``workers/maskaware/resnets.py``).
- ``resnets``: the UNets' mask-aware step with ResNets on the whole map and at the masked tokens
  too (``workers/maskaware/resnets.py``), eager and graph (a graph replays the fixed masks it was
  captured with), against the full step.
- ``reuse``: temporal reuse (``turbo``, ``workers/maskaware/reuse.py``) per step at ratio 0.2: a
  step reusing a share of every unit's patches (eager: steps with reuse are not graph-captured)
  against the mask-aware step, eager and graph, and its kernels and wall / kernel time.
- ``compiled``: full and mask-aware steps replayed as the engine's CUDA graphs with the eager
  kernels, with ``STENCIL_COMPILE=default``'s compiled kernels inside those graphs, and under
  ``reduce-overhead`` (torch.compile's own CUDA graphs instead), each compilation timed apart:
  issue 37's "CUDA graphs or torch.compile, whichever measures better" (``CompiledSteps``).

``--quick``: the shrunk models (``true_size.shrunk``) at small sizes, one round, on whatever device
there is: the test suite's smoke run on the CPU (graphs then replay eagerly). Writes Markdown
(``--out``) and JSON (``--json``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ops.bench.harness.cli import parser, report_parts, start
from ops.bench.harness.gpu import DTYPES, Clock, build_on, device_of, hardware, sync
from ops.bench.harness.models import pixel_mask
from ops.bench.harness.policies import policy_costs, policy_row, policy_table
from ops.bench.harness.report import Stopped, stop_on_sigterm
from ops.bench.harness.timing import interleave, median
from workers.engine.graph_calls import flux_call, unet_call
from workers.engine.graphs import StepGraphs
from workers.engine.staging import CacheStager
from workers.maskaware.tokens import POOL_THRESHOLD
from workers.models import true_size

log = logging.getLogger(__name__)

MODELS = {"sd15": "sd15-inpaint", "sdxl": "sdxl-inpaint", "flux": "flux-fill"}
SIDE_PX = {"sd15": 512, "sdxl": 1024, "flux": 1024}
# A host sync on CUDA is one of these runtime calls (``aten::item`` and ``aten::_local_scalar_dense``
# above one would count it three times); on the CPU, where nothing waits, the operators that would sync.
CUDA_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
CPU_SYNC_OPERATORS = ("aten::_local_scalar_dense", "aten::nonzero")


@dataclass
class Case:
    """One model at one shape: its four step kinds per ratio as zero-argument calls."""

    key: str
    label: str
    calls: dict[str, Callable[[], Any]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    graphs: list[Any] = field(default_factory=list)  # the ``StepGraphs`` its graph calls replay from
    compiled: "CompiledSteps | None" = None  # its steps under ``STENCIL_COMPILE`` (``compiled=True``)


def unet_case(key: str, args: Any, device: torch.device, jobs: int = 1, ratios: Sequence[float] = (),
              turbo: bool = False, resnets: str = "full", compiled: bool = False) -> Case:
    """Full and mask-aware calls of a true-size UNet (``jobs`` CFG jobs, one template cache each),
    and ``stage int8``: staging every job's step from the int8 codec. ``resnets="masked"``: a model
    of its own whose ResNets are mask-aware too (``workers/maskaware/resnets.py``). ``compiled``:
    also the same steps under ``STENCIL_COMPILE`` (``CompiledSteps``)."""
    from workers.engine import cache_codec
    from workers.engine.staging import pack
    from workers.maskaware.unet import MaskAwareUNet, RowGroup

    dtype = DTYPES[args.dtype]
    spec = true_size.shrunk(MODELS[key]) if args.quick else true_size.spec(MODELS[key])
    comp = spec.components["unet"]
    cfg = comp.config
    t0 = time.perf_counter()
    unet = _model(args, key, comp, dtype, device, variant=resnets)
    latent = (8 if key == "sd15" else 16) if args.quick else SIDE_PX[key] // 8
    text = 8 if args.quick else 77
    rows = 2 * jobs
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(rows, 9, latent, latent, generator=g).to(device, dtype)
    t = torch.full((rows,), 500, device=device)
    e = torch.randn(rows, text, cfg["cross_attention_dim"], generator=g).to(device, dtype)
    kwargs: dict[str, Any] = {"encoder_hidden_states": e, "return_dict": False}
    if cfg.get("addition_embed_type") == "text_time":
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        px = latent * 8
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(rows, pooled, generator=g).to(device, dtype),
            "time_ids": torch.tensor([[px, px, 0, 0, px, px]] * rows, dtype=dtype, device=device)}
    ctrl = _controller(unet, lambda model: MaskAwareUNet(model, resnets=resnets))
    ctrl.pool_threshold = POOL_THRESHOLD
    if ctrl.resnets is not None and device.type == "cuda":
        ctrl.resnets.bucketed = True  # as the engine sets it where steps replay graphs (sd_runner)
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record") for _ in range(jobs)]) as ctx:
        unet(x, t, **kwargs)
    caches = ctx.recorded
    stager = CacheStager(device)
    staged = stager.take_batch([(f"j{j}", 0, caches[j], None) for j in range(jobs)])  # one buffer, as the engine
    graphs = StepGraphs(device, repeats=1)
    case = Case(key, f"{MODELS[key]} {latent * 8} px", notes={
        "params_b": sum(p.numel() for p in unet.parameters()) / 1e9, "build_s": time.perf_counter() - t0,
        "jobs": jobs, "cache_mib_per_job": sum(v.numel() * v.element_size() for v in caches[0].values()) / 2**20,
        "blocks": len(ctrl.block_names)}, graphs=[graphs])
    full_groups = [RowGroup(2, "full") for _ in range(jobs)]
    if device.type == "meta" and resnets == "full":  # counted by ``part_dispatch``
        # What a template warm-up stores (int8 K/V, 16-bit outputs, one row for both CFG rows),
        # staged for every job as the engine stages a step.
        def stored() -> cache_codec.DecodedStep:  # one host buffer, as a GPU host's tier holds a step
            return cache_codec.DecodedStep(pack(
                {name: torch.zeros((1, t.shape[1] + cache_codec.SCALE_ROWS, t.shape[2]), dtype=torch.int8)
                 if cache_codec.is_kv(name) else torch.zeros((1, *t.shape[1:]), dtype=torch.bfloat16)
                 for name, t in caches[0].items()}, pin=False), dtype, None, 2)

        steps, burst = [stored() for _ in range(jobs)], stored()
        case.calls["stage int8"] = lambda: stager.stage_batch([(st, None) for st in steps])  # other steps
        case.calls["stage int8 one step"] = lambda: stager.stage_batch([(burst, None)] * jobs)  # a burst
        case.notes["cached tensors per job"] = len(burst.stored)

    def eager(groups: list[Any] | None) -> Callable[[], Any]:
        def run() -> Any:
            if groups is None:
                return unet(x, t, **kwargs)[0]
            with ctrl.batch(groups):
                return unet(x, t, **kwargs)[0]
        return run

    def graphed(groups: list[Any] | None) -> Callable[[], Any]:
        return lambda: unet_call(graphs, unet, ctrl, (x, t), kwargs, groups, device)[0]

    case.calls["full eager"], case.calls["full graph"] = eager(None), graphed(full_groups)
    variants = CompiledSteps(device, unet, ctrl, ctrl.block_kernels) if compiled else None
    if variants is not None:
        case.compiled = variants
        case.graphs.append(variants.graphs)
        variants.add_full(case, lambda fn: fn(x, t, **kwargs)[0],
                          lambda fn: unet_call(variants.graphs, fn, ctrl, (x, t), kwargs, full_groups, device)[0])
    for r in ratios:
        masks = [ctrl.token_masks(pixel_mask(latent * 8, r, ("blob", "rect")[j % 2], args.seed + j),
                                  (latent, latent)) for j in range(jobs)]
        masks.sort(key=lambda m: tuple(-c for c in m.counts()))  # the engine's order (``_step_order``)
        groups = [RowGroup(2, "masked", token_mask=m.prepare(device), cache=s) for m, s in zip(masks, staged)]
        # graphed steps compute what the engine's do: with ragged batch indices (CUDA) each job's own
        # count (only the batch's total is bucketed), else counts rounded up to their buckets
        buckets = groups if ctrl.ragged_on(device) else [
            RowGroup(2, "masked", token_mask=m.with_buckets().prepare(device), cache=s) for m, s in zip(masks, staged)]
        case.calls[f"masked {r:g} eager"], case.calls[f"masked {r:g} graph"] = eager(groups), graphed(buckets)
        if variants is not None:
            graphs_c = variants.graphs
            variants.add_masked(case, r, eager(groups),
                                lambda bs=buckets: unet_call(graphs_c, unet, ctrl, (x, t), kwargs, bs, device)[0])
        if jobs in RUNS_AT and ctrl.ragged_on(device):  # the ablation: the same steps with runs (part_batch)
            runs = [RowGroup(2, "masked", token_mask=m.with_buckets().prepare(device), cache=s)
                    for m, s in zip(masks, staged)]
            case.calls[f"masked {r:g} eager runs"] = with_runs(ctrl, eager(groups))
            case.calls[f"masked {r:g} graph runs"] = with_runs(ctrl, graphed(runs))
        case.notes[f"level_share {r:g}"] = [round(float(lv.float().mean()), 3) for lv in masks[0].levels]
        for layout_name, ragged in (("padding", False), ("ragged padding", True)):  # the two index layouts
            ctrl.ragged = ragged
            case.notes[f"{layout_name} {r:g}"] = padding(ctrl, groups, device)
        ctrl.ragged = None  # the device's own layout
        if turbo:
            with_turbo(case, ctrl, groups, lambda gs: eager(gs)())
    return case


COMPILE_VARIANTS = ("graph compiled", "reduce-overhead")  # ``CompiledSteps``' calls, after "graph"


class CompiledSteps:
    """A case's steps under ``STENCIL_COMPILE`` (``workers/compiled.py``), what issue 37 asks to
    weigh against the engine's CUDA graphs: ``graph compiled`` = mode ``default`` (Inductor's fused
    kernels: the full forward compiled, the mask-aware path's packed computations compiled) captured
    in the engine's step graphs, as the engine runs them with both on; ``reduce-overhead`` = that
    mode as the engine runs it, without the engine's graphs (``graphs.step_graphs`` turns them off
    under it): the full forward in torch.compile's own graphs, the packed computations compiled
    without them (``workers.compiled.WITHOUT_OWN_GRAPHS``).
    ``make_kernels(mode)``: the controller's compiled kernels under a mode."""

    MODES = ("default", "reduce-overhead")

    def __init__(self, device: torch.device, model: torch.nn.Module, ctrl: Any,
                 make_kernels: Callable[[str], Any]) -> None:
        from workers.compiled import Compiled

        self.ctrl = ctrl
        self.graphs = StepGraphs(device, repeats=1)  # its own pool: the eager kernels' graphs have the same keys
        self.forward = {mode: Compiled(model, f"{type(model).__name__} forward ({mode})", mode) for mode in self.MODES}
        self.kernels = {mode: make_kernels(mode) for mode in self.MODES}

    def add_full(self, case: Case, call: Callable[[Callable[..., Any]], Any],
                 graphed: Callable[[Callable[..., Any]], Any]) -> None:
        """``full graph compiled`` (``graphed(compiled forward)``) and ``full reduce-overhead``."""
        case.calls["full graph compiled"] = lambda: graphed(self.forward["default"])
        case.calls["full reduce-overhead"] = lambda: call(self.forward["reduce-overhead"])

    def add_masked(self, case: Case, ratio: float, eager: Callable[[], Any], graphed: Callable[[], Any]) -> None:
        """The masked step at ``ratio`` with the compiled kernels: in the step graphs, and eager
        calls under ``reduce-overhead``."""
        case.calls[f"masked {ratio:g} graph compiled"] = self._with("default", graphed)
        case.calls[f"masked {ratio:g} reduce-overhead"] = self._with("reduce-overhead", eager)

    def _with(self, mode: str, call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            saved, self.ctrl.kernels = self.ctrl.kernels, self.kernels[mode]
            try:
                return call()
            finally:
                self.ctrl.kernels = saved
        return run

    def fallbacks(self) -> list[str]:
        """The compiled functions that run eagerly (their compilation failed)."""
        functions = list(self.forward.values())
        for kernels in self.kernels.values():
            functions += kernels.compiled() if hasattr(kernels, "compiled") else [kernels.ff]
        return sorted({f.name for f in functions if not f.active})


RUNS_AT = (8,)  # jobs at which ``part_batch`` also times the runs layout where the device is ragged


def with_runs(ctrl: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with the controller's batch indices in runs (per-run SDPA), not ragged."""
    def run() -> Any:
        ctrl.ragged = False
        try:
            return call()
        finally:
            ctrl.ragged = None
    return run


def padding(ctrl: Any, groups: list[Any], device: torch.device) -> float:
    """Token rows the transformer blocks compute over the masked ones, with the batch index's
    padding (jobs padded to their run's count, or a ragged level's total to its bucket,
    ``workers/maskaware/batched.py``): 1.0 = no padding."""
    index = ctrl.batch_index(groups, device)
    if index is None:
        return 1.0
    used = real = 0
    for unit, blocks in ctrl._units.items():
        n = groups[0].token_mask.levels[blocks[0].level].numel()
        level = index.levels.get((n, frozenset()))
        if level is None:
            continue
        used += len(blocks) * level.tokens
        real += len(blocks) * sum(rows * groups[g].token_mask.count(n) for g, _s, rows, _m in level.members)
    return round(used / real, 4) if real else 1.0


def flux_case(args: Any, device: torch.device, ratios: Sequence[float], turbo: bool = False,
              compiled: bool = False) -> Case:
    """Full and mask-aware calls of FLUX.1 Fill's transformer (one row, T5 text of 512 tokens);
    ``compiled``: also under ``STENCIL_COMPILE`` (``CompiledSteps``)."""
    from diffusers import FluxPipeline

    from workers.maskaware.flux import FluxKernels, MaskAwareFlux, RowGroup
    from workers.maskaware.flux_tokens import synthetic_token_grid

    dtype = DTYPES[args.dtype]
    key = "flux"
    spec = true_size.shrunk(MODELS[key]) if args.quick else true_size.spec(MODELS[key])
    comp = spec.components["transformer"]
    cfg = comp.config
    t0 = time.perf_counter()
    model = _model(args, key, comp, dtype, device)
    side = 8 if args.quick else SIDE_PX[key] // 16
    text = 16 if args.quick else 512
    g = torch.Generator().manual_seed(args.seed)
    kwargs: dict[str, Any] = dict(
        hidden_states=torch.randn(1, side * side, cfg["in_channels"], generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], generator=g).to(device, dtype),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(device, dtype),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, side, side, device, dtype),
        txt_ids=torch.zeros(text, 3, device=device, dtype=dtype),
        guidance=torch.tensor([30.0], device=device, dtype=torch.float32) if cfg.get("guidance_embeds") else None,
        return_dict=False)
    ctrl = _controller(model, MaskAwareFlux)
    with torch.no_grad(), ctrl.batch([RowGroup(1, "record")]) as ctx:
        model(**kwargs)
    stager = CacheStager(device)
    staged = stager.take("j", 0, ctx.recorded[0])
    graphs = StepGraphs(device, repeats=1)
    case = Case(key, f"{MODELS[key]} {side * 16} px", notes={
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "build_s": time.perf_counter() - t0, "jobs": 1,
        "blocks": len(ctrl.names), "kv_format": ctrl.kv_format,
        "cache_mib_per_job": sum(v.numel() * v.element_size() for v in ctx.recorded[0].values()) / 2**20},
        graphs=[graphs])

    def eager(groups: list[Any] | None) -> Callable[[], Any]:
        def run() -> Any:
            if groups is None:
                return model(**kwargs)[0]
            with ctrl.batch(groups):
                return model(**kwargs)[0]
        return run

    def graphed(groups: list[Any] | None) -> Callable[[], Any]:
        return lambda: flux_call(graphs, model, ctrl, kwargs, groups)

    case.calls["full eager"], case.calls["full graph"] = eager(None), graphed([RowGroup(1, "full")])
    variants = CompiledSteps(device, model, ctrl, FluxKernels) if compiled else None
    if variants is not None:
        case.compiled = variants
        case.graphs.append(variants.graphs)
        variants.add_full(case, lambda fn: fn(**kwargs)[0],
                       lambda fn: flux_call(variants.graphs, fn, ctrl, kwargs, [RowGroup(1, "full")]))
    for r in ratios:
        grid = synthetic_token_grid(side, side, r, shape="blob", seed=args.seed).flatten()
        groups = [RowGroup(1, "masked", token_mask=ctrl.prepared(grid, device), cache=staged)]
        buckets = [RowGroup(1, "masked", token_mask=ctrl.prepared(grid, device, bucketed=True), cache=staged)]
        case.calls[f"masked {r:g} eager"], case.calls[f"masked {r:g} graph"] = eager(groups), graphed(buckets)
        if variants is not None:
            variants.add_masked(case, r, eager(groups),
                                lambda bs=buckets: flux_call(variants.graphs, model, ctrl, kwargs, bs))
        if turbo:
            with_turbo(case, ctrl, groups, lambda gs: eager(gs)())
    return case


_MODEL_CACHE: dict[str, torch.nn.Module] = {}  # "<key>@<device>"
_CONTROLLERS: dict[int, Any] = {}


def _model(args: Any, key: str, comp: true_size.Component, dtype: torch.dtype, device: torch.device,
           variant: str = "full") -> torch.nn.Module:
    """One model per key, device and controller variant for the whole run (the batch part reuses
    the step part's SD 1.5)."""
    slot = f"{key}@{device}" + ("" if variant == "full" else f"/{variant}")
    if slot not in _MODEL_CACHE:
        log.info("building %s on %s", MODELS[key], device)
        _MODEL_CACHE[slot] = build_on(comp, dtype, device, args.seed)
    return _MODEL_CACHE[slot]


def _controller(model: torch.nn.Module, make: Callable[[torch.nn.Module], Any]) -> Any:
    """One mask-aware controller per model (its hooks are installed once)."""
    if id(model) not in _CONTROLLERS:
        _CONTROLLERS[id(model)] = make(model)
    return _CONTROLLERS[id(model)]


def measure(case: Case, args: Any, device: torch.device) -> dict[str, float]:
    """Median device time per call of every call of ``case``, interleaved rounds (after warm-up
    calls, which also capture the graphs)."""
    clock = Clock(device)
    with torch.no_grad():
        for call in case.calls.values():
            for _ in range(2):
                call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples = interleave(args.rounds, list(case.calls), lambda name: clock(case.calls[name], args.reps),
                             label=f"{case.label}: ")
    if case.graphs:
        counts = [sum(getattr(g, a) for g in case.graphs) for a in ("captures", "replays", "eager")]
        case.notes["graph calls captured/replayed/eager"] = "/".join(map(str, counts))
        if counts[2]:  # a "graph" timing that ran eagerly would pass for a graph's
            log.warning("%s: %d graph calls ran eagerly (a capture failed or did not fit)", case.label, counts[2])
    return {name: median(v) for name, v in samples.items()}


def profile_call(call: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Kernels, copies and host syncs of one call, its kernel time, and its wall time (synchronised)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad():
        call()
        sync(device)
        t0 = time.perf_counter()
        call()
        sync(device)
        wall = time.perf_counter() - t0
        with profile(activities=activities) as prof:
            if device.type == "cuda":  # kernels timestamped before the tracer is up would go unrecorded
                time.sleep(0.05)
            call()
            sync(device)
    kernels = copies = syncs = 0
    kernel_us = 0.0
    by_name: dict[str, list[float]] = {}  # kernel -> [launches, device us]
    for ev in prof.events():
        name = ev.name
        on_device = getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type)
        if on_device and not name.startswith("Memcpy") and not name.startswith("Memset"):
            kernels += 1
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            kernel_us += us
            tally = by_name.setdefault(name, [0, 0.0])
            tally[0] += 1
            tally[1] += us
        if name.startswith("cudaMemcpy") or (on_device and name.startswith("Memcpy")):
            copies += 1 if name.startswith("cudaMemcpy") else 0
        if (name.startswith(CUDA_SYNC_EVENTS) if device.type == "cuda" else name in CPU_SYNC_OPERATORS):
            syncs += 1
    syncs -= 1 if device.type == "cuda" else 0  # ours, closing the profiled region
    classes: dict[str, float] = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for name, (_n, us) in by_name.items():
        classes[kernel_class(name)] += us / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {"kernels": kernels, "copies": copies, "syncs": max(syncs, 0), "kernel_ms": kernel_us / 1e3,
            "wall_ms": wall * 1e3, "class_ms": classes,
            "top": [{"kernel": name[:160], "launches": int(n), "ms": us / 1e3} for name, (n, us) in top]}


# Where a step's kernel time goes, by kernel name (cuBLAS/CUTLASS, cuDNN and PyTorch's own kernel
# names; a name matching none of these is "other"). First match wins: cuDNN's convolutions are
# implicit GEMMs, so convolution is tested before GEMM.
KERNEL_CLASSES: dict[str, tuple[str, ...]] = {
    "attention": ("flash", "fmha", "attention", "attn", "softmax"),
    "convolution": ("conv", "fprop", "dgrad", "implicit_gemm", "winograd"),
    "gemm": ("gemm", "gemv", "cutlass", "xmma", "matmul", "splitk", "cublas", "nvjet", "triton_tem"),
    "norm, reduction": ("norm", "welford", "moments", "reduce", "triton_red", "triton_per"),
    "copy, layout": ("copy", "cat", "index", "scatter", "gather", "fill", "nchw", "nhwc", "transpose"),
    "elementwise": ("elementwise", "vectorized", "unrolled", "activation", "silu", "gelu", "triton_poi"),
    "other": (),
}
TOP_KERNELS = 10  # kernels kept by name per profiled step (JSON)


def kernel_class(name: str) -> str:
    """The class of a device kernel by its name (``KERNEL_CLASSES``)."""
    low = name.lower()
    for cls, marks in KERNEL_CLASSES.items():
        if any(m in low for m in marks):
            return cls
    return "other"


def part_step(args: Any, device: torch.device) -> list[str]:
    lines = ["## Per step: one job, full vs mask-aware, eager vs graph", "",
             "| model | mode | full ms | masked ms at " + " / ".join(f"{r:g}" for r in args.ratios)
             + " | speedup vs full (same mode) | speedup vs full eager |", "|---|---|---|---|---|---|"]
    for key in args.models:
        case = (flux_case(args, device, args.ratios) if key == "flux"
                else unet_case(key, args, device, ratios=args.ratios))
        t = measure(case, args, device)
        args.results.setdefault("step", {})[key] = {"notes": case.notes, "ms": {k: v * 1e3 for k, v in t.items()}}
        for mode in ("eager", "graph"):
            full = t[f"full {mode}"]
            masked = [t[f"masked {r:g} {mode}"] for r in args.ratios]
            lines.append(f"| {case.label} | {mode} | {full * 1e3:.1f} | " + " / ".join(f"{m * 1e3:.1f}" for m in masked)
                         + " | " + " / ".join(f"{full / m:.2f}x" for m in masked)
                         + " | " + " / ".join(f"{t['full eager'] / m:.2f}x" for m in masked) + " |")
        log.info("%s: %s", case.label, {k: round(v * 1e3, 2) for k, v in t.items()})
    notes = [f"- {k}: " + ", ".join(f"{n} {v:.3g}" if isinstance(v, float) else f"{n} {v}"
                                    for n, v in r["notes"].items())
             for k, r in args.results["step"].items()]
    return lines + ["", *notes, ""]


def part_batch(args: Any, device: torch.device) -> list[str]:
    lines = ["## SD 1.5 with J jobs (2J rows), mask ratio 0.2", "",
             "| jobs | full eager ms | full graph ms | masked eager ms | masked graph ms | "
             "masked graph vs full graph |",
             "|---|---|---|---|---|---|"]
    for jobs in args.jobs:
        case = unet_case("sd15", args, device, jobs=jobs, ratios=[0.2])
        t = measure(case, args, device)
        args.results.setdefault("batch", {})[str(jobs)] = {k: v * 1e3 for k, v in t.items()}
        lines.append(f"| {jobs} | {t['full eager'] * 1e3:.1f} | {t['full graph'] * 1e3:.1f} | "
                     f"{t['masked 0.2 eager'] * 1e3:.1f} | {t['masked 0.2 graph'] * 1e3:.1f} | "
                     f"{t['full graph'] / t['masked 0.2 graph']:.2f}x |")
    runs = [(j, r) for j, r in args.results["batch"].items() if "masked 0.2 eager runs" in r]
    if runs:  # ragged indices (this device's) against runs, the same steps
        lines += ["", "Batch indices at ratio 0.2: ragged (one variable-length attention call per block, this "
                  "device's layout) against runs (one SDPA per run of close counts, each job's count bucketed):", "",
                  "| jobs | eager ragged / runs ms | graph ragged / runs ms |", "|---|---|---|"]
        lines += [f"| {j} | {r['masked 0.2 eager']:.1f} / {r['masked 0.2 eager runs']:.1f} | "
                  f"{r['masked 0.2 graph']:.1f} / {r['masked 0.2 graph runs']:.1f} |" for j, r in runs]
    return lines + [""]


def part_profile(args: Any, device: torch.device) -> list[str]:
    lines = ["## One step under the profiler (one job, ratio 0.2)", "",
             "| model | step | kernels | copies | host syncs | kernel ms | wall ms | wall / kernel |",
             "|---|---|---|---|---|---|---|---|"]
    for key in args.models:
        case = flux_case(args, device, [0.2]) if key == "flux" else unet_case(key, args, device, ratios=[0.2])
        for name in ("full eager", "masked 0.2 eager", "full graph", "masked 0.2 graph"):
            p = profile_call(case.calls[name], device)
            args.results.setdefault("profile", {}).setdefault(key, {})[name] = p
            ratio = p["wall_ms"] / p["kernel_ms"] if p["kernel_ms"] else math.nan
            lines.append(f"| {case.label} | {name} | {p['kernels']} | {p['copies']} | {p['syncs']} | "
                         f"{p['kernel_ms']:.1f} | {p['wall_ms']:.1f} | {ratio:.2f} |")
    lines += ["", "Kernel time by kind (ms; by kernel name, `kernel_class`; the ten longest kernels by name "
              "are in the JSON):", "",
              "| model | step | " + " | ".join(KERNEL_CLASSES) + " |", "|---|---|" + "---|" * len(KERNEL_CLASSES)]
    for key, steps in args.results.get("profile", {}).items():
        for name, p in steps.items():
            lines.append(f"| {key} | {name} | " + " | ".join(f"{p['class_ms'][c]:.2f}" for c in KERNEL_CLASSES) + " |")
    return lines + [""]


def part_dispatch(args: Any, device: torch.device) -> list[str]:
    """Operators and host-sync operators of one step, counted by dispatch on the meta device: the
    true-size models at their true sizes with no memory and no compute (what holds without a GPU).
    Attention counts as the one fused kernel it is on a GPU (``DispatchCounter``). The UNets also
    with 8 CFG jobs at different masks (one template cache each, staged together as the engine
    stages a step): what a batch adds per job. Each count is a steady call (the second: the
    first call of a batch composition builds its token indices on the host)."""
    from ops.bench.harness.dispatch import DispatchCounter

    meta = torch.device("meta")
    stage_lines = ["Staging a step's caches (int8 K/V, 16-bit outputs, shared CFG rows; the copies run on a side "
                   "stream, but the host issues each):", "",
                   "| model | jobs | cached tensors per job | kernel-launching operators, jobs at different steps | "
                   "the same, jobs at one template step (a burst) | the full step's, for scale |",
                   "|---|---|---|---|---|---|"]
    lines = ["## Operators per step at true size (dispatch counts on the meta device; ratio 0.2)", "",
             "| model | jobs | full: operators / kernel-launching | mask-aware: operators / kernel-launching | ratio | "
             "host-sync operators (mask-aware) | token rows computed / masked: runs / ragged |",
             "|---|---|---|---|---|---|---|"]
    resnet_lines = ["With the ResNets computed at the masked tokens too (`workers/maskaware/resnets.py`):", "",
                    "| model | jobs | mask-aware: operators / kernel-launching | ratio to the full step | "
                    "host-sync operators |", "|---|---|---|---|---|"]
    for key in args.models:
        for jobs in [1] if key == "flux" else DISPATCH_JOBS:
            case = (flux_case(args, meta, [0.2]) if key == "flux"
                    else unet_case(key, args, meta, jobs=jobs, ratios=[0.2]))
            counts = {}
            for name in ("full eager", "masked 0.2 eager"):
                with torch.no_grad():  # a steady step: the first call of a batch builds its index on the host
                    case.calls[name]()
                counts[name] = DispatchCounter()
                with torch.no_grad(), counts[name]:
                    case.calls[name]()
            full, masked = counts["full eager"], counts["masked 0.2 eager"]
            args.results.setdefault("dispatch", {})[key if jobs == 1 else f"{key} x{jobs}"] = {
                "jobs": jobs, "full": [full.total, full.kernels], "masked": [masked.total, masked.kernels],
                "syncs": masked.syncs}
            pad, ragged_pad = case.notes.get("padding 0.2", 1.0), case.notes.get("ragged padding 0.2", 1.0)
            args.results["dispatch"][key if jobs == 1 else f"{key} x{jobs}"].update(padding=pad,
                                                                                    ragged_padding=ragged_pad)
            if "stage int8" in case.calls and jobs > 1:
                staged = {}
                for name in ("stage int8", "stage int8 one step"):
                    staged[name] = DispatchCounter()
                    with torch.no_grad(), staged[name]:
                        case.calls[name]()
                apart, burst = staged["stage int8"].kernels, staged["stage int8 one step"].kernels
                tensors = case.notes["cached tensors per job"]
                args.results["dispatch"][f"{key} x{jobs}"].update(
                    stage_kernels=apart, stage_kernels_one_step=burst, stage_tensors=tensors)
                stage_lines.append(f"| {case.label} | {jobs} | {tensors} | {apart} ({apart / jobs:.1f} per job) | "
                                   f"{burst} ({burst / jobs:.1f} per job) | {full.kernels} |")
            lines.append(f"| {case.label} | {jobs} | {full.total} / {full.kernels} | "
                         f"{masked.total} / {masked.kernels} | "
                         f"{masked.total / full.total:.3f} / {masked.kernels / full.kernels:.3f} | "
                         f"{sum(masked.syncs.values())} | {pad:.3f} / {ragged_pad:.3f} |")
            if key != "flux":
                res = unet_case(key, args, meta, jobs=jobs, ratios=[0.2], resnets="masked").calls["masked 0.2 eager"]
                with torch.no_grad():
                    res()
                counted = DispatchCounter()
                with torch.no_grad(), counted:
                    res()
                args.results["dispatch"][key if jobs == 1 else f"{key} x{jobs}"]["masked_resnets"] = [
                    counted.total, counted.kernels]
                resnet_lines.append(f"| {case.label} | {jobs} | {counted.total} / {counted.kernels} | "
                                    f"{counted.total / full.total:.3f} / {counted.kernels / full.kernels:.3f} | "
                                    f"{sum(counted.syncs.values())} |")
    return (lines + [""] + (resnet_lines + [""] if len(resnet_lines) > 4 else [])
            + (stage_lines + [""] if len(stage_lines) > 4 else []))


DISPATCH_JOBS = (1, 8)

TARGET_AT_0_2 = {"sd15": 1.15, "sdxl": 2.5, "flux": 2.5}  # issue 37, one job


def part_flops(args: Any, device: torch.device) -> list[str]:
    """FLOP bounds of the mask-aware step (see the module doc), one job, on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = torch.device("meta")
    lines = ["## FLOPs per step (one job; meta device, PyTorch's FLOP formulas)", "",
             "The speedup bound is full FLOPs over mask-aware FLOPs: what the step reaches at best once the "
             "GPU no longer waits for its host. *ResNets masked too*: the UNet's ResNets also computed at the "
             "masked tokens (`workers/maskaware/resnets.py`; their GEMMs count as matmuls).", "",
             "| model | ratio | full TFLOP (convolutions) | mask-aware TFLOP: ResNets on the whole map / masked too | "
             "speedup bound: ResNets on the whole map / masked too | issue 37 target at 0.2 |",
             "|---|---|---|---|---|---|"]
    for key in args.models:
        variants = ["full"] if key == "flux" else ["full", "masked"]
        tallies: dict[str, int] = {}  # total FLOPs of each call
        conv = 0  # the full step's convolution FLOPs
        for resnets in variants:
            case = (flux_case(args, meta, args.ratios) if key == "flux"
                    else unet_case(key, args, meta, ratios=args.ratios, resnets=resnets))
            for name in ["full eager", *(f"masked {r:g} eager" for r in args.ratios)]:
                with torch.no_grad():
                    case.calls[name]()  # the first call of a batch builds its index on the host
                counter = FlopCounterMode(display=False)
                with torch.no_grad(), counter:
                    case.calls[name]()
                tallies[f"{resnets}/{name}"] = counter.get_total_flops()
                if name == "full eager":
                    conv = counter.get_flop_counts()["Global"].get(torch.ops.aten.convolution, 0)
        full = tallies["full/full eager"]
        for r in args.ratios:
            masked = [tallies[f"{v}/masked {r:g} eager"] for v in variants]
            row = {"full_tflop": full / 1e12, "conv_tflop": conv / 1e12,
                   "masked_tflop": [m / 1e12 for m in masked], "bound": [full / m for m in masked]}
            args.results.setdefault("flops", {}).setdefault(key, {})[f"{r:g}"] = row
            target = f"{TARGET_AT_0_2[key]:g}x" if abs(r - 0.2) < 1e-9 else ""
            lines.append(f"| {case.label} | {r:g} | {row['full_tflop']:.2f} ({conv / full:.0%}) | "
                         + " / ".join(f"{v:.2f}" for v in row["masked_tflop"]) + " | "
                         + " / ".join(f"{v:.2f}x" for v in row["bound"]) + f" | {target} |")
    return lines + [""]


RESNET_JOBS = {"sd15": (1, 8), "sdxl": (1,)}  # CFG jobs per step of ``part_resnets`` (issue 37: SD 1.5 at 1 and 8)


def part_resnets(args: Any, device: torch.device) -> list[str]:
    """The mask-aware step with the UNet's ResNets on the whole map and computed at the masked tokens
    too (``workers/maskaware/resnets.py``), eager and graph, against the full step (``RESNET_JOBS``
    jobs, each its own mask and template cache); the models' FLOP bounds are ``part_flops``'s."""
    lines = ["## Mask-aware ResNets per step: ResNets on the whole map / at the masked tokens too", "",
             "| model | jobs | ratio | full eager / graph ms | masked eager / graph ms | "
             "masked + ResNets eager / graph ms | speedup vs full graph: masked / + ResNets | "
             "speedup vs full eager: masked / + ResNets (eager) |",
             "|---|---|---|---|---|---|---|---|"]
    policy_rows: list[str] = []
    lines_notes: list[str] = []
    for key, jobs in [(k, j) for k in args.models if k != "flux" for j in RESNET_JOBS[k]]:
        base = unet_case(key, args, device, jobs=jobs, ratios=args.ratios)
        masked = unet_case(key, args, device, jobs=jobs, ratios=args.ratios, resnets="masked")
        case = Case(key, base.label, calls={k: v for k, v in base.calls.items() if k.endswith(("eager", "graph"))},
                    graphs=[*base.graphs, *masked.graphs])
        for r in args.ratios:
            for mode in ("eager", "graph"):
                case.calls[f"resnets {r:g} {mode}"] = masked.calls[f"masked {r:g} {mode}"]
        t = {k: v * 1e3 for k, v in measure(case, args, device).items()}
        args.results.setdefault("resnets", {})[f"{key} x{jobs}"] = t
        for r in args.ratios:
            m = (t[f"masked {r:g} eager"], t[f"masked {r:g} graph"])
            rn = (t[f"resnets {r:g} eager"], t[f"resnets {r:g} graph"])
            lines.append(f"| {case.label} | {jobs} | {r:g} | {t['full eager']:.1f} / {t['full graph']:.1f} | "
                         f"{m[0]:.1f} / {m[1]:.1f} | {rn[0]:.1f} / {rn[1]:.1f} | "
                         f"{t['full graph'] / m[1]:.2f}x / {t['full graph'] / rn[1]:.2f}x | "
                         f"{t['full eager'] / m[0]:.2f}x / {t['full eager'] / rn[0]:.2f}x |")
            speedups = {"": t["full graph"] / m[1], "+resnets": t["full graph"] / rn[1]}
            costs = policy_costs(speedups)
            args.results.setdefault("resnets_policies", {})[f"{key} x{jobs} {r:g}"] = costs
            policy_rows.append(policy_row(case.label, jobs, r, costs))
        lines_notes.append(f"- {case.label}, {jobs} jobs: graph calls captured/replayed/eager "
                           f"{case.notes.get('graph calls captured/replayed/eager', '-')}")
    return lines + ["", *lines_notes, "", *policy_table(policy_rows, "the graph-replayed steps above"), ""]


REUSE_SHARES = (0.5, 1.0)  # of every unit's patches, on a step that may reuse


def with_turbo(case: Case, ctrl: Any, masked: list[Any], call: Callable[[list[Any]], Any]) -> None:
    """Add ``turbo <share> eager`` calls to ``case``: the masked groups with a ``TemporalReuse`` whose
    units reuse every ``1 / share``-th patch (all at 1.0) from the step before; each call is the next
    step of the job (its first computes every patch). What the engine does between steps (the
    rule's decision after the step's read) is host work outside the step and not timed."""
    import dataclasses

    import numpy as np

    from workers.maskaware.reuse import TemporalReuse

    class Fixed:
        name, record = "fixed", False

        def reuse(self, features: np.ndarray) -> np.ndarray:
            return np.zeros(len(features), bool)

    for share in REUSE_SHARES:
        tr = TemporalReuse(Fixed(), 1 << 30, frozenset(), 7.5, ctrl.reuse_units, max_tokens=1)
        every = max(1, round(1 / share))

        def run(tr: TemporalReuse = tr, every: int = every) -> Any:
            step = tr.step + 1
            tr.begin(step)
            if step > 0:
                tr.allowed = True
                for u in tr.units.values():
                    u.reuse_next = np.arange(u.patches) % every == 0
            out = call([dataclasses.replace(g, reuse=tr) for g in masked])
            tr.collect(step)  # the errors' copy to the host, as the engine starts it
            return out

        case.calls[f"turbo {share:g} eager"] = run


def part_reuse(args: Any, device: torch.device) -> list[str]:
    lines = ["## Temporal reuse per step (one job, ratio 0.2; `turbo` steps run eagerly)", "",
             "| model | masked eager ms | masked graph ms | "
             + " | ".join(f"turbo {s:g} eager ms" for s in REUSE_SHARES)
             + " | turbo vs masked eager | turbo vs masked graph | kernels masked / turbo 1 | "
             "turbo 1 wall / kernel |", "|---|---|---|" + "---|" * len(REUSE_SHARES) + "---|---|---|---|"]
    for key in [k for k in args.models if k in ("sd15", "flux")]:
        case = flux_case(args, device, [0.2], turbo=True) if key == "flux" else \
            unet_case(key, args, device, ratios=[0.2], turbo=True)
        for unreported in ("full eager", "full graph"):  # this part compares masked and turbo steps only
            case.calls.pop(unreported, None)
        t = measure(case, args, device)
        prof = {name: profile_call(case.calls[name], device) for name in ("masked 0.2 eager", "turbo 1 eager")}
        args.results.setdefault("reuse", {})[key] = {"ms": {k: v * 1e3 for k, v in t.items()}, "profile": prof}
        eager, graph = t["masked 0.2 eager"], t["masked 0.2 graph"]
        turbo = [t[f"turbo {s:g} eager"] for s in REUSE_SHARES]
        p1 = prof["turbo 1 eager"]
        lines.append(f"| {case.label} | {eager * 1e3:.1f} | {graph * 1e3:.1f} | "
                     + " | ".join(f"{x * 1e3:.1f}" for x in turbo) + " | "
                     + " / ".join(f"{eager / x:.2f}x" for x in turbo) + " | "
                     + " / ".join(f"{graph / x:.2f}x" for x in turbo) + " | "
                     + f"{prof['masked 0.2 eager']['kernels']} / {p1['kernels']} | "
                     + (f"{p1['wall_ms'] / p1['kernel_ms']:.2f}" if p1["kernel_ms"] else "-") + " |")
    return lines + [""]


def part_compiled(args: Any, device: torch.device) -> list[str]:
    """Graph-replayed steps with the eager kernels against ``STENCIL_COMPILE``'s (``CompiledSteps``):
    the first call of each compiled step (its compilation) timed apart, then interleaved rounds. A
    variant whose first call raises is reported with its error and left out of the rounds."""
    from torch._dynamo.utils import counters

    lines = ["## Compiled steps: CUDA graphs with eager or compiled kernels, and `reduce-overhead` (one job)", "",
             "Speedups are against the full step replayed as a CUDA graph with the eager kernels (the "
             "engine's default). *graph compiled*: `STENCIL_COMPILE=default` (Inductor's kernels) inside the "
             "engine's step graphs; *reduce-overhead*: that mode as the engine runs it, without the engine's "
             "graphs: a full step's whole forward in torch.compile's own CUDA graphs, a mask-aware step eager "
             "around its compiled block computations (which never take those graphs, `WITHOUT_OWN_GRAPHS`).", "",
             "| model | step | graph ms | graph compiled ms | reduce-overhead ms | vs full graph: graph / "
             "graph compiled / reduce-overhead | first call (compilation) s: graph compiled / reduce-overhead |",
             "|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    # The compiled functions are shared by the models and modes of a run: room for their shapes,
    # and a function past the limit fails (reported) rather than silently running eagerly.
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        for key in args.models:
            case = (flux_case(args, device, args.ratios, compiled=True) if key == "flux"
                    else unet_case(key, args, device, ratios=args.ratios, compiled=True))
            names = ["full", *(f"masked {r:g}" for r in args.ratios)]
            case.calls = {f"{n} {v}": case.calls[f"{n} {v}"] for n in names for v in ("graph", *COMPILE_VARIANTS)}
            result = args.results.setdefault("compiled", {}).setdefault(key, {"first_s": {}, "errors": {}})
            with torch.no_grad():
                for name in [n for n in case.calls if n.endswith(COMPILE_VARIANTS)]:
                    t0 = time.perf_counter()
                    try:
                        case.calls[name]()
                        sync(device)
                    except Exception as exc:  # reported; the other variants still run
                        log.exception("%s %s: first call failed", case.label, name)
                        result["errors"][name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
                        del case.calls[name]
                        continue
                    result["first_s"][name] = time.perf_counter() - t0  # kept as they come: a stage cut short
                    log.info("%s %s: first call (compilation) %.1f s", case.label, name, result["first_s"][name])
            t = measure(case, args, device)
            fell = case.compiled.fallbacks() if case.compiled is not None else []
            # graphs torch.compile's own mode skipped (its reasons are logged): they run eagerly
            result.update(ms={k: v * 1e3 for k, v in t.items()}, fell_back=fell,
                          cudagraph_skips=counters["inductor"]["cudagraph_skips"])
            notes += [f"- {case.label}: {name} runs eagerly (its compilation failed)" for name in fell]
            notes += [f"- {case.label}: {name} failed: `{err}`" for name, err in result["errors"].items()]
            full = t["full graph"]
            for n in names:
                cells = [t.get(f"{n} {v}") for v in ("graph", *COMPILE_VARIANTS)]
                firsts = [result["first_s"].get(f"{n} {v}") for v in COMPILE_VARIANTS]
                lines.append(f"| {case.label} | {n} | "
                             + " | ".join("failed" if x is None else f"{x * 1e3:.1f}" for x in cells) + " | "
                             + " / ".join("-" if x is None else f"{full / x:.2f}x" for x in cells) + " | "
                             + " / ".join("-" if x is None else f"{x:.1f}" for x in firsts) + " |")
            log.info("%s compiled: %s", case.label, {k: round(v * 1e3, 2) for k, v in t.items()})
    return lines + [""] + (notes + [""] if notes else [])


PARTS = {"step": part_step, "batch": part_batch, "profile": part_profile, "dispatch": part_dispatch,
         "flops": part_flops, "resnets": part_resnets, "reuse": part_reuse, "compiled": part_compiled}


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, out="docs/bench/gpu_step.md", threads=0)
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--models", type=lambda s: s.split(","), default=["sd15", "sdxl", "flux"])
    p.add_argument("--ratios", type=lambda s: [float(v) for v in s.split(",")], default=[0.05, 0.1, 0.2, 0.5])
    p.add_argument("--jobs", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--parts", default="step,batch,profile")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--reps", type=int, default=3, help="calls per timed sample")
    p.add_argument("--json", default="docs/bench/gpu_step.json")
    run = start(p, argv, __file__, quick=dict(rounds=1, reps=1, ratios=[0.2], jobs=[2], dtype="float32", threads=1,
                                                 out="", json=""))
    args = run.args
    args.results = {}
    device = device_of(args)
    hw = hardware(device)
    log.info("gpu_step on %s", hw)

    def save() -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"hardware": hw, "command": run.command, "dtype": args.dtype, **args.results}, fh, indent=1)

    def saving(part: Callable[[Any, torch.device], list[str]]) -> Callable[[Any, torch.device], list[str]]:
        def run_part(a: Any, d: torch.device) -> list[str]:
            try:
                return part(a, d)
            finally:
                save()  # after each part: a run cut short by its time limit keeps what it measured
        return run_part

    stop_on_sigterm()
    try:
        report_parts(run, f"Mask-aware steps on {hw}", {name: saving(part) for name, part in PARTS.items()}, device)
    except Stopped:
        log.warning("stopped by SIGTERM: %s holds what was measured", args.json or "nothing")
        return 143
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
