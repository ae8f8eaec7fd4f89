"""STENCIL_COMPILE: the compiled mask-aware packed computations (UNet and Flux) give the eager
outputs within float tolerance, new token counts reuse the compiled graphs (dynamic shapes), and a
compilation failure falls back to eager with a log line. The whole-forward compile is exercised by
ops/bench/compiled.py (minutes of inductor work on a cold cache: not for CI)."""

from __future__ import annotations

import logging

import pytest
import torch

from ops.bench.harness.models import build_flux, build_sd_unet, job_masks
from workers.compiled import BlockKernels, Compiled, check_mode
from workers.fused_projections import unfuse
from workers.maskaware.flux import MaskAwareFlux
from workers.maskaware.flux import RowGroup as FluxRowGroup
from workers.maskaware.unet import MaskAwareUNet, RowGroup


def test_compiled_packed_unet_step_equals_eager() -> None:
    """Also: the blocks share each compiled function's graphs. The capture hooks on K and V made
    each block's projections a new graph, and past dynamo's recompile limit (8: an SDXL UNet has
    70 blocks) they ran eagerly; here a function that recompiles more than once for 4 blocks of one
    width fails."""
    from torch._dynamo.utils import counters

    unet = build_sd_unet((32, 32), 8, 1, 1, 32, 0)
    g = torch.Generator().manual_seed(0)
    x, t, e = torch.randn(2, 9, 8, 8, generator=g), torch.tensor([500, 500]), torch.randn(2, 7, 32, generator=g)
    ctrl = MaskAwareUNet(unet, compile="default")
    assert len(ctrl._blocks) == 4
    compiled = ctrl.kernels
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        with ctrl.batch([RowGroup(2, "record")]) as ctx:
            unet(x, t, e)
        cache = ctx.recorded[0]
        for ratio in (0.2, 0.45):  # two token counts: the second must not build new graphs
            mask = job_masks(ctrl, ratio, 1, 8, 8, 3)[0]
            outs = []
            for kernels in (BlockKernels("off"), compiled):
                ctrl.kernels = kernels
                with ctrl.batch([RowGroup(2, "masked", token_mask=mask, cache=cache)]):
                    outs.append(unet(x, t, e, return_dict=False)[0])
            if ratio == 0.2:
                graphs = counters["stats"]["unique_graphs"]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert all(c.active for c in compiled.compiled()), "compilation fell back to eager"
    assert graphs > before, "the compiled kernels never ran"
    assert counters["stats"]["unique_graphs"] == graphs, "a new token count recompiled"
    unfuse(unet)  # the fusion no longer serves: the projections run as the (hooked) modules, eagerly
    with torch.no_grad():
        outs = []
        for kernels in (BlockKernels("off"), compiled):
            ctrl.kernels = kernels
            with ctrl.batch([RowGroup(2, "masked", token_mask=mask, cache=cache)]):
                outs.append(unet(x, t, e, return_dict=False)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs, "the unfused projections were compiled"
    ctrl.remove()


def test_compiled_packed_flux_step_equals_eager() -> None:
    from torch._dynamo.utils import counters

    model = build_flux(0, double=1, single=1, heads=2, head_dim=16)
    ctrl = MaskAwareFlux(model, compile="default")
    compiled = ctrl.kernels
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    side = 8
    hidden = torch.randn(1, side * side, model.config.in_channels, generator=g)
    kwargs = dict(hidden_states=hidden, timestep=torch.tensor([0.5]),
                  pooled_projections=torch.randn(1, model.config.pooled_projection_dim, generator=g),
                  encoder_hidden_states=torch.randn(1, 4, model.config.joint_attention_dim, generator=g),
                  txt_ids=torch.zeros(4, 3), img_ids=_image_ids(side), return_dict=False)
    if model.config.guidance_embeds:
        kwargs["guidance"] = torch.tensor([3.5])
    with torch.no_grad():
        with ctrl.batch([FluxRowGroup(1, "record")]) as ctx:
            model(**kwargs)
        cache = ctx.recorded[0]
        mask = torch.zeros(side * side, dtype=torch.bool)
        mask[10:30] = True
        outs = []
        for kernels in (type(compiled)("off"), compiled):
            ctrl.kernels = kernels
            with ctrl.batch([FluxRowGroup(1, "masked", token_mask=mask, cache=cache)]):
                outs.append(model(**kwargs)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert compiled.ff.active, "compilation fell back to eager"
    assert counters["stats"]["unique_graphs"] > before, "the compiled kernels never ran"
    ctrl.remove()


def _image_ids(side: int) -> torch.Tensor:
    from ops.bench.harness.models import flux_image_ids

    return flux_image_ids(side)


def test_a_failed_compilation_runs_eagerly_with_a_log_line(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    def broken_compile(fn, **_):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("C++ compiler not found")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    layer = torch.nn.Linear(4, 3)
    fn = Compiled(layer, "test layer", "max-autotune")
    x = torch.randn(5, 4)
    with caplog.at_level(logging.WARNING, logger="workers.compiled"):
        y = fn(x)
    assert torch.equal(y, layer(x)) and fn.failed and not fn.active
    assert "torch.compile of test layer failed (RuntimeError: C++ compiler not found); running it eagerly" \
        in caplog.text
    caplog.clear()
    fn(x)
    assert caplog.text == ""  # logged once
    assert not Compiled(layer, "off", "off").active
    with pytest.raises(ValueError, match="STENCIL_COMPILE"):
        check_mode("fast")


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_attention_output_is_divided_only_by_a_factor_other_than_one(factor: float) -> None:
    """diffusers divides attention's output by ``rescale_output_factor`` (1 in SD and SDXL): the
    packed path skips a division by 1 (it changes no bit: a kernel per block saved) and keeps any other."""
    from diffusers.models.attention_processor import Attention

    from ops.bench.harness.dispatch import DispatchCounter
    from workers.compiled import attn_out_residual

    attn = Attention(16, heads=2, dim_head=8, rescale_output_factor=factor).eval().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    o, x = (torch.randn(5, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        counter = DispatchCounter()
        with counter:
            got = attn_out_residual(attn, o, x)
        want = attn.to_out[1](attn.to_out[0](o)) / factor + x  # the stock processor's expression
    assert torch.equal(got, want)
    assert ("aten.div.Tensor" in counter.ops) == (factor != 1.0), counter.ops


def test_packed_computations_never_take_torch_compiles_own_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a mode with CUDA graphs of its own, every call of a compiled function starts a new
    graph generation and frees the previous call's outputs: the packed blocks, whose outputs feed
    the next block's compiled call, compile without them; a whole forward keeps the mode."""
    from workers.maskaware.flux import FluxKernels

    modes: dict[str, object] = {}

    def record(fn: object, **kwargs: object) -> object:  # torch.compile, noting the mode asked for
        modes[getattr(fn, "__name__", "?")] = kwargs["mode"]
        return fn

    def whole_forward(x: torch.Tensor) -> torch.Tensor:
        return x

    monkeypatch.setattr(torch, "compile", record)
    for mode, packed in (("reduce-overhead", None), ("max-autotune", "max-autotune-no-cudagraphs"), ("default", None)):
        modes.clear()
        kernels = BlockKernels(mode)
        FluxKernels(mode)
        Compiled(whole_forward, "whole forward", mode)
        assert modes.pop("whole_forward") == (None if mode == "default" else mode)
        assert {n for n in ("attn_out_residual", "cross_q", "ff_residual", "fused_linear", "norm_then_fused",
                            "_call_module")} <= set(modes), modes
        assert set(modes.values()) == {packed}, (mode, modes)
        assert all(c.active for c in kernels.compiled())
