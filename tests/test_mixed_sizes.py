"""Mixed image sizes in one batched step, exactly: every job of a batch whose sizes, aspect ratios,
masks, step counts and modes all differ equals the same job run alone (1e-4 in latents, 1/255 in
pixels), for SD and Flux, without the engine ever falling back to job-by-job steps."""

from __future__ import annotations

import copy
import inspect
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from tests.test_lora_engine import FLUX_DIR, SD_DIR, World, _flux_pipe, _sd_pipe, run_engine, sd_adapters
from workers.models.loader import scheduler_config

SD_SIZES = [(128, 128), (128, 96), (96, 128), (64, 128)]  # (width, height): square, 4:3, 3:4, 1:2


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    arr = np.stack([np.sin(xx * rng.uniform(2, 8)), np.cos(yy * rng.uniform(2, 8)), np.sin((xx + yy) * 4)], -1)
    return Image.fromarray(((arr * 0.5 + 0.5) * 255).astype(np.uint8))


def _mask(seed: int, size: tuple[int, int], ratio: float) -> Image.Image:
    w, h = size
    return Image.fromarray(make_mask(ratio, (h, w), ("rect", "blob", "stroke")[seed % 3], seed=seed).astype(np.uint8)
                           * 255)


class SD:
    def __init__(self, tmp: Path, mixed_sizes: str = "auto") -> None:
        from app.storage.local import LocalStore
        from workers.engine.sd_runner import SDRunner
        from workers.engine.template_cache import CacheRecorder, StepCacheProvider
        from workers.maskaware.activation_store import ActivationStore
        from workers.maskaware.unet import MaskAwareUNet

        self.cpu = _sd_pipe()
        unet = copy.deepcopy(self.cpu.unet).eval()
        store = ActivationStore(LocalStore(tmp))
        self.runner = SDRunner(unet, scheduler_config(SD_DIR), maskaware=MaskAwareUNet(unet),
                               caches=StepCacheProvider(store, 1 << 30), recorder=CacheRecorder(store),
                               mixed_sizes=mixed_sizes)

    def prepare(self, seed: int, size: tuple[int, int], ratio: float, steps: int, **meta):  # type: ignore[no-untyped-def]
        from workers.sd_inputs import prepare_job_tensors

        params = JobParams(prompt=["a cat", "grass", "the moon", "a rocket"][seed % 4], steps=steps, guidance=7.5,
                           seed=seed)
        w, h = size
        prep = prepare_job_tensors(self.cpu, scheduler_config(SD_DIR), _image(seed, size), _mask(seed, size, ratio),
                                   params, h, w)
        return prep.tensors, {**prep.meta, "cache_mode": "full", **meta}


def test_mixed_size_calls_default_per_device_and_reject_unknown_values(capsys: pytest.CaptureFixture[str]) -> None:
    from ops.bench import mixed_sizes
    from workers.engine.sd_runner import MIXED_SIZE_CALLS, SDRunner, mixed_size_calls

    assert inspect.signature(SDRunner).parameters["mixed_sizes"].default == "auto"  # what the service builds
    assert mixed_size_calls("auto", torch.device("cpu")) == "sequential"
    assert mixed_size_calls("auto", torch.device("cuda")) == "lockstep"
    assert mixed_size_calls("lockstep", torch.device("cpu")) == "lockstep"
    assert MIXED_SIZE_CALLS == ("auto", "lockstep", "sequential")
    with pytest.raises(SystemExit):  # the benchmark's option refuses it before any run
        mixed_sizes.main(["--mixed-size-calls", "threads"])
    assert "invalid choice: 'threads'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'threads'"):
        mixed_size_calls("threads", torch.device("cpu"))


def _no_retry(caplog: pytest.LogCaptureFixture) -> None:
    retries = [r.getMessage() for r in caplog.records if "retrying job by job" in r.getMessage()]
    assert not retries, f"the engine fell back to job-by-job steps: {retries[:1]}"


@pytest.mark.parametrize("calls", ["lockstep", "sequential"])  # SDRunner(mixed_sizes=...)
def test_sd_mixed_sizes_share_steps_and_equal_each_job_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            calls: str) -> None:
    from workers.maskaware.activation_store import TemplateCacheKey
    from workers.sd_inputs import decode_latents

    sd = SD(tmp_path, calls)
    assert sd.runner.mixed_sizes == calls
    # A cached (mask-aware) job too: record its exact region cache first, at its own size.
    key = TemplateCacheKey("m", "t", 96, 128, "DDIMScheduler", 6, 1.0, "cfg2", "kv+y/exact-x")
    rec, _ = run_engine(sd.runner, [sd.prepare(9, (128, 96), 0.2, 6, cache_mode="record", cache_key=key.to_dict())])
    rec[0]["commit"].result(60)
    for step in range(6):
        sd.runner.caches.wait(key, step, 30)
    tensors_m, meta_m = sd.prepare(9, (128, 96), 0.2, 6)
    masked = (tensors_m, dict(meta_m, cache_mode="masked", cache_key=key.to_dict()))
    jobs = [sd.prepare(i, size, 0.15 + 0.1 * i, 5 + i) for i, size in enumerate(SD_SIZES)] + [masked]
    alone = [run_engine(sd.runner, [job])[0][0] for job in jobs]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        together, engine = run_engine(sd.runner, jobs, max_batch=5)
    _no_retry(caplog)
    assert any(len(r.job_ids) == 5 for r in engine.stats.history), "the five sizes never shared a step"
    assert together[4]["mode"] == "masked" and together[4]["masked_steps"] == 6
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a["latents"].shape == b["latents"].shape
        err = (a["latents"] - b["latents"]).abs().max().item()
        assert err <= 1e-4, f"job {i}: latents differ by {err} in the mixed batch"
        pa = np.asarray(decode_latents(sd.cpu, a["latents"]), dtype=np.int16)
        pb = np.asarray(decode_latents(sd.cpu, b["latents"]), dtype=np.int16)
        assert np.abs(pa - pb).max() <= 1
    # And the batch really is the stock pipeline's result per job (one size checked end to end).
    w, h = SD_SIZES[1]
    stock = _sd_pipe()(prompt="grass", image=_image(1, (w, h)), mask_image=_mask(1, (w, h), 0.25),
                       num_inference_steps=6, guidance_scale=7.5, height=h, width=w,
                       generator=torch.Generator("cpu").manual_seed(1)).images[0]
    ours = np.asarray(decode_latents(sd.cpu, together[1]["latents"]), dtype=np.int16)
    assert np.abs(ours - np.asarray(stock, dtype=np.int16)).max() <= 1


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return sd_adapters(tmp_path_factory.mktemp("sd-loras"))


@pytest.mark.parametrize("calls", ["lockstep", "sequential"])
def test_sd_mixed_sizes_with_per_job_adapters_equal_each_job_alone(lora_world: World, calls: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Adapters applied per row (low-rank terms, a row layout per size's call) on the mask-aware
    runner: each size's call sees only its own jobs' rows, in either way of making the calls."""
    from workers.adapters.bank import AdapterBank
    from workers.adapters.patcher import LoraPatcher
    from workers.engine.sd_runner import SDRunner
    from workers.maskaware.unet import MaskAwareUNet
    from workers.sd_inputs import prepare_job_tensors

    cpu = _sd_pipe()
    unet = copy.deepcopy(cpu.unet).eval()
    bank = AdapterBank(lora_world.read, budget_bytes=1 << 30)
    lora = LoraPatcher(unet, "unet", bank.get)
    runner = SDRunner(unet, scheduler_config(SD_DIR), maskaware=MaskAwareUNet(unet), lora=lora, adapters=bank,
                      mixed_sizes=calls)
    sets = [(("a", 0.8),), (("a", 0.5), ("b", 1.0)), (), (("b", 0.7),)]
    jobs = []
    for i, (size, adapters) in enumerate(zip(SD_SIZES, sets)):
        w, h = size
        params = JobParams(prompt="a cat", steps=4, guidance=7.5, seed=i, loras=adapters)
        prep = prepare_job_tensors(cpu, scheduler_config(SD_DIR), _image(i, size), _mask(i, size, 0.3), params, h, w)
        jobs.append((prep.tensors, dict(prep.meta, loras=[[a, s] for a, s in adapters], cache_mode="full")))
    alone = [run_engine(runner, [job])[0][0] for job in jobs]
    with caplog.at_level(logging.WARNING):
        together, engine = run_engine(runner, jobs)
    _no_retry(caplog)
    assert any(len(r.job_ids) == 4 for r in engine.stats.history), "the four sizes never shared a step"
    assert lora.stats.steps_terms > 0, "no step applied adapters as per-row terms"
    for i, (a, b) in enumerate(zip(alone, together)):
        err = (a["latents"] - b["latents"]).abs().max().item()
        assert err <= 1e-4, f"job {i} ({sets[i]}): latents differ by {err} in the mixed batch"


def test_flux_mixed_sizes_share_steps_and_equal_each_job_alone(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from app.storage.local import LocalStore
    from workers.engine.flux_runner import FluxRunner
    from workers.engine.template_cache import CacheRecorder, StepCacheProvider
    from workers.flux_inputs import decode_flux_latents, prepare_flux_job_tensors
    from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey
    from workers.maskaware.flux import MaskAwareFlux

    pipe = _flux_pipe()
    model = copy.deepcopy(pipe.transformer).eval()
    store = ActivationStore(LocalStore(tmp_path))
    runner = FluxRunner(model, scheduler_config(FLUX_DIR), pipe.vae_scale_factor, maskaware=MaskAwareFlux(model),
                        caches=StepCacheProvider(store, 1 << 30), recorder=CacheRecorder(store))

    def prepare(i: int, size: tuple[int, int], steps: int, **meta):  # type: ignore[no-untyped-def]
        w, h = size
        params = JobParams(prompt="a cat", steps=steps, guidance=30.0, seed=i)
        prep = prepare_flux_job_tensors(pipe, scheduler_config(FLUX_DIR), _image(i, size), _mask(i, size, 0.3),
                                        params, h, w)
        return prep.tensors, {**prep.meta, "cache_mode": "full", **meta}

    key = TemplateCacheKey("m", "t", 128, 96, "FlowMatchEulerDiscreteScheduler", 4, 1.0, "single", "flux-kv-roped/x")
    rec, _ = run_engine(runner, [prepare(9, (96, 128), 4, cache_mode="record", cache_key=key.to_dict())])
    rec[0]["commit"].result(60)
    for step in range(4):
        runner.caches.wait(key, step, 30)
    jobs = [prepare(i, size, 3 + i) for i, size in enumerate([(128, 128), (128, 96), (96, 128), (64, 128)])]
    jobs.append(prepare(9, (96, 128), 4, cache_mode="masked", cache_key=key.to_dict()))
    alone = [run_engine(runner, [job])[0][0] for job in jobs]
    with caplog.at_level(logging.WARNING):
        together, engine = run_engine(runner, jobs, max_batch=5)
    _no_retry(caplog)
    assert any(len(r.job_ids) == 5 for r in engine.stats.history)
    assert together[4]["mode"] == "masked" and together[4]["masked_steps"] == 4
    for i, (a, b) in enumerate(zip(alone, together)):
        err = (a["latents"] - b["latents"]).abs().max().item()
        assert err <= 1e-4, f"job {i}: latents differ by {err} in the mixed batch"
    w, h = 128, 96
    stock = pipe(prompt="a cat", image=_image(1, (w, h)), mask_image=_mask(1, (w, h), 0.3), num_inference_steps=4,
                 guidance_scale=30.0, height=h, width=w, generator=torch.Generator("cpu").manual_seed(1)).images[0]
    ours = np.asarray(decode_flux_latents(pipe, together[1]["latents"], h, w), dtype=np.int16)
    assert np.abs(ours - np.asarray(stock, dtype=np.int16)).max() <= 1
