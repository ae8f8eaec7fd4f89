"""The mask-aware Flux path's RoPE on ``[S, H, hd]`` equals diffusers' ``apply_rotary_emb`` bit for bit.

Why: in half precision the mask-aware blocks must round as the stock forward does (the pictures are
compared with the stock pipeline's at 1/255), so ``workers.maskaware.flux._rope`` repeats diffusers'
arithmetic without its batch axis rather than calling it (fewer operators per block).
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from workers.maskaware.flux import _rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_on_tokens_heads_channels_equals_diffusers(dtype: torch.dtype, tokens: int) -> None:
    grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(8.0), indexing="ij")
    ids = torch.cat([torch.zeros(5, 3), torch.stack(grid, -1).reshape(-1, 3)])  # 5 text tokens, a 4 x 8 image
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)  # Flux's tables: [S, 16], float32
    pos = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(1))[:tokens]
    cos, sin = cos[pos], sin[pos]
    x = torch.randn(tokens, 3, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    stock = apply_rotary_emb(x[None], (cos, sin), sequence_dim=1)[0]
    ours = _rope(x, cos[:, None], sin[:, None])
    assert ours.dtype == stock.dtype == dtype and ours.shape == stock.shape == x.shape
    assert torch.equal(ours, stock)


def test_rope_of_no_tokens_is_empty() -> None:
    """A row that computes no token (diffusers' function cannot reshape an empty tensor)."""
    x = torch.zeros(0, 3, 16, dtype=torch.bfloat16)
    assert _rope(x, torch.zeros(0, 1, 16), torch.zeros(0, 1, 16)).shape == (0, 3, 16)
