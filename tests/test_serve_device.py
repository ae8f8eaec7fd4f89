"""``stencil serve --device``: checked before anything starts (a device this host lacks is a clear
error, nothing left behind), ``cuda`` spreads GPU workers over the GPUs with their stage pools on
the same GPU, ``cpu`` passes through. The GPU run itself: ``tests/test_gpu.py``; the stack with
``--device cpu``: ``tests/test_serve.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.cli import main
from app.serve import device_plan
from workers.models.loader import DeviceUnavailable


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host as one without CUDA, also where the suite runs on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_device_cuda_without_cuda_stops_serve_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_cuda(monkeypatch)
    workdir = tmp_path / "serve"
    assert main(["serve", "--device", "cuda", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert "stencil serve: --device='cuda' but CUDA is not available on this host" in err, err
    assert not workdir.exists()  # no Redis, no workers, no state


def test_a_name_that_is_no_device_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeviceUnavailable, match="--device='gpu0' is not a torch device name"):
        device_plan("gpu0", 1, environ={})


def test_device_cpu_passes_through_to_every_gpu_worker_and_leaves_the_stages_alone() -> None:
    overrides, hosts = device_plan("cpu", 2, environ={})
    assert overrides == {"device": "cpu"}
    assert hosts == {"0": {"STENCIL_DEVICE": "cpu"}, "1": {"STENCIL_DEVICE": "cpu"}}


def test_device_cuda_gives_each_worker_its_gpu_and_the_stages_the_same_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    overrides, hosts = device_plan("cuda", 2, environ={})
    assert overrides == {"device": "cuda:0", "stage_placement": "gpu_host"}
    assert hosts == {"0": {"STENCIL_DEVICE": "cuda:0", "STENCIL_STAGE_DEVICE": "cuda:0"},
                     "1": {"STENCIL_DEVICE": "cuda:1", "STENCIL_STAGE_DEVICE": "cuda:1"}}
    # One worker: the default CUDA device, as STENCIL_DEVICE=cuda names it.
    assert device_plan("cuda", 1, environ={})[1] == {"0": {"STENCIL_DEVICE": "cuda", "STENCIL_STAGE_DEVICE": "cuda"}}
    # The operator's own stage settings win.
    overrides, hosts = device_plan("cuda", 1, environ={"STENCIL_STAGE_PLACEMENT": "cpu", "STENCIL_STAGE_DEVICE": "cpu"})
    assert overrides == {"device": "cuda"} and hosts == {"0": {"STENCIL_DEVICE": "cuda"}}


def test_more_gpu_workers_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    with pytest.raises(DeviceUnavailable, match="--gpu-workers 2 but 1 GPUs are visible"):
        device_plan("cuda", 2, environ={})
    with pytest.raises(DeviceUnavailable, match="--device='cuda:1' but only 1 GPUs are visible"):
        device_plan("cuda:1", 1, environ={})
