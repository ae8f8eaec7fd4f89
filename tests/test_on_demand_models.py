"""Benchmark-only trained models that the repository does not ship (ops/train/on_demand.py): the
first benchmark that needs one trains it in place with its recorded command, once; the service
refuses the id until then and names that command."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from diffusers import StableDiffusionInpaintPipeline

from app.settings import Settings
from ops.train import on_demand
from workers.models import loader

# The SDXL-layout model's recipe in miniature: the same trainer and options, a couple of steps.
TINY = "tiny-test-sdxl-layout"
RECIPES = {TINY: ("ops.train.sd", "--threads", "1", "--vae-from", "workers/models/trained/tiny-sd-inpaint-trained",
                  "--encode-crops", "32", "--unet-steps", "2", "--unet-batch", "2", "--prediction-type", "sample",
                  "--unet-channels", "32", "64", "--unet-layout", "sdxl", "--transformer-layers", "1", "2",
                  "--plot", "")}


def _card(trained: Path, model_id: str) -> Path:
    """A model folder as the repository ships it: the card, no weights."""
    folder = trained / model_id
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(f"# {model_id}\n")
    return folder


def test_a_missing_model_is_trained_once_in_place_and_the_loader_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained = tmp_path / "trained"
    folder = _card(trained, TINY)
    assert on_demand.ensure_trained(TINY, trained, RECIPES) == folder
    assert (folder / "README.md").read_text() == f"# {TINY}\n"
    assert not list(folder.glob(".train-*"))  # the temporary folder is gone
    pipe = StableDiffusionInpaintPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    assert pipe.unet.config.down_block_types[0] == "DownBlock2D"  # the recipe's layout
    assert pipe.scheduler.config.prediction_type == "sample"

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained again")

    monkeypatch.setattr(subprocess, "run", no_training)
    assert on_demand.ensure_trained(TINY, trained, RECIPES) == folder
    monkeypatch.setattr(loader, "TRAINED_DIR", trained)
    assert loader.ensure_model_dir(Settings.from_env(home=tmp_path / "home", model_dir="", model_id=TINY)) == folder


def test_a_failed_training_leaves_no_model_and_says_what_ran(tmp_path: Path) -> None:
    trained = tmp_path / "trained"
    folder = _card(trained, TINY)
    broken = {TINY: (*RECIPES[TINY], "--unet-layout", "flux")}
    with pytest.raises(RuntimeError, match=f"training {TINY} failed .*--unet-layout flux"):
        on_demand.ensure_trained(TINY, trained, broken)
    assert sorted(p.name for p in folder.iterdir()) == [".train.lock", "README.md"]


def test_models_are_trained_where_the_loader_reads_them() -> None:
    assert on_demand.TRAINED_DIR == loader.TRAINED_DIR


def test_an_id_without_a_model_or_a_recipe_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="'nope' has no training recipe"):
        on_demand.ensure_trained("nope", tmp_path, RECIPES)


def test_the_service_refuses_the_untrained_sdxl_layout_model_naming_its_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_id = "tiny-sd-sdxl-layout-trained"
    monkeypatch.setattr(loader, "TRAINED_DIR", tmp_path / "trained")
    _card(tmp_path / "trained", model_id)
    with pytest.raises(FileNotFoundError) as err:
        loader.ensure_model_dir(Settings.from_env(home=tmp_path / "home", model_dir="", model_id=model_id))
    assert on_demand.command(model_id) in str(err.value)
    assert not (tmp_path / "home" / "models" / model_id / "model_index.json").exists()
