"""STENCIL_DTYPE: accepted values, a clear error for anything else, and half-precision tensors
crossing process boundaries (safetensors) unchanged."""

from __future__ import annotations

import pytest
import torch

from app.settings import DTYPES, Settings
from workers.models.loader import torch_dtype
from workers.tensors import pack, unpack


def test_dtype_names_map_to_torch_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().dtype == "float32"
    for name in DTYPES:
        monkeypatch.setenv("STENCIL_DTYPE", name)
        assert torch_dtype(Settings.from_env().dtype) == getattr(torch, name)


@pytest.mark.parametrize("bad", ["float64", "fp16", "bf16", ""])
def test_a_bad_dtype_fails_at_start_with_the_reason(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("STENCIL_DTYPE", bad)
    with pytest.raises(ValueError, match="STENCIL_DTYPE must be one of float32, float16, bfloat16"):
        Settings.from_env()
    with pytest.raises(ValueError, match="STENCIL_DTYPE"):
        torch_dtype(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_precision_tensors_round_trip_bit_exactly(dtype: torch.dtype) -> None:
    t = (torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    out, meta = unpack(pack({"latents": t, "state": torch.arange(5, dtype=torch.uint8)}, {"a": 1}))
    assert out["latents"].dtype == dtype and torch.equal(out["latents"], t) and meta == {"a": 1}
