"""True-size architectures: the configs give the published parameter counts (meta device, no
memory), and the chunked writer produces folders the libraries load, equal to the in-memory build.

The save/load checks run on shrunk copies of the same specs (same classes, same code path, small
widths) so they take seconds; the true-size saves are measured in docs/bench/true_size.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.models import true_size
from workers.models.true_size import build_module, n_params, save_true_size, shrunk

# Published parameter counts of the public checkpoints (the 9-channel inpainting conv_in adds
# 5 x 320 x 9 = 14,400 to SD 1.5's 859,520,964 and SDXL's 2,567,463,684; Fill's 384-channel
# x_embedder adds 320 x 3072 = 983,040 to FLUX.1-dev's 11,901,408,320).
PUBLISHED = {
    ("sd15-inpaint", "unet"): 859_520_964 + 14_400,
    ("sd15-inpaint", "vae"): 83_653_863,
    ("sd15-inpaint", "text_encoder"): 123_060_480,   # CLIP ViT-L/14 text tower
    ("sdxl-inpaint", "unet"): 2_567_463_684 + 14_400,
    ("sdxl-inpaint", "text_encoder_2"): 694_659_840,  # OpenCLIP bigG text tower + projection
    ("flux-fill", "transformer"): 11_901_408_320 + 983_040,
    ("flux-fill", "text_encoder_2"): 4_762_310_656,   # T5-v1.1-XXL encoder
}


@pytest.mark.parametrize(("model_id", "component"), sorted(PUBLISHED))
def test_configs_have_the_published_parameter_counts(model_id: str, component: str) -> None:
    assert n_params(model_id, component) == PUBLISHED[(model_id, component)]


def test_flux_subset_is_full_width_with_2_double_and_4_single_blocks() -> None:
    full = true_size.spec("flux-fill").components["transformer"].config
    sub = true_size.spec("flux-fill-subset").components["transformer"].config
    assert {k: v for k, v in sub.items() if k not in ("num_layers", "num_single_layers")} == \
        {k: v for k, v in full.items() if k not in ("num_layers", "num_single_layers")}
    assert (sub["num_layers"], sub["num_single_layers"]) == (2, 4)
    assert (full["num_layers"], full["num_single_layers"]) == (19, 38)


@pytest.mark.parametrize("model_id", ["sd15-inpaint", "sdxl-inpaint", "flux-fill-subset"])
def test_saved_folder_loads_with_from_pretrained_and_equals_the_in_memory_build(
        model_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers

    small = shrunk(model_id)
    monkeypatch.setitem(true_size.TRUE_SIZE_MODELS, model_id, small)
    monkeypatch.setattr(true_size, "CHUNK_BYTES", 4096)     # many chunks
    monkeypatch.setattr(true_size, "SHARD_BYTES", 64 << 10)  # several shards + an index per component
    out = save_true_size(model_id, tmp_path / model_id, seed=3, dtype="bfloat16")
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == small.pipeline
    assert any((out / small.denoiser).glob("*.safetensors.index.json"))
    pipe = getattr(diffusers, small.pipeline).from_pretrained(out, torch_dtype=torch.bfloat16)
    for k, (name, comp) in enumerate(small.components.items()):
        loaded = getattr(pipe, name).state_dict()
        built = build_module(comp, torch.bfloat16, seed=3 + k).state_dict()
        assert loaded.keys() == built.keys(), name
        for key in built:
            assert torch.equal(loaded[key], built[key]), (name, key)
        assert all(v.dtype == torch.bfloat16 for v in loaded.values() if v.is_floating_point()), name


def test_random_init_is_not_degenerate() -> None:
    """Weights are drawn (not zeros/empty memory): layer weights differ and are finite."""
    comp = shrunk("sd15-inpaint").components["unet"]
    unet = build_module(comp, torch.float32, seed=0)
    w = unet.conv_in.weight
    assert torch.isfinite(w).all() and w.std() > 0
    assert not torch.equal(build_module(comp, torch.float32, seed=1).conv_in.weight, w)
    assert torch.equal(build_module(comp, torch.float32, seed=0).conv_in.weight, w)


def test_unknown_model_and_tiny_dtype_are_refused(tmp_path: Path) -> None:
    from workers.models.loader import save_embedded

    with pytest.raises(ValueError, match="sd15-inpaint"):
        save_embedded("sd99", tmp_path / "x")
    with pytest.raises(ValueError, match="float32 only"):
        save_embedded("tiny-sd-inpaint", tmp_path / "y", dtype="bfloat16")


def test_cli_model_save_writes_a_true_size_id_in_the_requested_dtype(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``stencil model save DIR --model sdxl-inpaint --dtype float16`` (shrunk widths: same code path)."""
    import diffusers

    from app.cli import main

    monkeypatch.setitem(true_size.TRUE_SIZE_MODELS, "sdxl-inpaint", shrunk("sdxl-inpaint"))
    assert main(["model", "save", str(tmp_path / "m"), "--model", "sdxl-inpaint", "--dtype", "float16"]) == 0
    from safetensors.torch import load_file

    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        for f in (tmp_path / "m" / name).glob("*.safetensors"):
            assert {v.dtype for v in load_file(str(f)).values()} == {torch.float16}, f
    pipe = diffusers.StableDiffusionXLInpaintPipeline.from_pretrained(tmp_path / "m", torch_dtype=torch.float16)
    assert pipe.unet.config.addition_embed_type == "text_time"


def test_config_folder_has_the_public_configs_and_no_weights(tmp_path: Path) -> None:
    """What ``from_single_file(config=...)`` reads for a true-size id: configs, tokenizers, scheduler."""
    import diffusers
    import transformers

    out = true_size.save_config_folder("sdxl-inpaint", tmp_path / "cfg")
    assert not list(out.rglob("*.safetensors"))
    index = json.loads((out / "model_index.json").read_text())
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    unet = diffusers.UNet2DConditionModel.load_config(out, subfolder="unet")
    for k, v in true_size.SDXL_UNET.items():
        assert unet[k] == (list(v) if isinstance(v, tuple) else v), k
    te2 = transformers.CLIPTextConfig.from_pretrained(out / "text_encoder_2")
    assert (te2.hidden_size, te2.num_hidden_layers, te2.projection_dim) == (1280, 32, 1280)
    assert transformers.CLIPTokenizer.from_pretrained(out / "tokenizer_2")("a cat").input_ids[0] == 512
