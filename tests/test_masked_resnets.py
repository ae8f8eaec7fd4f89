"""Mask-aware ResNets (``workers/maskaware/resnets.py``): a ResNet's convolutions computed at the
masked tokens equal the module's own forward there, the rest of its output is the cache's, and a
masked UNet step does a fraction of the full step's convolution FLOPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D
from torch.utils.flop_counter import FlopCounterMode

from tests.test_maskaware_unet import LATENT, _one_forward, sdxl_style_unet
from workers.maskaware import MaskAwareUNet, RowGroup
from workers.maskaware.resnets import MaskedRows, build_index, constants, masked_forward, stats, supported
from workers.maskaware.tokens import blob_mask, rect_mask

TOL = 1e-4


def _resnet(cin: int, cout: int, scale: float = 1.0) -> ResnetBlock2D:
    torch.manual_seed(cin + cout)
    block = ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=24, groups=8,
                          output_scale_factor=scale).eval()
    with torch.no_grad():  # non-trivial affine norms and biases
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return block


@pytest.mark.parametrize(("cin", "cout", "scale"), [(16, 16, 1.0), (16, 32, 1.0), (32, 16, 2.0)])
def test_masked_outputs_equal_the_modules_forward_at_the_masked_tokens(cin: int, cout: int, scale: float) -> None:
    """Three groups (2, 1 and 2 rows) with their own masks, one touching every border: each masked
    token's output equals the module's, with norm2's statistics from the same input."""
    block = _resnet(cin, cout, scale)
    assert supported(block)
    h, w = 12, 10
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, cin, h, w, generator=g)
    temb = torch.randn(5, 24, generator=g)
    border = torch.zeros(h, w, dtype=torch.bool)
    border[0, :] = border[:, -1] = True
    masks = [blob_mask(h, w, 0.2, seed=1), rect_mask(h, w, 0.1, seed=2), border]
    groups = [MaskedRows(0, 2, 0, masks[0]), MaskedRows(2, 1, 2, masks[1]), MaskedRows(3, 2, 3, masks[2])]
    with torch.no_grad():
        full = block(x, temb)
        captured: dict[str, torch.Tensor] = {}

        def keep(mod: torch.nn.GroupNorm, args: tuple) -> None:
            captured["n2"] = stats(args[0], mod.num_groups, mod.eps)

        hook = block.norm2.register_forward_pre_hook(keep)
        block(x, temb)
        hook.remove()
        index = build_index(groups, (h, w), x.device)
        fresh = masked_forward(block, x, temb, index, captured["n2"])
    assert fresh.shape == (cout, sum(int(m.sum()) * grp.rows for m, grp in zip(masks, groups)))
    expected = full.view(5, cout, h * w).transpose(1, 2)[index.out_rows, index.out_pos].t()
    assert (fresh - expected).abs().max() <= TOL * max(1.0, float(expected.abs().max()))
    assert index.out_rows.tolist().count(4) == int(border.sum())  # every row of every group, once


def test_what_a_masked_forward_prepares_of_the_parameters_follows_changes_in_place() -> None:
    """``norm2``'s affine in float32 and ``conv2``'s bias with the shortcut's are prepared once per
    module and reused while its parameters stand; changed in place (as fusing an adapter changes
    them), they are prepared anew and the masked outputs follow the module's forward."""
    block = _resnet(16, 32)
    first = constants(block)
    assert constants(block, first) is first
    h, w = 8, 8
    g = torch.Generator().manual_seed(3)
    x, temb = torch.randn(2, 16, h, w, generator=g), torch.randn(2, 24, generator=g)
    index = build_index([MaskedRows(0, 2, 0, blob_mask(h, w, 0.3, seed=4))], (h, w), x.device)
    with torch.no_grad():
        block.norm2.weight.mul_(1.5)
        block.conv_shortcut.bias.add_(0.5)  # type: ignore[union-attr]
        again = constants(block, first)
        assert again is not first and torch.equal(again.norm2_weight, block.norm2.weight)
        assert again.out_bias is first.out_bias  # updated in place: a captured graph reads the new values
        captured: dict[str, torch.Tensor] = {}
        hook = block.norm2.register_forward_pre_hook(
            lambda mod, args: captured.update(n2=stats(args[0], mod.num_groups, mod.eps)))
        full = block(x, temb)
        hook.remove()
        fresh = masked_forward(block, x, temb, index, captured["n2"], again)
        stale = masked_forward(block, x, temb, index, captured["n2"], dataclasses.replace(
            again, out_bias=block.conv2.bias[:, None] + block.conv_shortcut.bias[:, None] - 0.5))  # type: ignore[union-attr]
    expected = full.view(2, 32, h * w).transpose(1, 2)[index.out_rows, index.out_pos].t()
    assert (fresh - expected).abs().max() <= TOL * max(1.0, float(expected.abs().max()))
    assert (stale - expected).abs().max() > 0.1  # the check sees stale constants


def test_sixteen_bit_statistics_are_read_as_they_are_cached() -> None:
    """Statistics cached in 16 bits (a template cache's outputs) enter float32 arithmetic by type
    promotion, with no copy of their own: the result equals that of the statistics made float32."""
    block = _resnet(16, 16)
    h, w = 8, 8
    g = torch.Generator().manual_seed(5)
    x, temb = torch.randn(2, 16, h, w, generator=g), torch.randn(2, 24, generator=g)
    st = torch.stack([torch.randn(2, 16, generator=g), torch.rand(2, 16, generator=g) + 0.5], dim=1)
    index = build_index([MaskedRows(0, 2, 0, rect_mask(h, w, 0.3, seed=6))], (h, w), x.device)
    with torch.no_grad():
        half = masked_forward(block, x, temb, index, st.bfloat16())
        widened = masked_forward(block, x, temb, index, st.bfloat16().float())
    assert torch.equal(half, widened)


def test_a_step_takes_unmasked_tokens_from_the_cache_and_computes_masked_ones() -> None:
    """Changing a ResNet's cached output at an unmasked token changes the step; at a masked token,
    which the step computes, it does not."""
    unet = sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet, resnets="masked")
    x, t, e = _one_forward(unet)
    mask = torch.zeros(LATENT, dtype=torch.bool)
    mask[4:9, 5:11] = True
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record")]) as ctx:
        unet(x, t, e)
    cache = ctx.recorded[0]
    name = "down_blocks.0.resnets.1.r"  # level 0: no transformer after it to hide a change
    assert name in cache and cache[name].shape[-2:] == LATENT
    tm = ctrl.token_masks(mask, LATENT)

    def step(c: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache=c)]):
            return unet(x, t, e).sample

    base = step(cache)
    inside, outside = dict(cache), dict(cache)
    inside[name] = cache[name].clone()
    inside[name][:, :, 6, 7] += 5.0
    outside[name] = cache[name].clone()
    outside[name][:, :, 0, 0] += 5.0
    assert torch.equal(step(inside), base)
    assert (step(outside) - base).abs().max() > 1e-3


def test_a_graphed_call_computes_fully_the_resnets_of_a_job_whose_cache_lacks_them() -> None:
    """A job whose cache does not hold the ResNets' tensors (``resnets`` in its full units) computes
    its ResNets fully in a graph-captured call, as in an eager one, and both calls agree."""
    from workers.engine.graph_calls import unet_call
    from workers.engine.graphs import StepGraphs
    from workers.engine.staging import CacheStager

    unet = sdxl_style_unet(0)
    ctrl = MaskAwareUNet(unet, resnets="masked")
    x, t, e = _one_forward(unet)
    with torch.no_grad(), ctrl.batch([RowGroup(2, "record")]) as ctx:
        unet(x, t, e)
    without = {k: v for k, v in ctx.recorded[0].items() if k not in set(ctrl.resnets.tensor_names())}  # type: ignore[union-attr]
    mask = torch.zeros(LATENT, dtype=torch.bool)
    mask[4:9, 5:11] = True
    tm = ctrl.token_masks(mask, LATENT).prepare("cpu")

    def group() -> RowGroup:
        return RowGroup(2, "masked", token_mask=tm, cache=CacheStager("cpu").take("j", 0, without),
                        full_units=frozenset({"resnets"}))

    with torch.no_grad():
        with ctrl.batch([group()]):
            eager = unet(x, t, e).sample
        graphs = StepGraphs("cpu", repeats=1)
        for _ in range(2):  # captured, then replayed
            graphed = unet_call(graphs, unet, ctrl, (x, t), {"encoder_hidden_states": e}, [group()],
                                torch.device("cpu"))[0]
            assert torch.equal(graphed, eager)
    assert graphs.captures == 1


def test_a_masked_step_does_a_fraction_of_the_convolution_flops() -> None:
    """Counted FLOPs (PyTorch's formulas) of a masked step at a 0.2 mask on a 32x32 latent: with
    mask-aware ResNets it does at least 40% of the step's convolution FLOPs less than with ResNets
    on the whole map (their GEMMs at the grown masked tokens and halos count as matmuls; conv_in/out,
    the samplers and the coarsest level, where the grown mask covers the map, stay convolutions)."""
    unet = sdxl_style_unet(0)
    side = 32
    g = torch.Generator().manual_seed(0)
    x, t, e = torch.randn(2, 9, side, side, generator=g), torch.tensor([981, 501]), torch.randn(2, 6, 32, generator=g)
    tallies = {}
    for resnets in ("full", "masked"):
        ctrl = MaskAwareUNet(unet, resnets=resnets)
        with torch.no_grad(), ctrl.batch([RowGroup(2, "record")]) as ctx:
            unet(x, t, e)
        tm = ctrl.token_masks(blob_mask(side, side, 0.2, seed=3), (side, side))
        tallies[resnets] = FlopCounterMode(display=False)
        with torch.no_grad(), ctrl.batch([RowGroup(2, "masked", token_mask=tm, cache=ctx.recorded[0])]), \
                tallies[resnets]:
            unet(x, t, e)
        ctrl.remove()
    conv = tallies["full"].get_flop_counts()["Global"][torch.ops.aten.convolution]
    saved = tallies["full"].get_total_flops() - tallies["masked"].get_total_flops()
    assert saved >= 0.4 * conv, (saved, conv)


def test_the_engine_serves_an_edit_with_masked_resnets_that_equals_full_compute(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the engine's runner (trained SD model): a warm-up recorded from the edit's own inputs
    stores the ResNets' tensors with the blocks', and the mask-aware edit from it, ResNets included,
    gives full compute's image."""
    import numpy as np

    from app.demo import demo_templates
    from app.jobs import JobParams
    from app.maskgen import make_mask
    from app.storage import LocalStore
    from ops.bench.harness.edits import OPTIONS, Family, edit, warm
    from workers.maskaware.activation_store import ActivationStore

    fam = Family("sd", ActivationStore(LocalStore(tmp_path / "acts")), resnets="masked")
    image = demo_templates(128)[1][1]
    mask = make_mask(0.05, (128, 128), "blob", seed=4)  # grown by 2 tokens, under half the 16x16 latent
    params = JobParams(prompt="a cat", seed=5, steps=6, guidance=7.5)
    tm = fam.ctrl.token_masks(torch.from_numpy(mask), (16, 16))
    assert tm.grown(256, 2) <= 128  # the level-0 ResNets take the masked path
    key = warm(fam, "own", image, mask, params)
    stored = fam.runner_ma.caches.activations.read_step(key, 0)  # type: ignore[union-attr]
    assert set(fam.ctrl.resnets.tensor_names()) <= set(stored)  # type: ignore[union-attr]
    tensors, meta = fam.prepare(image, mask, params)
    full = fam.full(tensors, meta)
    out = edit(fam, OPTIONS["exact-region"], image, mask, params, key)
    assert out["masked_steps"] == params.steps, out
    diff = np.abs(full.astype(int) - fam.decode(out["latents"]).astype(int))
    assert diff.max() <= 1, diff.max()


RUNNER_LATENT = (24, 24)  # three levels (24, 12, 6): a 0.05 mask grown by two tokens leaves level 0 sparse


def _masked_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the ResNet calls that took the masked path (so a test cannot pass on full compute)."""
    from workers.maskaware import resnets

    calls = [0]
    real = resnets.MaskedResnets._masked

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(resnets.MaskedResnets, "_masked", counted)
    return calls


@pytest.mark.parametrize("cache_plan", ["all", "plan", "resident"])
def test_the_runner_loads_the_resnets_tensors_with_the_units_and_is_exact(tmp_path, cache_plan: str,  # type: ignore[no-untyped-def]
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the runner, whatever loads the cache (the whole step, the plan's units, what is
    resident): a masked edit from a warm-up of its own inputs equals full compute, ResNets included."""
    from tests.test_plan_engine import _job, _run, _runner_setup
    from workers.engine.sd_runner import SDRunner
    from workers.maskaware import TemplateCacheKey

    steps, lat = 5, RUNNER_LATENT
    unet, ctrl, runner, caches, _store, cfg = _runner_setup(tmp_path, cache_plan, resnets="masked")
    calls = _masked_calls(monkeypatch)
    try:
        key = TemplateCacheKey("t", "tpl", lat[0] * 8, lat[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        rec = _run(runner, _job(runner, "record", key, steps, ratio=0.05, latent=lat))
        rec["commit"].result(timeout=60)
        plain = SDRunner(unet, cfg)
        ref = _run(plain, _job(plain, "full", None, steps, ratio=0.05, latent=lat))["latents"]
        out = _run(runner, _job(runner, "masked", key, steps, ratio=0.05, latent=lat))
        assert out["masked_steps"] + out["fallback_steps"] == steps
        assert float((out["latents"] - ref).abs().max()) <= TOL
        if cache_plan == "all":  # every step waited for: each took the masked ResNets
            assert out["masked_steps"] == steps and calls[0] >= steps
    finally:
        caches.close(wait=True)


def _resnet_twins(ctrl, lat: tuple[int, int]) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Two mask seeds whose masks differ, whose ResNets take the masked path at some level, and
    whose token buckets, for the transformer blocks and the ResNets alike, are the same (the jobs'
    masks are ``_job``'s 0.05 blobs)."""
    from workers.maskaware.tokens import blob_mask

    def signature(s: int) -> tuple:  # type: ignore[type-arg]
        tm = ctrl.token_masks(blob_mask(lat[0] * 8, lat[1] * 8, 0.05, seed=s).bool(), lat)
        plan = ctrl.resnets.plan([RowGroup(2, "masked", token_mask=tm)], torch.device("cpu"), bucketed=True)
        return tm.with_buckets().counts(), plan.structure, tm.counts(), any(lv.masked for lv in plan.levels.values())

    seen: dict[tuple, tuple[int, tuple]] = {}  # type: ignore[type-arg]
    for s in range(10, 600):
        sig = signature(s)
        if not sig[3]:
            continue
        first = seen.setdefault(sig[:2], (s, sig[2]))
        if first[1] != sig[2]:
            return first[0], s
    raise AssertionError("no two masks of the same buckets among 590 seeds")


def test_graphed_steps_with_masked_resnets_replay_another_masks_gathers(tmp_path,  # type: ignore[no-untyped-def]
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A masked edit captures its step's graph; a second edit whose masks differ but share every
    bucket replays it (no capture): its ResNets' gathers are the graph's inputs, so it equals the
    same edit run eagerly bit for bit (a graph holding the first edit's gathers would not)."""
    from tests.test_plan_engine import _job, _run, _runner_setup, _warm
    from workers.engine.sd_runner import SDRunner
    from workers.maskaware import TemplateCacheKey

    steps, lat = 5, RUNNER_LATENT
    unet, ctrl, runner, caches, _store, cfg = _runner_setup(tmp_path, "plan", bandwidth=1e9, resnets="masked")
    calls = _masked_calls(monkeypatch)
    try:
        key = TemplateCacheKey("t", "tpl", lat[0] * 8, lat[1] * 8, "ddim", steps, 1.0, "cfg2", ctrl.cache_layout)
        _warm(runner, caches, key, steps, latent=lat)
        first, twin = _resnet_twins(ctrl, lat)
        graphed = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0, graphs=True)
        graphed.graphs.min_horizon = 1  # these jobs are short: capture even near their end
        _run(graphed, _job(graphed, "masked", key, steps, seed=first, ratio=0.05, latent=lat))
        assert graphed.graphs.captures == 1
        before = calls[0]
        second = _run(graphed, _job(graphed, "masked", key, steps, seed=twin, ratio=0.05, latent=lat))
        assert graphed.graphs.captures == 1 and second["graph_replayed_steps"] == steps
        assert calls[0] > before  # the replays ran the masked ResNets
        eager = SDRunner(unet, cfg, maskaware=ctrl, caches=caches, prefetch_steps=0)
        eager.bucket_tokens = True
        assert ctrl.resnets.bucketed  # set by the graphed runner: eager steps pad as graphed ones do
        alone = _run(eager, _job(eager, "masked", key, steps, seed=twin, ratio=0.05, latent=lat))
        assert torch.equal(alone["latents"], second["latents"])
    finally:
        caches.close(wait=True)
