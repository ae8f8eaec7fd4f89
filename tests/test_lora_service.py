"""LoRA adapters through the service on real processes: added (and refused) by a CPU worker,
named by jobs, applied by the GPU worker's engine; results equal diffusers' LoRA path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.client import InvalidAdapter, StencilClient
from app.embedded import EmbeddedStack
from app.jobs import JobStatus
from app.maskgen import make_mask
from tests.support.loras import save_sd_lora
from tests.support.pipes import sd_pipe
from tests.test_service import SIZE, result_array, template

pytestmark = pytest.mark.integration


_pipe = sd_pipe


@pytest.fixture(scope="module")
def lora_files(saved_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    pipe = _pipe(saved_model)
    return {"style-a": save_sd_lora(pipe, root / "a", rank=4, seed=11, std=0.1),
            "style-b": save_sd_lora(pipe, root / "b", rank=8, seed=12, text_encoder=True, std=0.1)}


def stock(folder: Path, files: dict[str, Path], image: Image.Image, mask: np.ndarray, loras, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    pipe = _pipe(folder)
    if loras:
        for lora_id, _ in loras:
            pipe.load_lora_weights(str(files[lora_id].parent), adapter_name=lora_id)
        pipe.set_adapters([i for i, _ in loras], [s for _, s in loras])
    out = pipe(prompt=kw["prompt"], image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=kw["steps"], guidance_scale=kw["guidance"], height=SIZE, width=SIZE,
               generator=torch.Generator("cpu").manual_seed(kw["seed"])).images[0]
    return np.asarray(out, dtype=np.int16)


def test_add_list_and_refuse_adapters(stack: EmbeddedStack, client: StencilClient, lora_files: dict[str, Path],
                                      tmp_path: Path) -> None:
    meta = client.add_lora(lora_files["style-a"], "style-a")
    assert meta["components"]["unet"]["ranks"] == [4]
    assert client.add_lora(lora_files["style-a"].read_bytes(), "style-a")["id"] == "style-a"  # same bytes: same
    cli = subprocess.run([sys.executable, "-m", "app.cli", "lora", "add", str(lora_files["style-b"]),
                          "--id", "style-b"], env=stack.env(), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert set(json.loads(cli.stdout)["components"]) == {"unet", "text_encoder"}
    listed = subprocess.run([sys.executable, "-m", "app.cli", "lora", "list"], env=stack.env(),
                            capture_output=True, text=True, timeout=120)
    assert "style-a" in listed.stdout and "style-b" in listed.stdout
    with pytest.raises(InvalidAdapter, match="pickle-based"):
        client.add_lora(b"\x80\x04\x95" + b"x" * 100, "evil")
    from safetensors.torch import load_file, save_file

    saved = tmp_path / "style.bin"   # the same adapter as torch.save writes it
    torch.save(load_file(lora_files["style-a"]), saved)
    pt = subprocess.run([sys.executable, "-m", "app.cli", "lora", "add", str(saved), "--id", "pt"],
                        env=stack.env(), capture_output=True, text=True, timeout=300)
    assert pt.returncode == 2 and "adapter 'pt' (style.bin) refused: the adapter is a pickle-based checkpoint " \
        "(zip-based torch.save format" in pt.stderr and "upload it as .safetensors" in pt.stderr, pt.stderr
    wide = tmp_path / "wide.safetensors"

    save_file({k: (torch.zeros(v.shape[0], v.shape[1] + 8) if "down" in k else v)
               for k, v in load_file(lora_files["style-a"]).items()}, wide)
    bad = subprocess.run([sys.executable, "-m", "app.cli", "lora", "add", str(wide), "--id", "wide"],
                         env=stack.env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not fit this model" in bad.stderr
    with pytest.raises(ValueError, match="already names another adapter"):
        client.add_lora(lora_files["style-b"], "style-a")
    assert {m["id"] for m in client.list_loras()} == {"style-a", "style-b"}


def test_jobs_with_different_adapters_share_steps_and_equal_stock(stack: EmbeddedStack, client: StencilClient,
                                                                 lora_files: dict[str, Path],
                                                                 saved_model: Path) -> None:
    for lora_id, f in lora_files.items():
        client.add_lora(f, lora_id)
    sets = [(("style-a", 0.8),), (("style-a", 0.4), ("style-b", 1.0)), ()]
    cases = [(template(40 + i), make_mask(0.25, (SIZE, SIZE), "blob", seed=40 + i),
              dict(prompt=p, steps=10, guidance=7.5, seed=i)) for i, p in enumerate(["a cat", "grass", "moon"])]
    handles = [client.submit(template=img, mask=m, loras=s, **kw) for (img, m, kw), s in zip(cases, sets)]
    recs = [h.wait(300) for h in handles]
    assert all(r.status == JobStatus.DONE for r in recs), [r.error for r in recs]
    # Shared steps: every job was denoising before any of them finished.
    assert max(r.ts("denoising") for r in recs) < min(r.ts("finalizing") for r in recs)
    for (img, m, kw), s, h, rec in zip(cases, sets, handles, recs):
        diff = np.abs(result_array(h) - stock(saved_model, lora_files, img, m, s, **kw))
        assert diff.max() <= 1, f"{s}: max pixel diff {diff.max()} vs diffusers' load_lora_weights path"
        if s:
            assert rec.fields["lora_applied_step"] == "0" and rec.fields.get("approximate", "0") == "0"
            steps = int(rec.fields["lora_merged_steps"]) + int(rec.fields["lora_term_steps"])
            assert steps == kw["steps"]
    state = client.redis.hgetall("stencil:worker:0")
    assert set(json.loads(state[b"loras"])) >= {"style-a", "style-b"}  # resident: published for affinity


def test_unknown_adapter_fails_the_job_with_a_reason(client: StencilClient) -> None:
    rec = client.submit(template=template(50), mask=make_mask(0.2, (SIZE, SIZE), seed=5), steps=4,
                        loras=[("no-such-style", 1.0)]).wait(120)
    assert rec.status == JobStatus.FAILED and "unknown LoRA adapter(s): no-such-style" in (rec.error or "")
