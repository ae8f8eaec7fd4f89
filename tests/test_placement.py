"""Stage placement: the text encoders and the VAE run on STENCIL_STAGE_DEVICE (modules and the
tensors fed to them), a device the host lacks is a clear error, and with
STENCIL_STAGE_PLACEMENT=gpu_host a job's prepare and finalize run in the stage pool of the GPU host
the job was routed to (a real Celery worker consuming ``stage.<id>``), exactly as the stock pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from app.settings import Settings
from workers.models.loader import DeviceUnavailable, ensure_model_dir, load_cpu_pipeline, resolve_device, stage_device

SIZE = 64


class DeviceRecorder:
    """Forward pre-hooks on stage modules: the device of each module's parameters and of every tensor
    fed to it, per call."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.calls: dict[str, list[set[torch.device]]] = {name: [] for name in modules}
        for name, module in modules.items():
            module.register_forward_pre_hook(self._hook(name, module), with_kwargs=True)

    def _hook(self, name: str, module: torch.nn.Module):  # type: ignore[no-untyped-def]
        def record(_mod, args, kwargs):  # type: ignore[no-untyped-def]
            seen = {p.device for p in module.parameters()}
            seen |= {t.device for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
            self.calls[name].append(seen)
        return record

    def devices(self) -> set[torch.device]:
        return {d for calls in self.calls.values() for seen in calls for d in seen}


def _image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))


def _mask() -> Image.Image:
    return Image.fromarray(make_mask(0.3, (SIZE, SIZE), "blob", seed=0).astype(np.uint8) * 255)


@pytest.mark.parametrize("model_id", ["tiny-sd-inpaint", "tiny-flux-fill"])
def test_stage_modules_and_their_inputs_are_on_the_configured_device(model_id: str, model_home: Path) -> None:
    """prepare (text encoders, two VAE encodes) and finalize (VAE decode) run on the configured
    stage device: every recorded module's parameters and inputs are there."""
    from workers.models.loader import scheduler_config

    settings = Settings.from_env(home=model_home, model_id=model_id, stage_device="cpu")
    folder = ensure_model_dir(settings)
    pipe = load_cpu_pipeline(folder, settings.stage_device)
    configured = resolve_device(settings.stage_device)
    assert stage_device(pipe) == configured
    modules = {"vae.encoder": pipe.vae.encoder, "vae.decoder": pipe.vae.decoder, "text_encoder": pipe.text_encoder}
    if getattr(pipe, "text_encoder_2", None) is not None:
        modules["text_encoder_2"] = pipe.text_encoder_2
    rec = DeviceRecorder(modules)
    params = JobParams(prompt="a hat", steps=4, strength=0.8, guidance=3.0, seed=1)
    if model_id == "tiny-flux-fill":
        from workers.flux_inputs import decode_flux_latents, prepare_flux_job_tensors

        prepared = prepare_flux_job_tensors(pipe, scheduler_config(folder), _image(), _mask(), params, SIZE, SIZE)
        decode_flux_latents(pipe, prepared.tensors["latents"], SIZE, SIZE)
    else:
        from workers.sd_inputs import decode_latents, prepare_job_tensors

        prepared = prepare_job_tensors(pipe, scheduler_config(folder), _image(), _mask(), params, SIZE, SIZE)
        decode_latents(pipe, prepared.tensors["latents"])
    assert len(rec.calls["vae.encoder"]) == 2, rec.calls  # template + masked template (strength < 1)
    assert len(rec.calls["vae.decoder"]) == 1 and rec.calls["text_encoder"], rec.calls
    assert rec.devices() == {configured}, rec.calls
    assert all(t.device.type == "cpu" for t in prepared.tensors.values())  # what is stored for the engine


def test_a_stage_device_the_host_lacks_is_a_clear_error(model_home: Path) -> None:
    """cuda on a host without CUDA: loading the stage modules and starting a stage worker both stop
    with the reason, before any job is taken."""
    folder = ensure_model_dir(Settings.from_env(home=model_home, model_id="tiny-sd-inpaint"))
    with pytest.raises(DeviceUnavailable, match="not a torch device name"):
        resolve_device("gpu0", "STENCIL_STAGE_DEVICE")
    if torch.cuda.is_available():  # a GPU host: the same call places the modules there
        assert stage_device(load_cpu_pipeline(folder, "cuda")).type == "cuda"
        return
    with pytest.raises(DeviceUnavailable, match="STENCIL_STAGE_DEVICE='cuda' but CUDA is not available"):
        load_cpu_pipeline(folder, "cuda")
    env = dict(os.environ, STENCIL_STAGE_DEVICE="cuda", STENCIL_HOME=str(model_home),
               STENCIL_REDIS_URL="redis://127.0.0.1:1/0")
    proc = subprocess.run([sys.executable, "-m", "app.cli", "stage-worker", "--worker-id", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "CUDA is not available on this host" in proc.stderr


def test_dispatcher_sends_stages_to_the_routed_hosts_stage_queue(redis_server, redis_client) -> None:  # type: ignore[no-untyped-def]
    """gpu_host: prepare goes to ``stage.<worker>`` of the worker the job was routed to; cpu: ``cpu``."""
    from app.celery_app import make_celery
    from app.dispatcher import Dispatcher
    from app.jobs import JobStore

    store = JobStore(redis_client, ttl_seconds=60, intake_stream="stencil:jobs")
    for placement, queues in (("gpu_host", {"stage.0", "stage.1"}), ("cpu", {"cpu"})):
        redis_client.flushdb()
        settings = Settings.from_env(redis_url=redis_server.url, gpu_workers="0,1", routing_policy="round_robin",
                                     stage_placement=placement)
        dispatcher = Dispatcher(settings, make_celery(settings), consumer="t")
        for _ in range(2):
            assert dispatcher.route(store.create(JobParams(steps=5))[0]).startswith("routed to gpu.")
        lengths = {q: redis_client.llen(q) for q in ("cpu", "stage.0", "stage.1")}
        assert {q for q, n in lengths.items() if n} == queues and sum(lengths.values()) == 2, (placement, lengths)
    with pytest.raises(ValueError, match="STENCIL_STAGE_PLACEMENT"):
        Dispatcher(Settings.from_env(redis_url=redis_server.url, stage_placement="gpu"), make_celery(), consumer="t")


@pytest.mark.integration
def test_gpu_host_placement_runs_stages_in_the_hosts_stage_pool(tmp_path: Path, model_home: Path,
                                                               saved_model: Path) -> None:
    """A real stack with STENCIL_STAGE_PLACEMENT=gpu_host: the CPU pool is up too, yet the job's
    prepare and finalize run in GPU host 0's stage worker (its Celery hostname is on the record),
    with the stage modules on the configured device, and the result equals the stock pipeline's."""
    from diffusers import StableDiffusionInpaintPipeline

    from app.client import StencilClient
    from app.embedded import EmbeddedStack

    size = 128
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    mask = make_mask(0.25, (size, size), "blob", seed=3)
    kw = dict(prompt="a red scarf", steps=4, guidance=7.5, seed=7)
    with EmbeddedStack.start(tmp_path / "stack", home=model_home, model_dir=str(saved_model), max_batch=2,
                             stage_placement="gpu_host", stage_device="cpu") as stack:
        assert "stage0" in stack.procs and "cpu" in stack.procs
        client = StencilClient(stack.settings)
        handle = client.submit(template=image, mask=mask, **kw)
        rec = handle.wait(timeout=180)
        assert rec.status.value == "done", rec.error
        assert rec.fields["prepare_worker"].startswith("stage0@"), rec.fields
        assert rec.fields["finalize_worker"].startswith("stage0@"), rec.fields
        assert rec.fields["prepare_device"] == rec.fields["finalize_device"] == "cpu"
        got = np.asarray(handle.result(), dtype=np.int16)
    pipe = StableDiffusionInpaintPipeline.from_pretrained(saved_model)
    pipe.set_progress_bar_config(disable=True)
    stock = pipe(prompt=kw["prompt"], image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
                 num_inference_steps=kw["steps"], guidance_scale=kw["guidance"], height=size, width=size,
                 generator=torch.Generator("cpu").manual_seed(kw["seed"])).images[0]
    assert np.abs(got - np.asarray(stock, dtype=np.int16)).max() <= 1


def test_queue_metrics_cover_the_stage_queues() -> None:
    from app.metrics import default_queues

    assert default_queues(Settings(gpu_workers="0,2", stage_placement="gpu_host")) == \
        ["cpu", "gpu.0", "gpu.2", "stage.0", "stage.2"]
    assert default_queues(Settings(gpu_workers="0")) == ["cpu", "gpu.0"]
