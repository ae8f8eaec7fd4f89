"""ControlNets through the service on real processes: added (and refused) by a CPU worker, named
by jobs with their control images, resident on the GPU worker; results equal the stock
``StableDiffusionControlNetInpaintPipeline``; bad control images fail only their job."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel
from PIL import Image

from app.client import InvalidAdapter, StencilClient
from app.controls import CONTROL_WEIGHTS
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from app.settings import Settings
from tests.support.controlnets import save_controlnet
from tests.support.pipes import controlnet_call, sd_pipe
from tests.test_service import SIZE, result_array, template
from workers.models.loader import TRAINED_DIR, model_identity

pytestmark = pytest.mark.integration


_pipe = sd_pipe


@pytest.fixture(scope="module")
def net_dirs(saved_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("controlnets")
    unet = _pipe(saved_model).unet
    return {"edges": save_controlnet(unet, root / "edges", seed=3, std=0.05),
            "depth": save_controlnet(unet, root / "depth", seed=4, std=0.05)}


def control_image(seed: int, size: int = SIZE) -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = np.zeros((size, size, 3), np.uint8)
    for _ in range(8):
        y, x = rng.integers(0, size - 24, 2)
        arr[y:y + rng.integers(4, 24), x:x + 3] = 255
    return Image.fromarray(arr)


def stock(folder: Path, nets: dict[str, Path], image: Image.Image, mask: np.ndarray, controls, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    pipe, control_args = controlnet_call(folder, [nets[c[0]] for c in controls], controls)
    out = pipe(prompt=kw["prompt"], image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=kw["steps"], guidance_scale=kw["guidance"], height=SIZE, width=SIZE,
               generator=torch.Generator("cpu").manual_seed(kw["seed"]), **control_args).images[0]
    return np.asarray(out, dtype=np.int16)


def _cli(stack: EmbeddedStack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], env=stack.env(), capture_output=True, text=True,
                          timeout=300)


def test_add_list_and_refuse_controlnets(stack: EmbeddedStack, client: StencilClient, net_dirs: dict[str, Path],
                                         tmp_path: Path) -> None:
    added = _cli(stack, "controlnet", "add", str(net_dirs["edges"]), "--id", "edges")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["parameters"] > 0
    assert client.add_controlnet(net_dirs["depth"], "depth")["id"] == "depth"
    assert "edges" in _cli(stack, "controlnet", "list").stdout
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(net_dirs["edges"] / "config.json", pickled / "config.json")
    (pickled / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04\x95 pickle")
    bad = _cli(stack, "controlnet", "add", str(pickled), "--id", "pickled")
    assert bad.returncode == 2 and "pickle-based .bin weights are refused" in bad.stderr
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((net_dirs["edges"] / "config.json").read_text())
    config["block_out_channels"] = [c * 2 for c in config["block_out_channels"]]
    (wide / "config.json").write_text(json.dumps(config))
    shutil.copy(net_dirs["edges"] / "diffusion_pytorch_model.safetensors", wide)
    with pytest.raises(InvalidAdapter, match="its residuals would not fit"):
        client.add_controlnet(wide, "wide")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(net_dirs["edges"] / "config.json", corrupt)
    (corrupt / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(InvalidAdapter, match="not a safetensors file"):
        client.add_controlnet(corrupt, "corrupt")
    assert {m["id"] for m in client.list_controlnets()} == {"edges", "depth"}


def test_jobs_with_controlnets_equal_stock_and_bad_controls_fail_alone(
        stack: EmbeddedStack, client: StencilClient, net_dirs: dict[str, Path], saved_model: Path) -> None:
    for cid, d in net_dirs.items():
        client.add_controlnet(d, cid)
    image, mask = template(60), make_mask(0.3, (SIZE, SIZE), "blob", seed=60)
    params = dict(prompt="a cat", steps=8, guidance=7.5, seed=3)
    one = [("edges", control_image(1), 0.9)]
    two = [("edges", control_image(2), 1.0), ("depth", control_image(3), 0.6)]
    good = [client.submit(template=image, mask=mask, controls=one, **params),
            client.submit(template=image, mask=mask, controls=two, **params)]
    buf = io.BytesIO()
    control_image(4).save(buf, format="PNG")
    bad = {
        "wrong size": client.submit(template=image, mask=mask, steps=4,
                                    controls=[("edges", control_image(5, size=64), 1.0)]),
        "corrupt": client.submit(template=image, mask=mask, steps=4,
                                 controls=[("edges", buf.getvalue()[:40], 1.0)]),
        "unknown id": client.submit(template=image, mask=mask, steps=4,
                                    controls=[("no-such-net", control_image(6), 1.0)]),
    }
    expected = {"wrong size": "control image 0 size 64x64 does not match image size 128x128",
                "corrupt": "control image 0", "unknown id": "unknown ControlNet(s): no-such-net"}
    for what, handle in bad.items():
        rec = handle.wait(120)
        assert rec.status == JobStatus.FAILED and expected[what] in (rec.error or ""), (what, rec.error)
    recs = [h.wait(300) for h in good]
    assert all(r.status == JobStatus.DONE for r in recs), [r.error for r in recs]
    for handle, controls in zip(good, (one, two)):
        diff = np.abs(result_array(handle) - stock(saved_model, net_dirs, image, mask, controls, **params))
        assert diff.max() <= 1, f"{[c[0] for c in controls]}: max pixel diff {diff.max()} vs the stock pipeline"
    state = client.redis.hgetall("stencil:worker:0")
    assert set(json.loads(state[b"controlnets"])) == {"edges", "depth"}


DEFAULT_MODEL = next(f.default for f in dataclasses.fields(Settings) if f.name == "model_id")


@pytest.fixture(scope="module")
def default_model_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """A stack serving the service's default model (the trained one the repository ships, read in
    place), which the other tests here replace with the random-init embedded one."""
    workdir = tmp_path_factory.mktemp("default-model-stack")
    with EmbeddedStack.start(workdir, home=workdir / "home", model_id=DEFAULT_MODEL, model_dir="", model_file="",
                             max_batch=2, max_image_pixels=200_000) as s:
        yield s


def test_controlnet_whose_header_length_ends_in_0x80_registers_and_serves(
        default_model_stack: EmbeddedStack, tmp_path: Path) -> None:
    """Issue 38, as a user meets it: ``ControlNetModel.from_unet`` of the default model's UNet (with
    the 4 latent input channels the ControlNet inpainting pipeline feeds it: ``make_controlnet``),
    saved unchanged by ``save_pretrained``. Nothing is padded or chosen: that model's ControlNet has
    a 14,208-byte (0x3780) safetensors header, so its file begins with 0x80, the byte that was
    taken for a pickle's protocol marker and refused."""
    model = TRAINED_DIR / DEFAULT_MODEL
    folder = save_controlnet(UNet2DConditionModel.from_pretrained(model / "unet"), tmp_path / "edges", seed=3,
                             std=0.05)
    weights = (folder / CONTROL_WEIGHTS).read_bytes()
    assert int.from_bytes(weights[:8], "little") == 0x3780 and weights[:1] == b"\x80"
    added = _cli(default_model_stack, "controlnet", "add", str(folder), "--id", "edges")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["model_id"] == model_identity(model)  # the served model's weights
    client = StencilClient(default_model_stack.settings)
    image, mask = template(61), make_mask(0.3, (SIZE, SIZE), "blob", seed=61)
    params = dict(prompt="a cat", steps=8, guidance=7.5, seed=5)
    controls = [("edges", control_image(7), 0.9)]
    handle = client.submit(template=image, mask=mask, controls=controls, **params)
    rec = handle.wait(300)
    assert rec.status == JobStatus.DONE, rec.error
    diff = np.abs(result_array(handle) - stock(model, {"edges": folder}, image, mask, controls, **params))
    assert diff.max() <= 1, f"max pixel diff {diff.max()} vs the stock pipeline"
