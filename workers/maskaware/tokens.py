"""Token masks: which tokens of each UNet level a job must recompute.

A pixel mask (H x W, bool or 0/1) becomes a latent-size mask by OR-reduction over each latent
cell (``adaptive_max_pool2d``: any masked pixel marks its cell), then one mask per UNet level by
2x2 OR-pooling with ``ceil_mode`` -- the same size rule as diffusers' stride-2 ``Downsample2D``
(``ceil(h / 2)``), so odd latent sizes line up with the real feature maps. A token is masked if any
of its children is, so coarse levels have a larger masked fraction than the pixel mask. Optional
dilation by ``k`` tokens is applied per level (a "token" is that level's cell) because seams
appear at each level's own boundary between fresh and cached tokens.

``pool_threshold`` (the service's: ``POOL_THRESHOLD``; here 0 = the OR rule above) trades that
conservatism for compute at the coarse levels (1 and up; level 0 keeps the OR rule): a coarse
token is recomputed when at least that share of its pixels is masked (the pixel coverage is pooled
by area, so a blob of pixel ratio 0.2 stays near 0.2 at SDXL's 32x32 level instead of 0.51), and
the rest of its tokens take the template's cached values. A level keeps at least its most-covered
token(s) when the mask reaches it at all. What it costs in fidelity is measured
(``ops/bench/fidelity.py --pool-threshold``, BENCHMARKS.md).

Token order is row-major ``(y, x)``, as ``Transformer2DModel`` flattens ``permute(0, 2, 3, 1)``.
Nothing here knows a model: shapes come from the latent size and the number of UNet levels.

Also here: ``blob_mask`` / ``rect_mask``, synthetic *realistic-shaped* masks of an exact ratio for
tests and benchmarks (never raster prefixes; see DESIGN.md section 3, pitfall 8).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from app.storage.hostcache import to_device
from workers.maskaware.buckets import padded, token_bucket

# The service's pool_threshold: the largest measured threshold whose SSIM loss against OR-pooling,
# whole image and in the mask, stays <= 0.005 for fast and balanced on every trace of the trained
# SDXL-layout model (0.5: 0.011 in the mask; docs/bench/fidelity_pooling_sdxl_layout.md).
POOL_THRESHOLD = 0.25


def _as_bool_2d(mask: torch.Tensor) -> torch.Tensor:
    """Accept HxW (or 1xHxW / 1x1xHxW) bool/0-1/float masks; return HxW bool."""
    m = mask.detach()
    while m.ndim > 2 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2:
        raise ValueError(f"mask must be HxW, got shape {tuple(mask.shape)}")
    return m > 0.5 if m.is_floating_point() else m.bool()


def latent_mask(pixel_mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """OR-reduce a pixel mask to ``latent_hw``: a latent cell is masked if any pixel in it is."""
    m = _as_bool_2d(pixel_mask)
    if tuple(m.shape) == tuple(latent_hw):
        return m.clone()
    pooled = F.adaptive_max_pool2d(m.float()[None, None], latent_hw)
    return pooled[0, 0] > 0.5


def pool_levels(latent: torch.Tensor, num_levels: int) -> list[torch.Tensor]:
    """Level 0 = the latent mask; each next level = 2x2 OR-pool (ceil, like stride-2 convs)."""
    if num_levels < 1:
        raise ValueError("num_levels must be >= 1")
    levels = [_as_bool_2d(latent)]
    for _ in range(num_levels - 1):
        prev = levels[-1].float()[None, None]
        levels.append(F.max_pool2d(prev, kernel_size=2, stride=2, ceil_mode=True)[0, 0] > 0.5)
    return levels


def dilate(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Grow a 2-D bool mask by ``k`` tokens in every direction (square structuring element)."""
    if k <= 0:
        return mask
    m = F.max_pool2d(mask.float()[None, None], kernel_size=2 * k + 1, stride=1, padding=k)
    return m[0, 0] > 0.5


def mask_ratio(mask: torch.Tensor) -> float:
    """Masked fraction of a mask (0 for an empty tensor)."""
    return float(mask.float().mean()) if mask.numel() else 0.0


@dataclass
class TokenMasks:
    """Per-level token masks of one job (level 0 = latent resolution).

    ``indices(n)`` finds the level by token count ``n`` (levels strictly shrink, so the count is
    unique except for degenerate 1x1 tails, whose masks are then identical).

    Counts are Python ints computed once from the (host) masks, and ``prepare(device)`` builds
    every level's index tensor on the compute device once per job: a steady step reads both
    without touching a device value (no host-device synchronisation inside the step).

    ``bucketed``: counts are rounded up to token buckets and indices padded to them
    (``workers/maskaware/buckets.py``), so that graph-captured steps serve other masks.
    """

    levels: list[torch.Tensor]
    _idx: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    _counts: dict[int, int] = field(default_factory=dict, repr=False)
    bucketed: bool = False
    _grown: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @property
    def latent_hw(self) -> tuple[int, int]:
        return tuple(self.levels[0].shape)  # type: ignore[return-value]

    def level_for_tokens(self, n: int) -> int:
        for i, lvl in enumerate(self.levels):
            if lvl.numel() == n:
                return i
        sizes = [tuple(lvl.shape) for lvl in self.levels]
        raise ValueError(f"no token-mask level has {n} tokens (levels {sizes}); "
                         "the mask was built for another latent size or model depth")

    def flat(self, n: int) -> torch.Tensor:
        """Row-major bool vector for the level with ``n`` tokens."""
        return self.levels[self.level_for_tokens(n)].reshape(-1)

    def indices(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Sorted int64 indices of masked tokens at the level with ``n`` tokens (memoized)."""
        key = (n, _device_key(device))
        if key not in self._idx:
            host = self._idx.get((n, "cpu"))
            if host is None:
                host = self.flat(n).cpu().nonzero().reshape(-1)
                if self.bucketed and host.numel():
                    host = padded(host, self.count(n))
                self._idx[(n, "cpu")] = host  # also the batch index's source (``batched.py``)
            self._idx[key] = host if key[1] == "cpu" else to_device(host, device)
        return self._idx[key]

    def device_indices(self, device: torch.device | str) -> tuple[tuple[int, torch.Tensor], ...]:
        """(level tokens, indices) of every partial level on ``device`` (after ``prepare``)."""
        where = _device_key(device)
        return tuple((n, t) for (n, d), t in sorted(self._idx.items(), key=lambda kv: kv[0][0]) if d == where)

    def with_indices(self, indices: dict[int, torch.Tensor], device: torch.device | str) -> "TokenMasks":
        """The same masks reading their indices from ``indices`` (a captured step's static buffers)."""
        where = _device_key(device)
        return TokenMasks(self.levels, {(n, where): t for n, t in indices.items()}, dict(self._counts),
                          self.bucketed)

    def with_buckets(self) -> "TokenMasks":
        """The same masks with counts rounded up to token buckets and indices padded to them."""
        return TokenMasks(self.levels, {}, dict(self._counts), bucketed=True)

    def masked(self, n: int) -> int:
        """Masked tokens at the level with ``n`` tokens (a Python int, memoized)."""
        if n not in self._counts:
            self._counts[n] = int(self.flat(n).sum())
        return self._counts[n]

    def grown(self, n: int, k: int) -> int:
        """Tokens of the level with ``n`` tokens once its mask is grown by ``k`` in every direction
        (a Python int, memoized: a 3x3 convolution's reach, ``resnets.py``)."""
        key = (n, k)
        if key not in self._grown:
            self._grown[key] = int(dilate(self.levels[self.level_for_tokens(n)], k).sum())
        return self._grown[key]

    def count(self, n: int) -> int:
        """Tokens computed at the level with ``n`` tokens: the masked ones, rounded up to their
        bucket when ``bucketed``."""
        m = self.masked(n)
        return token_bucket(m, n) if self.bucketed else m

    def counts(self) -> tuple[int, ...]:
        """Tokens computed per level."""
        return tuple(self.count(lvl.numel()) for lvl in self.levels)

    def prepare(self, device: torch.device | str) -> "TokenMasks":
        """Counts and every partial level's indices on ``device``, built now (at a job's admission)
        so that the steps never build them."""
        for lvl in self.levels:
            n = lvl.numel()
            if 0 < self.count(n) < n:
                self.indices(n, device)
        return self

    def ratios(self) -> list[float]:
        return [mask_ratio(lvl) for lvl in self.levels]

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """For shipping from the prepare stage (safetensors-friendly, uint8)."""
        return {f"level_{i}": lvl.to(torch.uint8).contiguous() for i, lvl in enumerate(self.levels)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "TokenMasks":
        n = len(tensors)
        return cls([tensors[f"level_{i}"].bool() for i in range(n)])


def _device_key(device: torch.device | str) -> str:
    """A device's memo key: ``cuda`` means the current CUDA device (``cuda:0``), as tensors say."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


_ROW_INDEX: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}
_HOLDERS = threading.local()  # the row indices handed out during a graph capture (``holding_row_indices``)


def row_index(rows: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Batch-row indices on ``device``, built once per (rows, device): a step's row selection
    never copies an index from the host (nor, inside a captured CUDA graph, could it)."""
    key = (rows, _device_key(device))
    t = _ROW_INDEX.get(key)
    if t is None:
        if len(_ROW_INDEX) > 4096:
            _ROW_INDEX.clear()  # graphs reading one keep it (``holding_row_indices``)
        t = _ROW_INDEX[key] = to_device(torch.tensor(rows, dtype=torch.long), device)
    held = getattr(_HOLDERS, "held", None)
    if held is not None:
        held.append(t)
    return t


@contextlib.contextmanager
def holding_row_indices() -> Iterator[list[torch.Tensor]]:
    """The row indices ``row_index`` hands out meanwhile, collected: a captured CUDA graph reads
    them by address, so the graph's keeper must keep them past the memo's clearing."""
    held: list[torch.Tensor] = []
    outer = getattr(_HOLDERS, "held", None)
    _HOLDERS.held = held
    try:
        yield held
    finally:
        _HOLDERS.held = outer


def coverage_levels(mask: torch.Tensor, latent_hw: tuple[int, int], num_levels: int,
                    threshold: float) -> list[torch.Tensor]:
    """Level 0 = the OR latent mask; level k >= 1: tokens whose masked pixel share (area-pooled,
    ceil like stride-2 convs) is at least ``threshold``, plus the most-covered token(s) of a level
    the mask reaches, so no masked level is left without fresh tokens."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"pool threshold must be in (0, 1], got {threshold}")
    m = _as_bool_2d(mask)
    coverage = F.adaptive_avg_pool2d(m.float()[None, None], latent_hw)
    levels = [latent_mask(m, latent_hw)]
    for _ in range(num_levels - 1):
        h, w = coverage.shape[-2:]
        padded = F.pad(coverage, (0, w % 2, 0, h % 2))  # ceil mode: a half-outside window averages its pixels inside
        weight = F.pad(torch.ones_like(coverage), (0, w % 2, 0, h % 2))
        coverage = F.avg_pool2d(padded, 2) / F.avg_pool2d(weight, 2)
        level = coverage[0, 0] >= threshold - 1e-6
        top = float(coverage.max())
        if top > 0:
            level |= coverage[0, 0] >= top - 1e-6
        levels.append(level)
    return levels


def build_token_masks(mask: torch.Tensor, latent_hw: tuple[int, int], num_levels: int,
                      dilation: int = 0, pool_threshold: float = 0.0) -> TokenMasks:
    """Pixel (or latent) mask -> latent mask -> pooled levels (OR, or by coverage when
    ``pool_threshold`` > 0) -> per-level dilation."""
    if pool_threshold > 0:
        levels = coverage_levels(mask, latent_hw, num_levels, pool_threshold)
    else:
        levels = pool_levels(latent_mask(mask, latent_hw), num_levels)
    return TokenMasks([dilate(lvl, dilation) for lvl in levels])


# --- synthetic masks of realistic shape (tests, benchmarks) ------------------------------------

def _threshold_to_ratio(field_: torch.Tensor, ratio: float) -> torch.Tensor:
    """Top-``ratio`` share of a score field (exact count, ties broken by index)."""
    n = field_.numel()
    k = int(round(ratio * n))
    out = torch.zeros(n, dtype=torch.bool)
    if k > 0:
        out[torch.topk(field_.reshape(-1), k).indices] = True
    return out.reshape(field_.shape)


def blob_mask(height: int, width: int, ratio: float, seed: int = 0, bumps: int = 4) -> torch.Tensor:
    """An irregular blob (a few overlapping Gaussian bumps + smooth noise) of the given ratio."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.arange(height, dtype=torch.float32)[:, None]
    xs = torch.arange(width, dtype=torch.float32)[None, :]
    cy, cx = torch.rand(2, generator=g) * 0.5 + 0.25
    score = torch.zeros(height, width)
    scale = math.sqrt(max(ratio, 1e-4)) * 0.35
    for _ in range(bumps):
        dy, dx = (torch.rand(2, generator=g) - 0.5) * scale
        sy, sx = (torch.rand(2, generator=g) * 0.6 + 0.4) * scale
        by, bx = (cy + dy) * height, (cx + dx) * width
        score += torch.exp(-(((ys - by) / (sy * height + 1)) ** 2 + ((xs - bx) / (sx * width + 1)) ** 2))
    noise = torch.rand(1, 1, max(2, height // 8), max(2, width // 8), generator=g)
    score += 0.15 * F.interpolate(noise, size=(height, width), mode="bilinear", align_corners=False)[0, 0]
    return _threshold_to_ratio(score, ratio)


def rect_mask(height: int, width: int, ratio: float, seed: int = 0) -> torch.Tensor:
    """An axis-aligned rectangle (random aspect and position) covering about ``ratio``."""
    g = torch.Generator().manual_seed(seed)
    area = ratio * height * width
    aspect = float(torch.rand(1, generator=g)) * 1.5 + 0.5
    h = min(height, max(1, round(math.sqrt(area * aspect))))
    w = min(width, max(1, round(area / h)))
    y0 = int(torch.randint(0, height - h + 1, (1,), generator=g))
    x0 = int(torch.randint(0, width - w + 1, (1,), generator=g))
    m = torch.zeros(height, width, dtype=torch.bool)
    if ratio > 0:
        m[y0:y0 + h, x0:x0 + w] = True
    return m
