"""Single-file checkpoints: an original-layout ``.safetensors`` loads (``from_single_file``, offline,
configs from a local folder) to exactly the weights it was made from; pickle-based files are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.settings import Settings
from tests.support.ldm_layout import sd_folder_to_ldm
from workers.models.loader import ensure_model_dir, model_identity
from workers.models.tiny_sd import save_pipeline


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline(tmp_path_factory.mktemp("sd") / "tiny", seed=5)


@pytest.fixture(scope="module")
def single_file(sd_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny-inpaint.safetensors"
    save_file(sd_folder_to_ldm(sd_folder), str(path))
    return path


def _weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    files = sorted((folder / name).glob("*.safetensors"))
    assert files, folder / name
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def test_original_layout_file_has_no_diffusers_names(single_file: Path) -> None:
    keys = load_file(str(single_file)).keys()
    assert any(k.startswith("model.diffusion_model.input_blocks.") for k in keys)
    assert any(k.startswith("first_stage_model.encoder.down.") for k in keys)
    assert not any("down_blocks" in k or "resnets" in k for k in keys)


@pytest.mark.parametrize("how", ["model_file", "model_dir"])
def test_single_file_loads_to_identical_weights(how: str, sd_folder: Path, single_file: Path, tmp_path: Path) -> None:
    if how == "model_file":   # configs from the folder named by STENCIL_MODEL_DIR
        settings = Settings(home=tmp_path, model_file=str(single_file), model_dir=str(sd_folder))
    else:                     # STENCIL_MODEL_DIR names the file; configs from the embedded model id
        settings = Settings(home=tmp_path, model_dir=str(single_file), model_id="tiny-sd-inpaint")
    path = ensure_model_dir(settings)
    assert path.parent == tmp_path / "models" and path != sd_folder
    for name in ("unet", "vae", "text_encoder"):
        got, want = _weights(path, name), _weights(sd_folder, name)
        assert got.keys() == want.keys(), name
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)
    assert ensure_model_dir(settings) == path   # converted once
    assert model_identity(path).endswith(model_identity(sd_folder).split("-")[-1])


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_pickle_based_checkpoints_are_refused(suffix: str, tmp_path: Path) -> None:
    bad = tmp_path / f"model{suffix}"
    bad.write_bytes(b"\x80\x04not loaded")
    for settings in (Settings(home=tmp_path, model_file=str(bad)), Settings(home=tmp_path, model_dir=str(bad))):
        with pytest.raises(ValueError, match=f"refusing model file {bad}"):
            ensure_model_dir(settings)
    assert not (tmp_path / "models").exists()


@pytest.mark.slow
def test_flux_single_file_loads_to_identical_transformer_weights(tmp_path: Path) -> None:
    """diffusers' Flux converter assumes Flux's width (inner dim 3072, MLP 12288), so this one needs a
    full-width transformer (1 double + 1 single block, bfloat16, about 1 GB): slow, run under the
    heavy lock. Its other components come from the config folder (the tiny Flux Fill pipeline)."""
    import dataclasses
    import json

    from tests.support.ldm_layout import flux_to_original
    from workers.models.tiny_flux import save_flux_fill_pipeline
    from workers.models.true_size import FLUX_FILL_TRANSFORMER, Component, build_module

    folder = save_flux_fill_pipeline(tmp_path / "flux")
    cfg = dict(FLUX_FILL_TRANSFORMER, num_layers=1, num_single_layers=1, joint_attention_dim=32,
               pooled_projection_dim=32)
    model = build_module(Component("diffusers", "FluxTransformer2DModel", cfg), torch.bfloat16, seed=2)
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = tmp_path / "flux1-fill-tiny.safetensors"
    save_file(flux_to_original(want), str(ckpt))
    del model
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "FluxFillPipeline"
    settings = Settings(home=tmp_path / "home", model_file=str(ckpt), model_dir=str(folder))
    path = ensure_model_dir(dataclasses.replace(settings))
    got = _weights(path, "transformer")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].to(torch.bfloat16), want[k]), k
    assert _weights(path, "vae").keys() == _weights(folder, "vae").keys()
