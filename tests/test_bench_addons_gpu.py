"""The GPU add-on benchmark (``ops/bench/addons_gpu.py``): its adapters and plan, and its quick mode
end to end on the CPU (the code paths a GPU run takes, on the tiny model)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ops.bench.addons_gpu import adapter_ids, latency_ids
from ops.bench.harness.addons import derive_lora, save_sd_lora

ROOT = Path(__file__).resolve().parents[1]


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def test_a_derived_adapter_has_its_sources_format_and_loads_with_diffusers(tmp_path: Path) -> None:
    """Same keys, shapes, dtype and metadata as the PEFT-made file, new values from its own seed, and
    diffusers' own ``load_lora_weights`` takes it and changes the UNet's output."""
    from diffusers import StableDiffusionInpaintPipeline

    from workers.models.tiny_sd import save_pipeline

    save_pipeline(tmp_path / "model")
    pipe = StableDiffusionInpaintPipeline.from_pretrained(tmp_path / "model", safety_checker=None,
                                                          feature_extractor=None, requires_safety_checker=False)
    source = save_sd_lora(pipe, tmp_path / "a", rank=4, seed=1, std=0.02)
    derived = derive_lora(source, tmp_path / "b", seed=2, rank=4, std=0.02)
    again = derive_lora(source, tmp_path / "c", seed=2, rank=4, std=0.02)
    src, src_meta = _tensors(source)
    out, out_meta = _tensors(derived)
    assert out.keys() == src.keys() and out_meta == src_meta
    for key, t in src.items():
        assert out[key].shape == t.shape and out[key].dtype == t.dtype, key
        assert not torch.equal(out[key], t), key
        assert torch.equal(out[key], _tensors(again)[0][key]), key  # seeded
    ups = torch.cat([v.flatten() for k, v in out.items() if k.endswith("lora.up.weight")])
    assert 0.015 < float(ups.std()) < 0.025  # B drawn with the std asked for, not PEFT's zeros

    sample = torch.randn(1, 9, 8, 8, generator=torch.Generator().manual_seed(0))
    text = torch.randn(1, 77, pipe.unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = pipe.unet(sample, 10, encoder_hidden_states=text).sample
        pipe.load_lora_weights(str(derived.parent), adapter_name="derived")
        adapted = pipe.unet(sample, 10, encoder_hidden_states=text).sample
    assert (adapted - base).abs().max() > 1e-4


def test_both_systems_get_fresh_adapters_every_round_and_every_adapter_is_made_up_front() -> None:
    rounds = [latency_ids(r) for r in range(4)]
    used = [i for r in rounds for n in (1, 2) for i in r[n]]
    assert len(used) == len(set(used)) == 12  # never one adapter in two rounds or two jobs
    assert all(len(r[n]) == n for r in rounds for n in (0, 1, 2))
    args = argparse.Namespace(latency_rounds=4, jobs=6, pool=50, zipf=1.0, seed=0)
    ids = adapter_ids(args, ["latency", "trace"])
    assert len(ids) == len(set(ids)) and set(used) <= set(ids)
    assert any(i.startswith("tail-") for i in ids)
    assert not any(i.startswith("lat-") for i in adapter_ids(args, ["trace"]))


def test_quick_mode_runs_every_part_through_the_stock_and_stencil_paths_on_the_cpu(tmp_path: Path) -> None:
    """The GPU command's code paths on the CPU: diffusers' LoRA and ControlNet pipelines and
    Stencil's service path, with numbers in every part, the adapters applied by Stencil's engine
    and its ControlNet computed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STENCIL_")}
    env.update(STENCIL_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    out, js = tmp_path / "addons_gpu.md", tmp_path / "addons_gpu.json"
    proc = subprocess.run([sys.executable, "-m", "ops.bench.addons_gpu", "--quick", "--device", "cpu",
                           "--out", str(out), "--json", str(js), "--processes", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(js.read_text())
    assert report["notes"] == [], report["notes"]
    assert report["setup"]["adapters"] >= 6
    parts = report["parts"]
    latency = parts["latency"]
    for n in ("1", "2"):
        row = latency["rows"][n]
        assert row["stock_s"] > 0 and row["stencil_s"] > 0 and row["stock_added_s"] > 0, row
    assert latency["stock_lora_s"] > 0
    trace = parts["trace"]
    assert trace["jobs"] == 3 and trace["stock_jobs_per_s"] > 0 and trace["stencil_jobs_per_s"] > 0
    engine = trace["stencil_engine"]
    assert engine["jobs_applied"] == 3 and engine["term_steps"] + engine["merged_steps"] >= 3 * 2
    cn = parts["controlnet"]
    assert set(cn["batch_s"]) == {"stock one at a time", "stock batched", "stencil"}
    assert all(v > 0 for v in cn["latency"].values()) and cn["stencil_controlnet_s"] > 0
    text = out.read_text()
    assert "python -m ops.bench.addons_gpu --quick --device cpu" in text
    for heading in ("## Latency adapters add to one job", "## Long-tail trace", "## One ControlNet"):
        assert heading in text


def test_without_a_peft_diffusers_can_load_loras_with_the_run_says_so_and_still_runs_the_controlnet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine whose PEFT is older than diffusers needs: the LoRA parts are reported as not run,
    with the versions found, and the ControlNet part runs."""
    from diffusers.utils import constants

    from ops.bench.addons_gpu import main

    monkeypatch.setattr(constants, "USE_PEFT_BACKEND", False)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    js = tmp_path / "r.json"
    code = main(["--quick", "--device", "cpu", "--parts", "latency,controlnet", "--out", str(tmp_path / "r.md"),
                 "--json", str(js), "--workdir", str(tmp_path / "work")])
    report = json.loads(js.read_text())
    assert code == 0 and list(report["parts"]) == ["controlnet"]
    assert any(n.startswith("LoRA parts not run") and "peft" in n for n in report["notes"]), report["notes"]
    assert report["setup"]["adapters"] == 0
