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


def test_the_stock_worker_runs_the_pipeline_its_model_folder_names(tmp_path: Path, model_home: Path) -> None:
    from workers.models.loader import save_embedded
    from workers.stock_worker import StockWorker

    sdxl = save_embedded("tiny-sdxl-inpaint", tmp_path / "sdxl")
    worker = StockWorker(Settings(home=model_home, model_dir=str(sdxl), device="cpu"), "0")
    assert type(worker.pipe).__name__ == "StableDiffusionXLInpaintPipeline"
    flux = save_embedded("tiny-flux-fill", tmp_path / "flux")
    with pytest.raises(ValueError, match="is a FluxFillPipeline"):
        StockWorker(Settings(home=model_home, model_dir=str(flux), device="cpu"), "0")


def test_stencil_compile_compiles_the_stock_unet_as_a_user_does(model_home: Path) -> None:
    """``pipe.unet = torch.compile(pipe.unet)`` (compiled at the first batch); the eager UNet kept
    for the fallback."""
    from workers.stock_worker import StockWorker

    worker = StockWorker(Settings(home=model_home, device="cpu", compile="default"), "0")
    assert worker.pipe.unet is not worker.eager_unet
    assert worker.pipe.unet._orig_mod is worker.eager_unet
    assert StockWorker(Settings(home=model_home, device="cpu"), "0").pipe.unet.__class__.__name__ == \
        "UNet2DConditionModel"
