"""Fused projections (``workers/fused_projections.py``): one GEMM for the projections of one input,
over the modules' own weights made views of one tensor, and the stock path wherever that would not
compute what the modules do."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ops.bench.harness.dispatch import DispatchCounter
from tests.test_maskaware_unet import sdxl_style_unet
from workers.adapters import layout
from workers.fused_projections import fuse, project
from workers.maskaware import MaskAwareUNet


def _linears(bias: bool = False) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(16, 8, bias=bias), torch.nn.Linear(16, 8, bias=bias),
                                torch.nn.Linear(16, 24, bias=bias)])


def _gemms(linears: torch.nn.ModuleList, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    counter = DispatchCounter()
    with torch.no_grad(), counter:
        out = list(project(list(linears), x))
    return sum(v for k, v in counter.ops.items() if k in ("aten.mm.default", "aten.addmm.default")), out


def _storages(linears: torch.nn.ModuleList) -> set[int]:
    return {m.weight.untyped_storage().data_ptr() for m in linears}


@pytest.mark.parametrize("bias", [False, True])
def test_one_gemm_over_the_modules_own_weights_computes_what_each_module_does(bias: bool) -> None:
    lin = _linears(bias)
    x = torch.randn(5, 16)
    with torch.no_grad():
        alone = [m(x) for m in lin]
        assert fuse(list(lin)) is not None
        assert len(_storages(lin)) == 1  # views of one weight: no copy kept
        assert all(torch.equal(m(x), a) for m, a in zip(lin, alone))  # the stock forward is unchanged
    gemms, fused = _gemms(lin, x)
    assert gemms == 1
    assert all(torch.allclose(f, a, rtol=1e-5, atol=1e-6) for f, a in zip(fused, alone))
    with torch.no_grad():  # changed in place (an adapter merged in place): the fused GEMM sees it
        lin[1].weight.mul_(2)
        changed = lin[1](x)
    assert not torch.allclose(changed, alone[1])
    assert torch.allclose(_gemms(lin, x)[1][1], changed, rtol=1e-5, atol=1e-6)


def test_weights_pointed_elsewhere_take_the_stock_path_until_they_come_back() -> None:
    """A merged adapter set is swapped in by pointing a weight at another tensor on the same device:
    each module then computes on its own, and the fusion serves again once the weight is back."""
    lin = _linears()
    x = torch.randn(5, 16)
    fuse(list(lin))
    base = lin[0].weight.data
    merged = base + 1.0
    lin[0].weight.data = merged
    gemms, out = _gemms(lin, x)
    assert gemms == 3 and torch.allclose(out[0], x @ merged.t())
    assert lin[0].weight.data_ptr() == merged.data_ptr()  # not fused anew (that would copy the weights)
    lin[0].weight.data = base
    assert _gemms(lin, x)[0] == 1


def test_a_model_moved_or_cast_computes_each_projection_until_fused_again() -> None:
    """A step never points parameters at new memory (a CUDA graph captured before could read what
    that freed): moved or cast after ``fuse``, the modules compute on their own, correctly."""
    lin = _linears()
    fuse(list(lin))
    lin.to(torch.float64)
    assert len(_storages(lin)) == 3  # ``to`` gave each parameter its own tensor
    x = torch.randn(5, 16, dtype=torch.float64)
    gemms, out = _gemms(lin, x)
    assert gemms == 3 and len(_storages(lin)) == 3
    assert all(torch.equal(o, m(x)) for o, m in zip(out, lin))
    fuse(list(lin))
    gemms, out = _gemms(lin, x)
    assert gemms == 1 and len(_storages(lin)) == 1
    assert all(torch.allclose(o, m(x)) for o, m in zip(out, lin))


def test_modules_with_their_own_forward_or_a_per_job_step_take_the_stock_path() -> None:
    lin = _linears()
    x = torch.randn(5, 16)
    fuse(list(lin))
    handle = lin[2].register_forward_hook(lambda mod, args, out: out * 0)
    gemms, out = _gemms(lin, x)
    assert gemms == 3 and torch.equal(out[2], torch.zeros_like(out[2]))  # the hook ran
    handle.remove()
    layout.set_wanted(True)  # some job of the step has adapter terms
    try:
        assert _gemms(lin, x)[0] == 3
    finally:
        layout.set_wanted(False)
    assert _gemms(lin, x)[0] == 1


def test_the_controller_fuses_a_blocks_projections_and_removing_it_restores_the_stock_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Installed, a block's Q/K/V weights share one tensor, and the model still saves as it was
    (the views do not overlap); removed, every parameter owns its memory again."""
    unet = sdxl_style_unet(0)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    a1 = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock").attn1
    qkv = torch.nn.ModuleList([a1.to_q, a1.to_k, a1.to_v])
    ctrl = MaskAwareUNet(unet)
    assert len(_storages(qkv)) == 1
    save_file(unet.state_dict(), str(tmp_path / "fused.safetensors"))
    saved = load_file(str(tmp_path / "fused.safetensors"))
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)
    ctrl.remove()
    assert len(_storages(qkv)) == 3
    assert all(torch.equal(v, before[k]) for k, v in unet.state_dict().items())
