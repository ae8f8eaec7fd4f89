"""LoRA adapters in the batched engine, in process: every job of a batch that mixes adapter sets
(and jobs without any) equals diffusers' stock pipeline with ``load_lora_weights`` +
``set_adapters`` at the same scales (1/255 in pixels), for SD (UNet + text encoder adapters) and
Flux Fill; mask-aware edits with adapters; the patcher's merge/terms choice; exact undo."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.jobs import JobParams
from app.maskgen import make_mask
from tests.support.loras import save_flux_lora, save_sd_lora
from tests.support.pipes import sd_pipe
from workers.adapters.bank import AdapterBank
from workers.adapters.convert import canonical_lora
from workers.adapters.lora import LoraWeights
from workers.adapters.patcher import GroupDemand, LoraPatcher
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.models.loader import TRAINED_DIR, scheduler_config

SD_DIR = TRAINED_DIR / "tiny-sd-inpaint-trained"
FLUX_DIR = TRAINED_DIR / "tiny-flux-fill-trained"
SIZE = 128


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    arr = np.stack([np.sin(xx * rng.uniform(2, 8)), np.cos(yy * rng.uniform(2, 8)), np.sin((xx + yy) * 4)], -1)
    return Image.fromarray(((arr * 0.5 + 0.5) * 255).astype(np.uint8))


def _sd_pipe():  # type: ignore[no-untyped-def]
    return sd_pipe(SD_DIR)


class World:
    """The adapters (as files and canonical weights) and a bank that serves them."""

    def __init__(self, files: dict[str, Path], model_dir: Path) -> None:
        self.files = files
        self.weights = {i: canonical_lora(f.read_bytes(), model_dir, i, max_bytes=1 << 30) for i, f in files.items()}
        self.reads: list[str] = []

    def read(self, lora_id: str) -> LoraWeights:
        self.reads.append(lora_id)
        return self.weights[lora_id]


def sd_adapters(root: Path) -> World:
    """Two SD LoRAs ("a": UNet, rank 4; "b": UNet and text encoder, rank 8, alpha 16) saved under ``root``."""
    pipe = _sd_pipe()
    files = {"a": save_sd_lora(pipe, root / "a", rank=4, seed=1),
             "b": save_sd_lora(pipe, root / "b", rank=8, seed=2, text_encoder=True, alpha=16)}
    return World(files, SD_DIR)


@pytest.fixture(scope="module")
def sd_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return sd_adapters(tmp_path_factory.mktemp("sd-loras"))


def stock_sd(world: World, image: Image.Image, mask: np.ndarray, params: JobParams) -> np.ndarray:
    pipe = _sd_pipe()
    if params.loras:
        for lora_id, _ in params.loras:
            pipe.load_lora_weights(str(world.files[lora_id].parent), adapter_name=lora_id)
        pipe.set_adapters([i for i, _ in params.loras], [s for _, s in params.loras])
    out = pipe(prompt=params.prompt, image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
               num_inference_steps=params.steps, guidance_scale=params.guidance, height=SIZE, width=SIZE,
               generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
    return np.asarray(out, dtype=np.int16)


def run_engine(runner, jobs: list[tuple[dict, dict]], max_batch: int = 4) -> tuple[list[dict], Engine]:  # type: ignore[no-untyped-def]
    engine = Engine(runner, BatchScheduler(max_batch=max_batch))
    handles = [engine.submit(f"j{i}", t, m, total_steps=int(m["num_steps"])) for i, (t, m) in enumerate(jobs)]
    engine._drain_inbox(block=False)
    for _ in range(10_000):
        engine._drain_inbox(block=False)
        if not engine.step_once() and all(h.future.done() for h in handles):
            break
    return [h.future.result(timeout=1) for h in handles], engine


class SDService:
    """What a CPU worker (prepare, finalize) and a GPU worker (runner) do, in process."""

    def __init__(self, world: World, *, maskaware: bool = False) -> None:
        from workers.engine.sd_runner import SDRunner
        from workers.maskaware.unet import MaskAwareUNet

        self.world = world
        self.cpu = _sd_pipe()
        self.te = LoraPatcher(self.cpu.text_encoder, "text_encoder", world.weights.__getitem__)  # the CPU worker
        unet = copy.deepcopy(self.cpu.unet).eval()
        self.bank = AdapterBank(world.read, budget_bytes=1 << 30)
        self.lora = LoraPatcher(unet, "unet", self.bank.get)
        self.runner = SDRunner(unet, scheduler_config(SD_DIR), maskaware=MaskAwareUNet(unet) if maskaware else None,
                               lora=self.lora, adapters=self.bank)

    def prepare(self, image: Image.Image, mask: np.ndarray, params: JobParams) -> tuple[dict, dict]:
        from workers.sd_inputs import prepare_job_tensors

        self.te.merge(tuple((i, s) for i, s in params.loras if self.world.weights[i].modules("text_encoder")))
        prep = prepare_job_tensors(self.cpu, scheduler_config(SD_DIR), image,
                                   Image.fromarray(mask.astype(np.uint8) * 255), params, SIZE, SIZE)
        meta = dict(prep.meta, loras=[[i, s] for i, s in params.loras], cache_mode="full")
        return prep.tensors, meta

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        from workers.sd_inputs import decode_latents

        return np.asarray(decode_latents(self.cpu, latents), dtype=np.int16)


def _jobs() -> list[tuple[Image.Image, np.ndarray, JobParams]]:
    sets = [(("a", 0.8),), (("a", 0.5), ("b", 1.0)), (), (("b", 0.7),)]
    return [(_image(i), make_mask(0.25, (SIZE, SIZE), "blob", seed=i),
             JobParams(prompt=p, steps=8, guidance=7.5, seed=10 + i, loras=s))
            for i, (p, s) in enumerate(zip(["a cat", "grass", "the moon", "a rocket"], sets))]


def test_sd_mixed_adapter_batch_equals_stock_per_job(sd_world: World) -> None:
    svc = SDService(sd_world)
    jobs = _jobs()
    results, engine = run_engine(svc.runner, [svc.prepare(img, m, p) for img, m, p in jobs])
    # One step served all four jobs, two of them (at least) through per-row low-rank terms.
    assert any(len(rec.job_ids) == 4 for rec in engine.stats.history)
    assert svc.lora.stats.steps_terms > 0
    for (img, mask, params), out in zip(jobs, results):
        diff = np.abs(svc.decode(out["latents"]) - stock_sd(sd_world, img, mask, params))
        assert diff.max() <= 1, f"{params.loras}: max pixel diff {diff.max()} vs diffusers' LoRA path"
        if params.loras:
            assert out["lora_applied_step"] == 0
            assert out["lora_merged_steps"] + out["lora_term_steps"] == params.steps
    assert sd_world.reads.count("a") == 1 and sd_world.reads.count("b") == 1, "adapters fetched once"


def test_sd_uniform_batch_merges_and_equals_stock(sd_world: World) -> None:
    svc = SDService(sd_world)
    jobs = [(_image(7 + i), make_mask(0.3, (SIZE, SIZE), "rect", seed=i),
             JobParams(prompt="a hat", steps=6, guidance=7.5, seed=i, loras=(("a", 0.8), ("b", 0.5))))
            for i in range(2)]
    results, _ = run_engine(svc.runner, [svc.prepare(img, m, p) for img, m, p in jobs])
    # The set was merged in the background while the first step ran on per-row terms, then
    # swapped in: no merge on the critical path, merged from the second step on.
    assert svc.lora.weights.sync_seconds == 0 and svc.lora.weights.staged_seconds > 0
    assert svc.lora.stats.steps_terms <= 1
    assert all(out["lora_merged_steps"] >= 5 for out in results)
    for (img, mask, params), out in zip(jobs, results):
        diff = np.abs(svc.decode(out["latents"]) - stock_sd(sd_world, img, mask, params))
        assert diff.max() <= 1, f"max pixel diff {diff.max()}"


def test_exact_region_cache_with_adapters_equals_stock(sd_world: World, tmp_path: Path) -> None:
    """A region warm-up recorded with the edit's adapters makes the mask-aware edit exact."""
    from app.storage.local import LocalStore
    from workers.engine.template_cache import CacheRecorder, StepCacheProvider
    from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey

    store = ActivationStore(LocalStore(tmp_path))
    svc = SDService(sd_world, maskaware=True)
    svc.runner.caches = StepCacheProvider(store, 1 << 30)
    svc.runner.recorder = CacheRecorder(store)
    img, mask = _image(3), make_mask(0.15, (SIZE, SIZE), "blob", seed=3)
    params = JobParams(prompt="a cat", steps=6, guidance=7.5, seed=5, loras=(("a", 0.8), ("b", 0.6)))
    key = TemplateCacheKey("m", "t", SIZE, SIZE, "DDIMScheduler", 6, 1.0, "cfg2", "kv+y/exact-x")
    tensors, meta = svc.prepare(img, mask, params)
    out, _ = run_engine(svc.runner, [(tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))])
    out[0]["commit"].result(60)
    for step in range(6):
        svc.runner.caches.wait(key, step, 30)
    tensors, meta = svc.prepare(img, mask, params)
    # Shared with a job without adapters, so the masked job's rows get per-row terms.
    other = svc.prepare(_image(9), mask, JobParams(prompt="grass", steps=6, guidance=7.5, seed=1))
    svc.runner.lora.term_rate.value = 1e-15  # make terms the cheaper choice: exercise them
    res, _ = run_engine(svc.runner, [(tensors, dict(meta, cache_mode="masked", cache_key=key.to_dict())), other])
    assert res[0]["mode"] == "masked" and res[0]["masked_steps"] == 6
    assert svc.lora.stats.steps_terms > 0
    diff = np.abs(svc.decode(res[0]["latents"]) - stock_sd(sd_world, img, mask, params))
    assert diff.max() <= 1, f"max pixel diff {diff.max()}"


def test_late_patch_starts_without_adapters_and_records_the_step(sd_world: World) -> None:
    """A late job runs while its adapter loads and applies it once resident (before the cutoff)."""
    svc = SDService(sd_world)
    gate = __import__("threading").Event()
    read = svc.bank.read
    svc.bank.read = lambda i: (gate.wait(10), read(i))[1]  # the store is slow for this adapter
    img, mask = _image(4), make_mask(0.3, (SIZE, SIZE), "rect", seed=4)
    params = JobParams(prompt="a cat", steps=10, guidance=7.5, seed=3, loras=(("a", 1.0),))
    tensors, meta = svc.prepare(img, mask, params)
    engine = Engine(svc.runner, BatchScheduler(max_batch=2))
    h = engine.submit("late", tensors, dict(meta, lora_patch="late"), total_steps=10)
    engine._drain_inbox(block=False)
    assert engine.step_once() and engine.step_once()  # runs without its adapter meanwhile
    gate.set()
    while not h.future.done():
        engine.step_once()
    out = h.future.result()
    assert 2 <= out["lora_applied_step"] <= 3  # the runner's cutoff is 30 % of 10 steps
    assert out["lora_merged_steps"] + out["lora_term_steps"] == 10 - out["lora_applied_step"]


def test_late_job_waits_at_its_cutoff_and_exact_job_waits_for_admission(sd_world: World) -> None:
    svc = SDService(sd_world)
    gate = __import__("threading").Event()
    read = svc.bank.read
    svc.bank.read = lambda i: (gate.wait(10), read(i))[1]
    img, mask = _image(5), make_mask(0.3, (SIZE, SIZE), "rect", seed=5)
    params = JobParams(prompt="a cat", steps=10, guidance=7.5, seed=3, loras=(("b", 1.0),))
    tensors, meta = svc.prepare(img, mask, params)
    engine = Engine(svc.runner, BatchScheduler(max_batch=2))
    late = engine.submit("late", tensors, dict(meta, lora_patch="late"), total_steps=10)
    exact = engine.submit("exact", tensors, dict(meta), total_steps=10)
    engine._drain_inbox(block=False)
    for _ in range(6):
        engine.step_once()
    assert late.steps_done == 3 and exact.steps_done == 0  # cutoff reached; exact never admitted
    assert exact in engine.scheduler.waiting
    gate.set()
    while not (late.future.done() and exact.future.done()):
        engine.step_once()
    assert late.future.result()["lora_applied_step"] == 3 and exact.future.result()["lora_applied_step"] == 0


def test_unloadable_adapter_fails_only_its_job(sd_world: World) -> None:
    svc = SDService(sd_world)
    svc.bank.read = lambda i: (_ for _ in ()).throw(FileNotFoundError(i)) if i == "b" else sd_world.read(i)
    img, mask = _image(6), make_mask(0.3, (SIZE, SIZE), "rect", seed=6)
    good = svc.prepare(img, mask, JobParams(prompt="a", steps=4, guidance=7.5, seed=1, loras=(("a", 1.0),)))
    bad = svc.prepare(img, mask, JobParams(prompt="a", steps=4, guidance=7.5, seed=1, loras=(("b", 1.0),)))
    engine = Engine(svc.runner, BatchScheduler(max_batch=2))
    hg = engine.submit("good", *good, total_steps=4)
    hb = engine.submit("bad", *bad, total_steps=4)
    engine._drain_inbox(block=False)
    for _ in range(200):
        if hg.future.done() and hb.future.done():
            break
        if not engine.step_once():
            __import__("time").sleep(0.01)
    assert "could not be loaded" in str(hb.future.exception(timeout=1))
    assert hg.future.result(timeout=1)["lora_applied_step"] == 0


# -- the patcher on its own ---------------------------------------------------------------------


@pytest.mark.parametrize("buffers", [2, 0], ids=["swap", "in-place"])
def test_merge_unmerge_cycles_leave_the_base_weights_bit_identical(sd_world: World, buffers: int) -> None:
    unet = copy.deepcopy(_sd_pipe().unet)
    pristine = {k: v.clone() for k, v in unet.state_dict().items()}
    patcher = LoraPatcher(unet, "unet", sd_world.read, merge_buffers=buffers)
    sets = [(("a", 0.8),), (("a", 0.3), ("b", 1.2)), (("b", -0.5),), ()]
    x = (torch.randn(2, 9, 16, 16), torch.tensor([400, 400]), torch.randn(2, 8, 32))
    with torch.no_grad():
        merged_out = None
        for k in range(1000):
            patcher.merge(sets[k % len(sets)])
            if k % 3 == 0:
                patcher.stage(sets[(k + 1) % len(sets)])  # background merges racing the switches
            if k == 501:  # (("a", 0.3), ("b", 1.2)) merged: a forward sees it
                merged_out = unet(*x).sample
        patcher.merge(sets[1])
        again = unet(*x).sample
        patcher.merge(())
        patcher.weights.close()
    assert patcher.stats.merges >= 999 and torch.equal(merged_out, again)
    assert patcher.base_identical()
    assert all(torch.equal(v, pristine[k]) for k, v in unet.state_dict().items())


def test_choose_merges_uniform_batches_and_uses_terms_when_mixed(sd_world: World) -> None:
    patcher = LoraPatcher(copy.deepcopy(_sd_pipe().unet), "unet", sd_world.read)
    a, b = (("a", 1.0),), (("b", 1.0),)
    assert patcher.choose([GroupDemand(a, 512, 20)] * 3) == a
    mixed = [GroupDemand(a, 512, 20), GroupDemand(b, 512, 20), GroupDemand((), 512, 20)]
    assert patcher.choose(mixed) == ()  # merging a or b would need terms for two jobs instead of two
    assert patcher.choose([GroupDemand(a, 512, 20)] * 3 + [GroupDemand(b, 512, 20)]) == a
    patcher.merge(a)
    # One step of b: keeping a would need terms for -a and +b, the base (a swap) only for +b, so never
    # a; merging b wins only where it costs less than one step of b's terms at the measured rates.
    assert patcher.choose([GroupDemand(b, 512, 1)]) in ((), b)
    patcher.merge_rate.value = 1.0  # merging b (not staged) is very expensive here; the base is a swap
    assert patcher.choose([GroupDemand(b, 512, 20)]) == ()
    patcher.stage(b)
    patcher.weights._slots[0].future and patcher.weights._slots[0].future.result()
    patcher.weights._slots[1].future and patcher.weights._slots[1].future.result()
    assert patcher.weights.ready(b) and patcher.choose([GroupDemand(b, 512, 20)]) == b  # staged: a swap


def test_device_copies_of_adapters_the_host_tier_evicted_are_dropped_once_no_step_uses_them(
        sd_world: World) -> None:
    """A long tail of adapters must not pile up on the device: what the host tier (the adapter
    bank) no longer holds leaves the device at the first step that does not use it."""
    held = {"a", "b"}
    patcher = LoraPatcher(copy.deepcopy(_sd_pipe().unet), "unet", sd_world.read, resident=lambda: held)
    a, b = (("a", 1.0),), (("b", 1.0),)
    try:
        for groups, evicted in (([GroupDemand(a, 512, 2), GroupDemand(b, 512, 2)], None),
                                ([GroupDemand(a, 512, 1), GroupDemand(b, 512, 1)], "a"),  # evicted, still used
                                ([GroupDemand(b, 512, 20)], None)):
            held.discard(evicted or "")
            patcher.prepare(groups)
            patcher.finish()
            if evicted:
                assert patcher.on_device == {"a", "b"}  # its job still steps with it
        assert patcher.on_device == {"b"} and patcher.stats.device_copies_dropped == 1
    finally:
        patcher.weights.close()


# -- Flux ---------------------------------------------------------------------------------------


def _flux_pipe():  # type: ignore[no-untyped-def]
    from diffusers import FluxFillPipeline

    pipe = FluxFillPipeline.from_pretrained(FLUX_DIR)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux_mixed_adapter_batch_equals_stock_per_job(tmp_path: Path) -> None:
    from workers.engine.flux_runner import FluxRunner
    from workers.flux_inputs import decode_flux_latents, prepare_flux_job_tensors
    from workers.maskaware.flux import MaskAwareFlux

    maker = _flux_pipe()  # PEFT leaves its wrappers in a model it trained an adapter on: not the served one
    files = {"fa": save_flux_lora(maker, tmp_path / "fa", rank=4, seed=3),
             "fb": save_flux_lora(maker, tmp_path / "fb", rank=8, seed=4)}
    world = World(files, FLUX_DIR)
    pipe = _flux_pipe()
    model = copy.deepcopy(pipe.transformer).eval()
    bank = AdapterBank(world.read, 1 << 30)
    lora = LoraPatcher(model, "transformer", bank.get)
    runner = FluxRunner(model, scheduler_config(FLUX_DIR), pipe.vae_scale_factor, maskaware=MaskAwareFlux(model),
                        lora=lora, adapters=bank)
    lora.term_rate.value = 1e-15  # terms for everyone: the packed path of every row
    sets = [(("fa", 0.9),), (("fa", 0.4), ("fb", 1.0)), ()]
    jobs = [(_image(20 + i), make_mask(0.3, (SIZE, SIZE), "blob", seed=i),
             JobParams(prompt="a cat", steps=5, guidance=30.0, seed=i, loras=s)) for i, s in enumerate(sets)]
    prepared = []
    for img, m, p in jobs:
        prep = prepare_flux_job_tensors(pipe, scheduler_config(FLUX_DIR), img,
                                        Image.fromarray(m.astype(np.uint8) * 255), p, SIZE, SIZE)
        prepared.append((prep.tensors, dict(prep.meta, loras=[[i, s] for i, s in p.loras], cache_mode="full")))
    results, engine = run_engine(runner, prepared)
    assert any(len(rec.job_ids) == 3 for rec in engine.stats.history) and lora.stats.steps_terms > 0
    for (img, mask, params), out in zip(jobs, results):
        ours = np.asarray(decode_flux_latents(pipe, out["latents"], SIZE, SIZE), dtype=np.int16)
        ref = _flux_pipe()
        if params.loras:
            for lora_id, _ in params.loras:
                ref.load_lora_weights(str(files[lora_id].parent), adapter_name=lora_id)
            ref.set_adapters([i for i, _ in params.loras], [s for _, s in params.loras])
        stock = ref(prompt=params.prompt, image=img, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
                    num_inference_steps=params.steps, guidance_scale=params.guidance, height=SIZE, width=SIZE,
                    generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
        diff = np.abs(ours - np.asarray(stock, dtype=np.int16))
        assert diff.max() <= 1, f"{params.loras}: max pixel diff {diff.max()} vs FluxFillPipeline + LoRA"
