"""The LoRA benchmarks' two paths: the stock per-request diffusers path (``load_lora_weights``,
``set_adapters``, ``fuse_lora``) and fresh adapters for Stencil's store; shared by ``lora`` and
``addons_gpu``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionInpaintPipeline
from PIL import Image

from app.demo import demo_templates
from app.jobs import JobParams
from app.maskgen import make_mask
from app.storage import LocalStore
from ops.bench.harness.addons import derive_lora, save_sd_lora
from ops.bench.harness.gpu import sync
from ops.bench.harness.service import add_lora

log = logging.getLogger(__name__)


def stock_pipe(model_dir: Path, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> StableDiffusionInpaintPipeline:
    pipe = StableDiffusionInpaintPipeline.from_pretrained(model_dir, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _lora_seed(lora_id: str) -> int:
    return int(lora_id.split("-")[-1])


def _derive_and_add(source: Path, root: Path, store_root: Path, model_dir: Path, lora_id: str, rank: int) -> None:
    """A pool process's work: one derived adapter file, converted into the store as ``stencil lora add`` does."""
    torch.set_num_threads(1)
    f = derive_lora(source, root / lora_id, seed=_lora_seed(lora_id), rank=rank, std=0.02)
    add_lora(LocalStore(store_root), model_dir, lora_id, f)


class Adapters:
    """Adapter files made on demand (one per id, seeded by its number) and added to Stencil's store.

    ``derive``: only the first adapter goes through PEFT (``save_sd_lora``); the others are that
    file with every factor redrawn from their own seed (``derive_lora``: the same keys, shapes,
    dtype and metadata), which skips PEFT's injection into a model on the host (seconds at true
    size). Adding to the store (``stencil lora add``'s conversion) still injects into a skeleton:
    ``prefill`` does it for many ids in a pool of processes."""

    def __init__(self, model_dir: Path, root: Path, store: LocalStore, rank: int, *,
                 dtype: torch.dtype = torch.float32, derive: bool = False) -> None:
        self.model_dir, self.root, self.store, self.rank = model_dir, root, store, rank
        self.dtype, self.derive = dtype, derive
        self.dirs: dict[str, Path] = {}
        self._maker: StableDiffusionInpaintPipeline | None = None
        self._first: Path | None = None

    def _make(self, out: Path, seed: int) -> Path:
        if self.derive and self._first is not None:
            return derive_lora(self._first, out, seed=seed, rank=self.rank, std=0.02)
        if self._maker is None:  # PEFT leaves wrappers in a model it made adapters on: not a served one
            self._maker = stock_pipe(self.model_dir, dtype=self.dtype)
        f = save_sd_lora(self._maker, out, rank=self.rank, seed=seed, std=0.02)
        if self.derive:  # the maker's work is done
            self._first, self._maker = f, None
        return f

    def get(self, lora_id: str) -> Path:
        if lora_id not in self.dirs:
            out = self.root / lora_id
            add_lora(self.store, self.model_dir, lora_id, self._make(out, _lora_seed(lora_id)))
            self.dirs[lora_id] = out
        return self.dirs[lora_id]

    def prefill(self, ids: list[str], processes: int) -> Callable[[], None]:
        """Start making ``ids`` (derived adapters) in ``processes`` forked processes; returns the
        wait. Fork before this process initialises CUDA (the children never touch it)."""
        import multiprocessing

        if not self.derive:
            raise ValueError("prefill makes derived adapters: Adapters(..., derive=True)")
        todo = [i for i in dict.fromkeys(ids) if i not in self.dirs]
        if self._first is None and todo:
            self.get(todo.pop(0))
        if not todo:
            return lambda: None
        assert self._first is not None and isinstance(self.store, LocalStore)
        pool = multiprocessing.get_context("fork").Pool(max(1, min(processes, len(todo))))
        work = [(self._first, self.root, self.store.root, self.model_dir, i, self.rank) for i in todo]
        pending = pool.starmap_async(_derive_and_add, work)

        def wait() -> None:
            try:
                pending.get()
            except BaseException:  # a failure or a signal: stop the others' work now
                pool.terminate()
                raise
            else:
                pool.close()
            finally:
                pool.join()
            self.dirs.update((i, self.root / i) for i in todo)

        return wait


class Stock:
    """The per-request path diffusers documents: load, set, fuse, run, unfuse, unload."""

    def __init__(self, model_dir: Path, adapters: Adapters, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.pipe = stock_pipe(model_dir, device, dtype)
        self.device = torch.device(device)
        self.adapters = adapters
        self.lora_seconds: list[float] = []

    def job(self, image: Image.Image, mask: np.ndarray, params: JobParams) -> float:
        """One request; its seconds (the output image is on the host: every kernel has finished)."""
        pipe = self.pipe
        t0 = time.perf_counter()
        ids = [i for i, _ in params.loras]
        for i in ids:
            pipe.load_lora_weights(str(self.adapters.get(i)), adapter_name=i)
        if ids:
            pipe.set_adapters(ids, [s for _, s in params.loras])
            pipe.fuse_lora(adapter_names=ids, lora_scale=1.0)
        sync(self.device)
        t1 = time.perf_counter()
        h, w = mask.shape
        pipe(prompt=params.prompt, image=image, mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
             num_inference_steps=params.steps, guidance_scale=params.guidance, height=h, width=w,
             generator=torch.Generator("cpu").manual_seed(params.seed))
        t2 = time.perf_counter()
        if ids:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
        sync(self.device)
        t3 = time.perf_counter()
        self.lora_seconds.append((t1 - t0) + (t3 - t2))
        return t3 - t0


def job_inputs(size: int, k: int) -> tuple[Image.Image, np.ndarray]:
    templates = demo_templates(size)
    return templates[k % len(templates)][1], make_mask(0.25, (size, size), ("blob", "rect")[k % 2], seed=k)


def trace_jobs(n: int, pool: int, zipf: float, seed: int) -> list[tuple[tuple[str, float], ...]]:
    """Adapter sets of a long-tail trace: ids by Zipf popularity, 1 or 2 per job, scales in [0.5, 1]."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, pool + 1) ** zipf
    weights /= weights.sum()
    out = []
    for _ in range(n):
        k = int(rng.integers(1, 3))
        ids = rng.choice(pool, size=k, replace=False, p=weights) + 1
        out.append(tuple(sorted((f"tail-{int(i)}", float(round(rng.uniform(0.5, 1.0), 2))) for i in ids)))
    return out
