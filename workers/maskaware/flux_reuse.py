"""Temporal reuse in mask-aware Flux (``reuse.py`` for the packed token state of ``flux.py``).

Why: a Flux edit runs every masked token through all 57 blocks at every step, although a block's
contribution to a token moves little between adjacent steps for much of the schedule.

What a block does for a job that reuses some of its patches this step (a patch: ``reuse.PATCH``
consecutive positions of the job's computed tokens):
- the block runs on a sub-pack of the computed patches only (every job's text still runs whole);
- a reused token's key and value come from the template's cache of this step plus the offset the
  job had at the last step that computed it (``UnitReuse.merge``, as in the UNet), so attention
  sees every token of the job;
- a reused token's output is its input plus the block's residual from the last step that computed
  it (FORA's residual reuse, per patch): Flux caches no hidden states, and the input carries this
  step's change from the blocks before;
- the error a reuse would have made is measured at the computed patches against the block's
  residual (``|y - x - r_last| / |y - x|``); the job's ``TemporalReuse`` reads it after the step.
A job that computes every patch this step still passes through here: its offsets and errors are
updated so that the next step can decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

BlockForward = Callable[..., None]


def reuse_block(forward: BlockForward, block: torch.nn.Module, name: str, plan: Any, temb: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], kernels: Any) -> None:
    """Run one block (``forward``: ``flux.double_block_forward`` or ``single_block_forward``) on the
    plan's packed state with the reusing jobs' patches decided for this step."""
    units = {row.row: row.reuse.plan(name, row.sel_own, row.m, row.own, row.real)
             for row in plan.active if row.reuse is not None}
    x_in = plan.img
    partial = any(u.sub is not None for u in units.values())
    if not partial:  # every patch computed: the pack as it is (the block may update it in place)
        x_in = x_in.clone()
        plan.unit_reuse = units
        try:
            forward(block, name, plan, temb, rope, kernels)
        finally:
            plan.unit_reuse = {}
        for row in plan.active:
            u = units.get(row.row)
            if u is not None:
                seg = slice(row.off, row.off + row.m)
                u.combine("y", True, x_in[None, seg], plan.img[None, seg], residual=True)
        return

    saved = (plan.active, plan.img_segs, plan.M, plan.tok, plan._layouts)
    view, picks, off = [], [], 0
    for row in plan.active:
        u = units.get(row.row)
        if u is None or u.sub is None:
            k, pick = row.m, torch.arange(row.off, row.off + row.m, device=x_in.device)
            part = dataclasses.replace(row, off=off)
        else:
            k, pick = u.k, u.sub + row.off
            part = dataclasses.replace(row, off=off, m=k, sel=row.sel.index_select(0, u.sub), sel_own=u.idx,
                                       rot_key=("reuse", row.row, name))
        view.append(part)
        picks.append(pick)
        off += k
    plan.active = view
    plan.img_segs = [(row.active, row.off, row.off + row.m) for row in view]
    plan.M = off
    plan.img = x_in.index_select(0, torch.cat(picks))
    plan.tok = None  # the single blocks' text + image pack is rebuilt from the sub-pack
    plan._layouts = {}
    plan.unit_reuse = units
    try:
        forward(block, name, plan, temb, rope, kernels)
        y = plan.img
    finally:
        plan.active, plan.img_segs, plan.M, plan.tok, plan._layouts = saved
        plan.unit_reuse = {}
    out = torch.empty_like(x_in)
    for row, part in zip(plan.active, view):
        seg, got = slice(row.off, row.off + row.m), y[part.off:part.off + part.m]
        u = units.get(row.row)
        if u is None:
            out[seg] = got
        else:
            out[seg] = u.combine("y", True, x_in[None, seg], got[None], residual=True)[0]
    plan.img, plan.tok = out, None


__all__ = ["reuse_block"]
