"""A denoiser call as a graph's inputs (``workers/engine/graphs.py``): what it reads that changes
from step to step, and a function that runs it on any tensors of that structure.

Inputs are the step's model arguments (latents, timesteps, text, ...), then the masked jobs'
staged caches (each staged buffer once: the jobs of a step share one, ``workers/engine/staging.py``)
and their token indices: the call's batch index where the model has one (``workers/maskaware/
batched.py``), else each job's. The signature holds what fixes the call's shapes and control flow:
the arguments' shapes and dtypes and each job's mode, rows, token counts (rounded up to token
buckets where steps are graphed, ``workers/maskaware/buckets.py``, so one graph serves every mask
of its buckets; with a ragged batch index only whether a level has none, some or all of a job's
tokens: its counts are device data), index shapes, cache layout and place in its buffer, and the
batch index's layout.
The function rebuilds the row groups over the tensors it is given (static buffers when captured),
so a replay reads the step's data.

A ragged step whose signature has no graph yet takes one captured for a wider batch of the same
composition where there is one: its levels' token totals padded up to that graph's, each by at
most ``WIDEN_LIMIT`` x its own bucket (``MaskAwareUNet.batch_index(targets=...)``). The pads
repeat tokens (``workers/maskaware/buckets.py``), so the real tokens compute what they would
alone; the padded ones cost device work in the transformer blocks, where an eager step would cost
the host every launch of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from workers.engine.graphs import StepGraphs
from workers.engine.staging import StagedCache
from workers.maskaware.batched import structure_tokens
from workers.maskaware.resnets import UNIT as RESNETS_UNIT


def graphable(groups: Sequence[Any] | None, record: bool = False) -> bool:
    """Every job computes fully (``record``: or records its activations, which the call then
    returns), or reads a staged cache laid out in one buffer (no unit waited for mid-call, no job
    placed on a larger grid, no temporal reuse: its per-step patch indices and offsets are not
    graph inputs yet)."""
    return groups is None or all(
        g.mode == "full" or (record and g.mode == "record")
        or (g.mode == "masked" and isinstance(g.cache, StagedCache) and g.cache.flat is not None
            and getattr(g, "positions", None) is None and getattr(g, "reuse", None) is None)
        for g in groups)


# How far a step's ragged token totals may be padded to replay a wider batch's graph: about twice
# the buckets' own growth (``buckets.GROWTH``), a bounded share of a step's device work against the
# host-bound time of an eager one.
WIDEN_LIMIT = 1.5


def _wider_graphs(graphs: StepGraphs, key: tuple[Any, ...], tokens: dict[Any, int]) -> list[tuple[Any, ...]]:
    """Captured signatures equal to ``key`` but for the batch index's token totals, each level's
    between its own and ``WIDEN_LIMIT`` x that, fewest padded tokens first."""
    found = []
    for other in graphs.keys():
        if other[:3] != key[:3] or other[3] is None or other[4:] != key[4:] or other == key:
            continue
        wide = structure_tokens(other[3])
        if wide.keys() == tokens.keys() and all(tokens[k] <= wide[k] <= WIDEN_LIMIT * tokens[k] for k in tokens):
            found.append((sum(wide.values()), other))
    return [other for _, other in sorted(found, key=lambda f: f[0])]


def _widened(graphs: StepGraphs, ctrl: Any, groups: list[Any], device: torch.device, key: tuple[Any, ...],
             index: Any) -> tuple[tuple[Any, ...], Any]:
    """(signature, batch index) to run: ``key`` and ``index`` where ``key`` has a graph or no wider
    one fits, else the nearest wider graph's signature and the index padded to it."""
    if not index.ragged or graphs.has(key):
        return key, index
    tokens = index.tokens
    for other in _wider_graphs(graphs, key, tokens)[:2]:  # a rebuilt index costs host work: a few tries
        wide = ctrl.batch_index(groups, device, targets=structure_tokens(other[3]))
        if wide.structure == other[3]:
            graphs.widened += 1
            graphs.widened_rows[0] += sum(wide.tokens.values()) - sum(tokens.values())
            graphs.widened_rows[1] += sum(tokens.values())
            return other, wide
    return key, index


def _signature(args: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in args)


Describe = Callable[[Any], tuple[list[torch.Tensor], tuple[Any, ...]]]


def _job_inputs(groups: Sequence[Any] | None,
                describe: Describe) -> tuple[bool, list[torch.Tensor], list[tuple[Any, ...]]]:
    """(whether a job is masked, the staged buffers then each masked job's index tensors, the
    groups' signature). ``describe(group)``: a masked job's index tensors and what else fixes its
    shapes. A masked job's signature ends with its buffer's number and its first row there."""
    masked = groups is not None and any(g.mode in ("masked", "record") for g in groups)
    buffers: dict[int, int] = {}
    flats: list[torch.Tensor] = []
    parts_of: list[torch.Tensor] = []
    spec: list[tuple[Any, ...]] = []
    for g in (groups or []) if masked else []:
        if g.mode != "masked":
            spec.append((g.mode, g.rows))  # full, or record
            continue
        parts, shape = describe(g)
        ordinal = buffers.setdefault(id(g.cache.flat), len(buffers))
        if ordinal == len(flats):
            flats.append(g.cache.flat)
        parts_of += parts
        spec.append(("masked", g.rows, len(parts), g.cache.layout, *shape, tuple(p.shape for p in parts),
                     ordinal, g.cache.row0))
    return masked, flats + parts_of, spec


def _replayed(groups: Sequence[Any], spec: list[tuple[Any, ...]], tensors: Sequence[torch.Tensor],
              full: Callable[[Any], Any], masked: Callable[[Any, tuple[Any, ...], StagedCache, list[torch.Tensor]], Any]
              ) -> list[Any]:
    """The row groups rebuilt over ``tensors`` (a graph's static buffers: staged caches, then indices)."""
    count = len({sp[-2] for sp in spec if sp[0] == "masked"})
    flats, rest, out = tensors[:count], iter(tensors[count:]), []
    for g, sp in zip(groups, spec):
        if sp[0] != "masked":
            out.append(full(g))
            continue
        cache = StagedCache.over(flats[sp[-2]], sp[3], sp[-1])
        out.append(masked(g, sp, cache, [next(rest) for _ in range(sp[2])]))
    return out


def unet_call(graphs: StepGraphs, unet: Any, ctrl: Any, args: tuple[torch.Tensor, torch.Tensor],
              kwargs: dict[str, Any], groups: Sequence[Any] | None, device: torch.device,
              horizon: int | None = None) -> tuple[torch.Tensor, list[Any]]:
    """``unet(*args, **kwargs)`` (under ``ctrl.batch(groups)`` when a job is masked or records)
    through ``graphs``: the output and each group's recorded activations (None where it records
    none). Both are the graph's own buffers when replayed: the next replay overwrites them."""
    from workers.maskaware.unet import RowGroup

    added = kwargs.get("added_cond_kwargs")
    head = [args[0], args[1], kwargs["encoder_hidden_states"]]
    if added is not None:
        head += [added["text_embeds"], added["time_ids"]]

    index = ctrl.batch_index(list(groups), device) if groups is not None else None

    def describe(g: Any) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
        indices = () if index is not None else g.token_mask.device_indices(device)
        counts = g.token_mask.counts()
        if index is not None and index.ragged:  # counts are device data: per level only none / some / all
            counts = tuple(min(c, 1) + (c >= lvl.numel()) for c, lvl in zip(counts, g.token_mask.levels))
        return [t for _, t in indices], (counts, tuple(n for n, _ in indices), frozenset(g.full_units))

    masked, jobs, spec = _job_inputs(groups, describe)
    structure = None if index is None else index.structure
    # Mask-aware ResNets (``workers/maskaware/resnets.py``): their gathers, in token buckets, are
    # one more input, and what fixes their shapes is in the signature.
    # A job whose cache lacks their tensors computes its ResNets fully, as in an eager call.
    resnets = getattr(ctrl, "resnets", None)
    rplan = None
    if resnets is not None and groups is not None:
        forced = frozenset(i for i, g in enumerate(groups) if g.mode == "masked" and RESNETS_UNIT in g.full_units)
        rplan = resnets.plan(list(groups), device, forced, bucketed=True)
    key = ("unet", _signature(head), tuple(spec), structure, None if rplan is None else rplan.structure)
    if index is not None:
        key, index = _widened(graphs, ctrl, list(groups or ()), device, key, index)
        jobs.append(index.data)
    if rplan is not None and rplan.data is not None:
        jobs.append(rplan.data)
    tail = (index is not None) + (rplan is not None and rplan.data is not None)  # trailing index inputs

    def forward(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
        kw: dict[str, Any] = {"encoder_hidden_states": ts[2], "return_dict": False}
        if added is not None:
            kw["added_cond_kwargs"] = {"text_embeds": ts[3], "time_ids": ts[4]}
        if not masked:
            return unet(ts[0], ts[1], **kw)[0], [None] * len(groups or ())
        rest = ts[len(head):len(ts) - tail]
        replayed = _replayed(groups, spec, rest,  # type: ignore[arg-type]
                             lambda g: RowGroup(g.rows, g.mode),
                             lambda g, sp, cache, parts: RowGroup(
                                 g.rows, "masked", cache=cache, full_units=g.full_units,
                                 token_mask=g.token_mask.with_indices(dict(zip(sp[5], parts)), device)))
        batch: dict[str, Any] = {"index": None if index is None else index.over(ts[len(ts) - tail]),
                                 "build_index": False}
        if rplan is not None:
            batch["resnet_plan"] = rplan if rplan.data is None else rplan.over(ts[-1])
        return _untimed(ctrl, replayed, lambda: unet(ts[0], ts[1], **kw)[0], recorded=True, batch=batch)

    return graphs.run(key, head + jobs, forward, horizon)


_FLUX_ARGS = ("hidden_states", "timestep", "guidance", "pooled_projections", "encoder_hidden_states", "txt_ids",
              "img_ids")


def flux_call(graphs: StepGraphs, transformer: Any, ctrl: Any, kwargs: dict[str, Any],
              groups: Sequence[Any] | None, horizon: int | None = None) -> torch.Tensor:
    """``transformer(**kwargs)`` (under ``ctrl.batch(groups)`` when a job is masked) through ``graphs``."""
    from workers.maskaware.flux import FluxTokens, RowGroup

    names = [n for n in _FLUX_ARGS if kwargs.get(n) is not None]
    head = [kwargs[n] for n in names]

    def describe(g: Any) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
        tok = g.token_mask
        return ([] if tok.sel is None else [tok.sel, tok.unsel]), (tok.m,)

    masked, jobs, spec = _job_inputs(groups, describe)

    def forward(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        kw: dict[str, Any] = dict(zip(names, ts[:len(head)]), return_dict=False)
        if not masked:
            return transformer(**kw)[0]
        replayed = _replayed(groups, spec, ts[len(head):],  # type: ignore[arg-type]
                             lambda g: RowGroup(g.rows, "full"),
                             lambda g, sp, cache, parts: RowGroup(
                                 g.rows, "masked", cache=cache,
                                 token_mask=FluxTokens(g.token_mask.mask, sp[4], *(parts + [None] * (2 - len(parts))),
                                                       g.token_mask.masked)))
        return _untimed(ctrl, replayed, lambda: transformer(**kw)[0])

    return graphs.run(("flux", tuple(names), _signature(head), tuple(spec)), head + jobs, forward, horizon)


def _untimed(ctrl: Any, groups: list[Any], call: Any, recorded: bool = False,
             batch: dict[str, Any] | None = None) -> Any:
    """``call()`` inside ``ctrl.batch(groups, **batch)`` without the controller's unit timings (no
    events inside a captured call); ``recorded``: with what the groups recorded."""
    timing = getattr(ctrl, "timing", None)
    if timing is not None:
        ctrl.timing = False
    try:
        with ctrl.batch(groups, **(batch or {})) as ctx:
            out = call()
        return (out, list(ctx.recorded)) if recorded else out
    finally:
        if timing is not None:
            ctrl.timing = timing


__all__ = ["flux_call", "graphable", "unet_call"]
