"""The stock baseline worker runs its pipeline where STENCIL_DEVICE says, as a user runs the stock
pipeline on the card (on a GPU host it would otherwise compare Stencil on the GPU with stock on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings
from workers.models.loader import DeviceUnavailable


def test_the_stock_pipeline_is_placed_on_stencil_device(model_home: Path) -> None:
    from workers.stock_worker import StockWorker

    worker = StockWorker(Settings(home=model_home, device="cpu"), "0")
    assert {p.device.type for p in worker.pipe.unet.parameters()} == {"cpu"}
    with pytest.raises(DeviceUnavailable, match="STENCIL_DEVICE='cuda:7'"):
        StockWorker(Settings(home=model_home, device="cuda:7"), "0")  # a device this host lacks: refused
