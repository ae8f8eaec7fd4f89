"""ControlNets resident on a GPU worker: an LRU of loaded ``ControlNetModel``s under a byte budget,
loaded in the background as soon as the dispatcher routes a job that needs one.

Production traffic uses a small, skewed set of ControlNets (SwiftDiffusion: ~94 of ~3 GiB each, a
few of them serve most requests), so a few resident ones give most steps a hit. A job is admitted
only once its ControlNets are resident (loading never stalls a step) and holds them until it ends,
so eviction never pulls one from under a running job (the budget counts what the LRU holds).
``stats`` counts hits, loads and load seconds: what the LRU benchmark reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Loader = Callable[[str], torch.nn.Module]


@dataclass
class BankStats:
    hits: int = 0  # a job found the ControlNet resident when it asked (routing prefetch or admission)
    misses: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    evictions: int = 0


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ControlNetBank:
    def __init__(self, load: Loader, budget_bytes: int, threads: int = 1, retry_after_s: float = 30.0) -> None:
        self.load = load
        self.budget_bytes = budget_bytes
        self.retry_after_s = retry_after_s
        self._models: OrderedDict[str, torch.nn.Module] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._pending: set[str] = set()
        self._failed: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="stencil-controlnet-load")
        self.stats = BankStats()

    def _load(self, controlnet_id: str) -> None:
        t0 = time.perf_counter()
        try:
            model = self.load(controlnet_id)
        except Exception as exc:
            log.warning("ControlNet %s could not be loaded: %s", controlnet_id, exc)
            with self._lock:
                self._failed[controlnet_id] = (f"ControlNet {controlnet_id!r} could not be loaded "
                                               f"({type(exc).__name__})", time.monotonic())
                self._pending.discard(controlnet_id)
            return
        took = time.perf_counter() - t0
        size = model_bytes(model)
        with self._lock:
            self._models[controlnet_id] = model
            self._sizes[controlnet_id] = size
            self._pending.discard(controlnet_id)
            self.stats.loads += 1
            self.stats.load_seconds += took
            self._evict(keep=controlnet_id)
        log.info("ControlNet %s loaded in %.2f s (%.0f MiB)", controlnet_id, took, size / 2**20)

    def _evict(self, keep: str) -> None:
        while sum(self._sizes.values()) > self.budget_bytes and len(self._models) > 1:
            victim = next(iter(self._models))
            if victim == keep:
                self._models.move_to_end(victim)
                continue
            del self._models[victim]
            self._sizes.pop(victim, None)
            self.stats.evictions += 1

    def prefetch(self, ids: Iterable[str], *, count: bool = True) -> None:
        """Start loading what is not resident (deduplicated); ``count``: a job asked (hit/miss stats)."""
        now = time.monotonic()
        for controlnet_id in ids:
            with self._lock:
                if controlnet_id in self._models:
                    if count:
                        self.stats.hits += 1
                    self._models.move_to_end(controlnet_id)
                    continue
                failed = self._failed.get(controlnet_id)
                if failed is not None and now - failed[1] < self.retry_after_s:
                    continue
                if count:
                    self.stats.misses += 1
                if controlnet_id in self._pending:
                    continue
                self._failed.pop(controlnet_id, None)
                self._pending.add(controlnet_id)
            self._pool.submit(self._load, controlnet_id)

    def ready(self, ids: Iterable[str]) -> bool:
        with self._lock:
            return all(i in self._models for i in ids)

    def failure(self, ids: Iterable[str]) -> str | None:
        with self._lock:
            return next((self._failed[i][0] for i in ids if i in self._failed), None)

    def get(self, controlnet_id: str) -> torch.nn.Module:
        """A resident ControlNet (callers check ``ready`` first); marks it recently used."""
        with self._lock:
            model = self._models[controlnet_id]
            self._models.move_to_end(controlnet_id)
            return model

    def resident(self) -> set[str]:
        with self._lock:
            return set(self._models)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def store_loader(store_get: Callable[[str], bytes], device: str | torch.device, dtype: torch.dtype) -> Loader:
    """Load a ControlNet stored by ``stencil.add_controlnet`` (config + safetensors; never pickle)."""
    import json

    from diffusers import ControlNetModel
    from safetensors.torch import load as st_load

    from app.controls import controlnet_key

    def load(controlnet_id: str) -> torch.nn.Module:
        config = json.loads(store_get(controlnet_key(controlnet_id, "config.json")))
        state = st_load(store_get(controlnet_key(controlnet_id, "diffusion_pytorch_model.safetensors")))
        with torch.device("meta"):
            model = ControlNetModel.from_config(config)
        model.load_state_dict(state, strict=True, assign=True)
        return model.to(device=device, dtype=dtype).eval()

    return load


__all__ = ["BankStats", "ControlNetBank", "model_bytes", "store_loader"]
