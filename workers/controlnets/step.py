"""ControlNet residuals for one batched denoising step, exactly as the stock pipeline adds them.

``StableDiffusionControlNetInpaintPipeline`` runs, every step, each ControlNet on the scaled
(CFG-doubled) latents with the job's control image, multiplies its residuals by
``conditioning_scale * keep`` (``keep`` = 0 outside ``[control_guidance_start, _end]``), sums the
residuals of several ControlNets in their order, and the UNet adds the sum to its down-block skip
connections and mid-block output. Here the rows of every job that uses a ControlNet at a given
position of its list go through that ControlNet in one call (jobs with different ControlNets, with
several, and with none share the step); each row's residuals are scaled by its own factor and added
into zero-initialised batch residuals in each job's own order, so every row gets bit for bit what
the stock pipeline computes (``0 + r1 = r1``, float addition is commutative); rows whose ControlNets
are all off this step add zeros, which changes nothing. A ControlNet whose factor is 0 is skipped.

Concurrency (``Concurrent``): the UNet needs the residuals only after its down blocks, so the
ControlNets run on a second thread while the UNet's conv-in, time embedding and down path run; the
UNet reads the down residuals lazily (``LazyResiduals``: iterating waits) and a hook adds the mid
residual to the mid block's output (the UNet then adds a zero). On a GPU the thread issues the
ControlNets' kernels on the engine's stream: what overlaps is the host's launching of the two
models, not their device time (a side stream, or SwiftDiffusion's ControlNet on another device,
is not built).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Residuals = tuple[list[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class JobControl:
    """One of a job's controls, prepared: the image as the stock pipeline prepares it ([rows, 3, H, W])."""

    controlnet_id: str
    image: torch.Tensor
    scale: float
    start: float = 0.0
    end: float = 1.0

    def factor(self, i: int, n: int) -> float:
        """``controlnet_conditioning_scale * controlnet_keep[i]`` at step ``i`` of ``n``."""
        keep = 1.0 - float(i / n < self.start or (i + 1) / n > self.end)
        return self.scale * keep


@dataclass(frozen=True)
class Use:
    """Rows of one job through one ControlNet this step (``order``: its position in the job's list)."""

    order: int
    controlnet_id: str
    row0: int
    rows: int
    image: torch.Tensor
    factor: float


def residuals(get: Callable[[str], torch.nn.Module], sample: torch.Tensor, timesteps: torch.Tensor,
              embeds: torch.Tensor, uses: Sequence[Use]) -> Residuals:
    """The batch's ControlNet residuals (zeros for rows without a ControlNet this step)."""
    groups: dict[tuple[int, str], list[Use]] = {}
    for u in uses:
        groups.setdefault((u.order, u.controlnet_id), []).append(u)
    down: list[torch.Tensor] | None = None
    mid: torch.Tensor | None = None
    with torch.no_grad():
        for (_order, controlnet_id), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
            # Made on the device: a host tensor's copy would wait for the GPU's queued work (pageable memory).
            idx = torch.cat([torch.arange(u.row0, u.row0 + u.rows, device=sample.device) for u in group])
            d, m = get(controlnet_id)(sample.index_select(0, idx), timesteps.index_select(0, idx),
                                      encoder_hidden_states=embeds.index_select(0, idx),
                                      controlnet_cond=torch.cat([u.image for u in group]), conditioning_scale=1.0,
                                      return_dict=False)
            # The factor stays float32 and each product is rounded once to the residual's dtype, as
            # the stock ``sample * conditioning_scale`` (a Python float) is: a bf16 factor (0.8 ->
            # 0.80078125) moved bf16 edits 6/255 from the stock pipeline.
            factor = torch.cat([torch.full((u.rows,), u.factor, dtype=torch.float32, device=m.device) for u in group])
            factor = factor.view(-1, 1, 1, 1)
            if down is None:
                down = [torch.zeros((sample.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device) for x in d]
                mid = torch.zeros((sample.shape[0], *m.shape[1:]), dtype=m.dtype, device=m.device)
            for acc, x in zip(down, d):
                acc.index_add_(0, idx, (x * factor).to(x.dtype))
            mid.index_add_(0, idx, (m * factor).to(m.dtype))  # type: ignore[union-attr]
    assert down is not None and mid is not None
    return down, mid


class LazyResiduals(Sequence[torch.Tensor]):
    """The down residuals of a step still being computed: the UNet waits only when it adds them."""

    def __init__(self, future: Future, wait: Callable[[Future], Residuals]) -> None:
        self.future = future
        self.wait = wait

    def _down(self) -> list[torch.Tensor]:
        return self.wait(self.future)[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._down())

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self._down()[i]

    def __len__(self) -> int:
        return len(self._down())


class Concurrent:
    """Runs a step's ControlNets on a second thread, overlapped with the UNet's down path."""

    def __init__(self, unet: torch.nn.Module) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stencil-controlnet")
        self._tls = threading.local()  # the pending mid residual of the UNet call on this thread
        self.busy_seconds = 0.0  # ControlNet compute time (thread)
        self.waited_seconds = 0.0  # of which the UNet waited for (not hidden)
        unet.mid_block.register_forward_hook(self._add_mid)

    def _add_mid(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
        future, self._tls.mid = getattr(self._tls, "mid", None), None
        if future is None:
            return None
        return output + self._wait(future)[1]

    def _wait(self, future: Future) -> Residuals:
        t0 = time.perf_counter()
        out = future.result()
        self.waited_seconds += time.perf_counter() - t0
        return out

    def submit(self, fn: Callable[[], Residuals]) -> dict[str, object]:
        """Start the residuals; returns the UNet keyword arguments that consume them."""
        def run() -> Residuals:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.busy_seconds += time.perf_counter() - t0

        future = self._pool.submit(run)
        self._tls.mid = future
        return {"down_block_additional_residuals": LazyResiduals(future, self._wait),
                "mid_block_additional_residual": torch.zeros(())}

    def abandon(self) -> None:
        """After a failed UNet call: no residual may leak into the next call."""
        self._tls.mid = None


__all__ = ["Concurrent", "JobControl", "LazyResiduals", "Use", "residuals"]
