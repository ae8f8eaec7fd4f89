"""ControlNets in the batched engine, in process: every job of a batch that mixes one ControlNet,
two (different scales and guidance windows) and none equals diffusers'
``StableDiffusionControlNetInpaintPipeline`` (or the plain inpainting pipeline) within 1/255,
with the ControlNets run before the UNet or concurrently with its down path."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from tests.support.controlnets import save_controlnet
from tests.support.pipes import controlnet_call
from tests.test_lora_engine import SD_DIR, SIZE, _image, _sd_pipe, run_engine
from workers.controlnets.bank import ControlNetBank
from workers.controlnets.inputs import prepare_control_images
from workers.models.loader import scheduler_config


@pytest.fixture(scope="module")
def nets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    unet = _sd_pipe().unet
    root = tmp_path_factory.mktemp("controlnets")
    return {"edges": save_controlnet(unet, root / "edges", seed=1),
            "depth": save_controlnet(unet, root / "depth", seed=2)}


def _control(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = np.zeros((SIZE, SIZE, 3), np.uint8)
    for _ in range(6):
        y, x = rng.integers(0, SIZE - 20, 2)
        arr[y:y + rng.integers(4, 20), x:x + rng.integers(4, 20)] = 255
    return Image.fromarray(arr)


def stock(nets: dict[str, Path], image: Image.Image, mask: np.ndarray, params: JobParams,
          controls: list[tuple[str, Image.Image, float, float, float]]) -> np.ndarray:
    kw = dict(prompt=params.prompt, image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
              num_inference_steps=params.steps, guidance_scale=params.guidance, height=SIZE, width=SIZE,
              generator=torch.Generator("cpu").manual_seed(params.seed))
    if not controls:
        return np.asarray(_sd_pipe()(**kw).images[0], dtype=np.int16)
    pipe, control_args = controlnet_call(SD_DIR, [nets[c[0]] for c in controls], controls)
    return np.asarray(pipe(**kw, **control_args).images[0], dtype=np.int16)


class Service:
    def __init__(self, nets: dict[str, Path], parallel: bool) -> None:
        from diffusers import ControlNetModel

        from workers.engine.sd_runner import SDRunner

        self.cpu = _sd_pipe()
        self.bank = ControlNetBank(lambda i: ControlNetModel.from_pretrained(nets[i]).eval(), 1 << 30)
        self.runner = SDRunner(copy.deepcopy(self.cpu.unet).eval(), scheduler_config(SD_DIR), controlnets=self.bank,
                               controlnet_parallel=parallel)

    def prepare(self, image, mask, params, controls):  # type: ignore[no-untyped-def]
        from workers.sd_inputs import prepare_job_tensors

        prep = prepare_job_tensors(self.cpu, scheduler_config(SD_DIR), image,
                                   Image.fromarray(mask.astype(np.uint8) * 255), params, SIZE, SIZE)
        tensors = dict(prep.tensors, **prepare_control_images(self.cpu, [c[1] for c in controls], SIZE, SIZE,
                                                                bool(prep.meta["do_cfg"])))
        meta = dict(prep.meta, cache_mode="full", controls=[[c[0], c[2], c[3], c[4]] for c in controls])
        return tensors, meta

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        from workers.sd_inputs import decode_latents

        return np.asarray(decode_latents(self.cpu, latents), dtype=np.int16)


@pytest.mark.parametrize("parallel", [False, True], ids=["before", "concurrent"])
def test_mixed_controlnet_batch_equals_stock_per_job(nets: dict[str, Path], parallel: bool) -> None:
    svc = Service(nets, parallel)
    cases = [
        [("edges", _control(1), 0.8, 0.0, 1.0)],
        [("edges", _control(2), 1.0, 0.0, 0.6), ("depth", _control(3), 0.5, 0.2, 1.0)],
        [],
        [("depth", _control(4), 1.2, 0.0, 1.0), ("edges", _control(5), 0.7, 0.0, 1.0)],
    ]
    jobs = [(_image(30 + i), make_mask(0.3, (SIZE, SIZE), "blob", seed=30 + i),
             JobParams(prompt=p, steps=8, guidance=7.5, seed=i), c)
            for i, (p, c) in enumerate(zip(["a cat", "grass", "the moon", "a rocket"], cases))]
    results, engine = run_engine(svc.runner, [svc.prepare(img, m, p, c) for img, m, p, c in jobs])
    assert any(len(rec.job_ids) == 4 for rec in engine.stats.history), "jobs did not share steps"
    if parallel:
        assert svc.runner.concurrent.busy_seconds > 0
    for (img, mask, params, controls), out in zip(jobs, results):
        diff = np.abs(svc.decode(out["latents"]) - stock(nets, img, mask, params, controls))
        assert diff.max() <= 1, f"{[c[0] for c in controls]}: max pixel diff {diff.max()} vs the stock pipeline"


def test_controlnets_change_the_result_and_zero_scale_does_not(nets: dict[str, Path]) -> None:
    """The check above must be able to fail: a ControlNet changes the edit; at scale 0 it does not."""
    svc = Service(nets, False)
    img, mask = _image(40), make_mask(0.3, (SIZE, SIZE), "blob", seed=40)
    params = JobParams(prompt="a cat", steps=6, guidance=7.5, seed=1)
    runs = [svc.prepare(img, mask, params, c) for c in ([], [("edges", _control(6), 1.0, 0.0, 1.0)],
                                                         [("edges", _control(6), 0.0, 0.0, 1.0)])]
    results, _ = run_engine(svc.runner, runs)
    none, on, zero = (svc.decode(r["latents"]) for r in results)
    assert np.abs(none - on).max() > 8 and np.abs(none - zero).max() <= 1  # 1: batch-position GEMM rounding


def test_controlnet_waits_for_admission_until_resident_and_failures_fail_only_their_job(
        nets: dict[str, Path]) -> None:
    import threading

    from diffusers import ControlNetModel

    from workers.engine.engine import Engine
    from workers.engine.scheduler import BatchScheduler

    svc = Service(nets, False)
    gate = threading.Event()

    def slow(i: str) -> torch.nn.Module:
        if i == "broken":
            raise FileNotFoundError(i)
        gate.wait(10)
        return ControlNetModel.from_pretrained(nets[i]).eval()

    svc.bank.load = slow
    img, mask = _image(41), make_mask(0.3, (SIZE, SIZE), "rect", seed=41)
    params = JobParams(prompt="a", steps=4, guidance=7.5, seed=2)
    engine = Engine(svc.runner, BatchScheduler(max_batch=3))
    plain = engine.submit("plain", *svc.prepare(img, mask, params, []), total_steps=4)
    ctl = engine.submit("ctl", *svc.prepare(img, mask, params, [("edges", _control(7), 1.0, 0.0, 1.0)]), total_steps=4)
    bad = engine.submit("bad", *svc.prepare(img, mask, params, [("broken", _control(8), 1.0, 0.0, 1.0)]),
                        total_steps=4)
    engine._drain_inbox(block=False)
    for _ in range(2):
        engine.step_once()
    assert plain.steps_done == 2 and ctl.steps_done == 0  # the ControlNet is still loading: not admitted
    gate.set()
    for _ in range(400):
        if plain.future.done() and ctl.future.done() and bad.future.done():
            break
        if not engine.step_once():
            __import__("time").sleep(0.01)
    assert "could not be loaded" in str(bad.future.exception(timeout=1))
    assert ctl.future.result(timeout=1)["mode"] == "full" and plain.future.result(timeout=1)
    assert svc.bank.stats.loads == 1 and svc.bank.resident() == {"edges"}
