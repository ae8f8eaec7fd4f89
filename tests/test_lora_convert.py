"""Adding adapters: the formats users have go through diffusers' own loaders into one canonical
form; everything else is refused with a reason that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from app.adapters import adapter_set, dump_adapter_set, load_adapter_set
from app.validation import InvalidParameter
from tests.support.loras import save_flux_lora, save_sd_lora
from workers.adapters.convert import InvalidAdapter, canonical_lora
from workers.adapters.lora import LoraWeights
from workers.models.loader import TRAINED_DIR

SD_DIR = TRAINED_DIR / "tiny-sd-inpaint-trained"
FLUX_DIR = TRAINED_DIR / "tiny-flux-fill-trained"
MAX = 1 << 30


@pytest.fixture(scope="module")
def sd_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(SD_DIR, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False)
    return save_sd_lora(pipe, tmp_path_factory.mktemp("sd"), rank=4, seed=5, text_encoder=True)


def _kohya(sd: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The same adapter in kohya/A1111 naming (``lora_unet_*``, ``lora_te_*``, per-module alphas)."""
    out = {}
    for k, v in sd.items():
        comp, rest = k.split(".", 1)
        sep = ".lora." if ".lora." in rest else ".lora_linear_layer."
        path, kind = rest.split(sep)
        name = ("lora_unet_" if comp == "unet" else "lora_te_") + path.replace(".", "_")
        out[f"{name}.lora_{'down' if kind.startswith('down') else 'up'}.weight"] = v
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


def test_diffusers_format_with_text_encoder(sd_file: Path) -> None:
    w = canonical_lora(sd_file.read_bytes(), SD_DIR, "x", max_bytes=MAX)
    assert set(w.components) == {"unet", "text_encoder"}
    assert len(w.modules("unet")) == 32 and len(w.modules("text_encoder")) == 8
    assert all(m.rank == 4 and m.scaling == 1.0 for m in w.modules("unet").values())
    back = LoraWeights.from_bytes(w.to_bytes())
    for comp, mods in w.components.items():
        for path, m in mods.items():
            assert torch.equal(back.modules(comp)[path].down, m.down) and back.modules(comp)[path].scaling == m.scaling


def test_kohya_format_and_its_alphas_give_the_same_adapter(sd_file: Path, tmp_path: Path) -> None:
    sd = load_file(sd_file)
    save_file(_kohya(sd, alpha=8.0), tmp_path / "k.safetensors")  # alpha 8 at rank 4: scaling 2
    ref = canonical_lora(sd_file.read_bytes(), SD_DIR, "x", max_bytes=MAX)
    kohya = canonical_lora((tmp_path / "k.safetensors").read_bytes(), SD_DIR, "y", max_bytes=MAX)
    for comp, mods in ref.components.items():
        assert kohya.modules(comp).keys() == mods.keys()
        for path, m in mods.items():
            assert kohya.modules(comp)[path].scaling == 2.0
            assert torch.allclose(2 * m.delta(1.0), kohya.modules(comp)[path].delta(1.0), atol=1e-6)


def test_flux_peft_format(tmp_path: Path) -> None:
    from diffusers import FluxFillPipeline

    f = save_flux_lora(FluxFillPipeline.from_pretrained(FLUX_DIR), tmp_path, rank=4, seed=1)
    w = canonical_lora(f.read_bytes(), FLUX_DIR, "f", max_bytes=MAX)
    assert list(w.components) == ["transformer"]
    assert "single_transformer_blocks.0.attn.to_q" in w.modules("transformer")
    assert "proj_out" in w.modules("transformer")  # the model's own output projection too


def _refused(data: bytes, match: str, model: Path = SD_DIR, max_bytes: int = MAX) -> None:
    with pytest.raises(InvalidAdapter, match=match):
        canonical_lora(data, model, "bad", max_bytes=max_bytes)


def test_refusals_name_the_problem(sd_file: Path, tmp_path: Path) -> None:
    good = load_file(sd_file)
    _refused(b"\x80\x04\x95pickle", r"the adapter is a pickle-based checkpoint \(pickle protocol 4")
    _refused(b"PK\x03\x04zip", "the adapter is a damaged zip archive, not a safetensors file")
    _refused(b"not a model at all, just text", "the adapter is a file of unknown format, not a safetensors file")
    _refused(sd_file.read_bytes(), "over STENCIL_MAX_LORA_BYTES", max_bytes=100)
    _refused(save({"foo.weight": torch.zeros(2, 2)}), "no LoRA tensors")
    # A LoRA made for another model: wrong widths.
    wide = {k: (torch.zeros(v.shape[0], v.shape[1] + 16) if "down" in k else v) for k, v in good.items()}
    _refused(save(wide), "does not fit this model")
    # Modules the model does not have.
    extra = dict(good)
    extra["unet.down_blocks.7.attentions.0.transformer_blocks.0.attn1.to_q.lora.down.weight"] = torch.zeros(4, 64)
    extra["unet.down_blocks.7.attentions.0.transformer_blocks.0.attn1.to_q.lora.up.weight"] = torch.zeros(64, 4)
    _refused(save(extra), "name layers this model does not have")
    # A Flux adapter on an SD model.
    flux = {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 128),
            "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(128, 4)}
    _refused(save(flux), "components this model does not have: transformer")
    # DoRA is not applied by the engine.
    dora = {k.replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B."): v for k, v in good.items()
            if k.startswith("unet.")}
    first = next(k for k in dora if k.endswith("lora_A.weight")).replace(".lora_A.weight", "")
    dora[f"{first}.lora_magnitude_vector"] = torch.ones(64)
    _refused(save(dora), "DoRA")


def test_job_adapter_sets_are_normalised_and_bounded() -> None:
    assert adapter_set([("b", 0.5), ("a", "0.8")], 4) == (("a", 0.8), ("b", 0.5))
    assert adapter_set("papercut:0.8; filmic", 4) == (("filmic", 1.0), ("papercut", 0.8))
    assert adapter_set('[["x", 2]]', 4) == (("x", 2.0),)
    assert load_adapter_set(dump_adapter_set((("a", 0.5),))) == (("a", 0.5),) and dump_adapter_set(()) == ""
    for bad, why in ((["a", "a"], "named twice"), ([("a", float("nan"))], "finite"), ([("a", 99)], r"\[-8, 8\]"),
                     ([("../x", 1)], "letters, digits"), (["a", "b", "c"], "at most 2"), ({"a": 1}, "list")):
        with pytest.raises(InvalidParameter, match=why):
            adapter_set(bad, 2)
