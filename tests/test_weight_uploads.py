"""Every path that receives weights (LoRA adapters, ControlNets, single-file checkpoints) takes a
file for safetensors when its header parses (``workers/weights_format.py``), whatever its first
byte: a valid file whose header length ends in 0x80 begins like a pickle and was refused as one
(issue 38). Files that are not safetensors are refused with a reason that names the file, says
what it is and what to upload instead, and nothing is unpickled."""

from __future__ import annotations

import io
import json
import pickle
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import StableDiffusionInpaintPipeline, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from app.controls import CONTROL_WEIGHTS
from app.settings import Settings
from ops.bench.harness.addons import lora_state
from workers.adapters.convert import InvalidAdapter, canonical_lora
from workers.controlnets.registry import InvalidControlNet, check_controlnet
from workers.models.loader import TRAINED_DIR, ensure_model_dir

SD_DIR = TRAINED_DIR / "tiny-sd-inpaint-trained"  # the service's default model
CONTROLNET_DIR = TRAINED_DIR / "tiny-sd-controlnet-canny"  # the ControlNet shipped for it
MAX = 1 << 30


def _header_len(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def every_header_low_byte(tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                          path: Path) -> Iterator[tuple[int, bytes]]:
    """``tensors`` as ``save_file`` writes them, with ``metadata`` and a "pad" entry padded so the
    header length ends in each byte value, 0 to 255. ``save_file`` pads every header with spaces to
    a multiple of 8 (safetensors' alignment), so the metadata padding alone reaches the low bytes
    that are multiples of 8; the other 7 in 8 are that file with 1-7 more of the same trailing
    spaces. Each file is checked to load with safetensors' own reader, to the same tensors."""
    save_file(tensors, str(path), metadata={**metadata, "pad": ""})
    raw = path.read_bytes()
    bare = len(raw[8:8 + _header_len(raw)].rstrip(b" "))   # the header's JSON with "pad" empty
    written = -1
    for low_byte in range(256):
        want = bare + 8 + (low_byte - bare - 8) % 256      # the shortest length >= bare + 8 ending in low_byte
        aligned = want - want % 8                          # save_file writes JSON of exactly this length
        if aligned != written:
            save_file(tensors, str(path), metadata={**metadata, "pad": "x" * (aligned - bare)})
            raw, written = path.read_bytes(), aligned
            assert _header_len(raw) == aligned
        data = want.to_bytes(8, "little") + raw[8:8 + aligned] + b" " * (want - aligned) + raw[8 + aligned:]
        assert data[0] == low_byte
        back = load(data)
        assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
        yield low_byte, data


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as fh:
        return dict(fh.metadata() or {})


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real adapter for the default model (one attention projection at rank 1), written by
    diffusers' ``save_lora_weights``."""
    unet = UNet2DConditionModel.from_pretrained(SD_DIR / "unet")
    out = tmp_path_factory.mktemp("lora")
    state = lora_state(unet, rank=1, seed=7, targets=["mid_block.attentions.0.transformer_blocks.0.attn1.to_q"])
    StableDiffusionInpaintPipeline.save_lora_weights(out, unet_lora_layers=state)
    return out / "pytorch_lora_weights.safetensors"


def _accept_lora(data: bytes) -> None:
    weights = canonical_lora(data, SD_DIR, "padded", max_bytes=MAX)
    assert weights.describe()["components"]["unet"]["modules"] == 1


def _accept_controlnet(data: bytes) -> None:
    config = json.loads((CONTROLNET_DIR / "config.json").read_text())
    unet_config = json.loads((SD_DIR / "unet" / "config.json").read_text())
    assert check_controlnet(config, data, unet_config, latent_channels=4) > 0


@pytest.mark.parametrize("path", ["lora", "controlnet"])
def test_every_header_length_low_byte_is_accepted(path: str, lora_file: Path, tmp_path: Path) -> None:
    """256 files, the header length ending in each byte value, through the function the receiving
    task calls (``canonical_lora`` / ``check_controlnet``); before the fix the 0x80 one was refused
    as a pickle."""
    source, accept = {"lora": (lora_file, _accept_lora),
                      "controlnet": (CONTROLNET_DIR / CONTROL_WEIGHTS, _accept_controlnet)}[path]
    files = every_header_low_byte(load_file(str(source)), _metadata(source), tmp_path / "padded.safetensors")
    refused, seen = {}, set()
    for low_byte, data in files:
        seen.add(low_byte)
        try:
            accept(data)
        except ValueError as exc:
            refused[f"{_header_len(data):#x}"] = str(exc)
    assert seen == set(range(256)) and not refused, refused


class Trap:
    """Unpickling this creates ``path``: a refusal that unpickled anything would leave it behind."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _torch_save(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def _not_safetensors(valid: bytes, trap: Path) -> dict[str, tuple[bytes, str]]:
    """Files that are not safetensors, each with what its refusal must say it is."""
    state = {**load(valid), "trap": Trap(trap)}
    garbage = random.Random(0).randbytes(4096)
    n = _header_len(valid)
    return {
        "pickle": (_torch_save(state, _use_new_zipfile_serialization=False),
                   "is a pickle-based checkpoint (legacy torch.save format: loading it can run code), "
                   "not a safetensors file: "),
        "zip": (_torch_save(state), "is a pickle-based checkpoint (zip-based torch.save format, a pickle inside: "
                                    "loading it can run code), not a safetensors file: "),
        "cut in the length": (valid[:5], "is a file of unknown format, not a safetensors file: "),
        "cut in the header": (valid[:8 + n // 2], f"is a truncated safetensors file (its header is {n} bytes, "
                                                  f"the file has {n // 2} after the length): "),
        "cut in the tensors": (valid[:-3], "is a truncated safetensors file (its tensors take "),
        "garbage": (garbage, "is a file of unknown format, not a safetensors file: "),
    }


def test_lora_path_refuses_what_is_not_safetensors_saying_what_it_is(lora_file: Path, tmp_path: Path) -> None:
    trap = tmp_path / "unpickled"
    for what, (data, reason) in _not_safetensors(lora_file.read_bytes(), trap).items():
        with pytest.raises(InvalidAdapter) as info:
            canonical_lora(data, SD_DIR, "bad", max_bytes=MAX)
        assert str(info.value).startswith(f"the adapter {reason}"), (what, str(info.value))
        assert "upload it as .safetensors" in str(info.value), what
    assert not trap.exists()


def test_controlnet_path_refuses_what_is_not_safetensors_saying_what_it_is(tmp_path: Path) -> None:
    trap = tmp_path / "unpickled"
    config = json.loads((CONTROLNET_DIR / "config.json").read_text())
    unet_config = json.loads((SD_DIR / "unet" / "config.json").read_text())
    for what, (data, reason) in _not_safetensors((CONTROLNET_DIR / CONTROL_WEIGHTS).read_bytes(), trap).items():
        with pytest.raises(InvalidControlNet) as info:
            check_controlnet(config, data, unet_config, latent_channels=4)
        assert str(info.value).startswith(f"{CONTROL_WEIGHTS} {reason}"), (what, str(info.value))
        assert f"upload {CONTROL_WEIGHTS} as ControlNetModel.save_pretrained writes it" in str(info.value), what
    assert not trap.exists()


def test_single_file_checkpoint_is_checked_by_its_contents(tmp_path: Path) -> None:
    """A pickle named ``.safetensors`` is refused for what it is (before, diffusers was left to fail
    on it); a safetensors file named ``.ckpt`` is refused with the rename that makes it load."""
    trap = tmp_path / "unpickled"
    pickled = tmp_path / "model.safetensors"
    pickled.write_bytes(_torch_save({"w": torch.zeros(2), "trap": Trap(trap)}))
    renamed = tmp_path / "model.ckpt"
    save_file({"w": torch.zeros(2)}, str(renamed))
    for path, reason in ((pickled, "it is a pickle-based checkpoint (zip-based torch.save format"),
                         (renamed, "it is safetensors but named '.ckpt'")):
        for settings in (Settings(home=tmp_path, model_file=str(path)), Settings(home=tmp_path, model_dir=str(path))):
            with pytest.raises(ValueError, match=re.escape(f"refusing model file {path}: {reason}")):
                ensure_model_dir(settings)
    assert not trap.exists() and not (tmp_path / "models").exists()


def test_the_trap_fires_when_unpickled(tmp_path: Path) -> None:
    """The refusal tests' ``Trap`` (a test-made pickle) does leave its file when it is unpickled."""
    pickle.loads(pickle.dumps(Trap(tmp_path / "unpickled"))).close()
    assert (tmp_path / "unpickled").exists()
