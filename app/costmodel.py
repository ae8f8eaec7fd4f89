"""Fitted cost models: predicted step latency of a batch and load latency of cached activations.

Why this shape. The dispatcher (no torch, sub-millisecond decisions), the engine scheduler (SLO
admission) and the cluster simulator all need "how long will this batch's next step take" and
"how long does fetching this template's activations take". Both are fitted offline by
``python -m ops.bench.profile`` on the real runner and stored as plain JSON coefficients (never a
pickle), one file per (model id, device kind). Everything the service calls here is pure Python
arithmetic (the offline curve fitter, ``fit_step_curve``, uses numpy).

Step latency (per architecture, from masked-token counts). A UNet step is a sum of operators whose
work is known from the config and each job's masked tokens per level; the paper's Table 1 does the
same per operator. Per transformer block at level ``l`` (width ``C``, tokens ``N``, a job's masked
tokens ``M`` at that level, text length ``T``, cross-attention width ``D``, feed-forward inner
``F = 4C`` with GEGLU), per batch row, multiply-accumulates (MACs):

    ===========================  ==========================  =============================
    operator                     masked job (cache used)     full compute (no cache)
    ===========================  ==========================  =============================
    attn1 Q, K, V, out proj      4 M C^2                     4 N C^2
    attn1 scores + weighted sum  2 M N C                     2 N^2 C
    attn2 Q, out proj            2 M C^2                     2 N C^2
    attn2 K, V (text)            2 T D C                     2 T D C
    attn2 scores + weighted sum  2 M T C                     2 N T C
    feed-forward (GEGLU)         3 M C F = 12 M C^2          12 N C^2
    cache copies (K, V, output)  3 N C elements moved        0
    ResNets, convs, GroupNorm,   same as full (full map)     counted per conv from config
    proj_in/out, conv_in/out
    ===========================  ==========================  =============================

Features of a batch (sums over its jobs, each job = ``rows_per_job`` rows, 2 with CFG):
``fullmap_gmacs`` (full-map convs), ``linear_gmacs`` (token-wise projections + FF), ``attn_gmacs``
(attention products), ``copy_melems`` (cache tensors copied and scattered into), ``jobs`` (per-job
fixed work: scheduler step, per-group attention calls). Step seconds = intercept + coef . features,
fitted with non-negative least squares. Because the model is linear and batch features are sums of
job features, a job reduces to one number, its *marginal step seconds*, and a batch's step time is
``intercept + sum(job seconds)``: that is what makes routing over 64 workers cheap.

Step curve (optional, ``curve`` in the JSON). A GPU step is not linear in its jobs: below a few jobs
the host launching kernels bounds it (the 2nd-4th job costs nearly nothing), past that knee each job
adds its device time. A model measured on such a device may carry the fitted batch-step curve
``t(W) = (h^p + (c W)^p)^(1/p)`` (``StepCurve``) in work units, one unit = one full-compute job at the
model's profiled size, a job's work = its marginal step seconds / a full job's. With a curve a batch's
step is ``t(sum of the jobs' work)`` instead of ``intercept + sum(job seconds)``, so adding a job to a
worker costs ``t(W + w) - t(W)``: what routing, SLO admission and deadline checks then integrate.
``ops.bench.profile`` fits the curve (``fit_step_curve``) on the batches it measures and writes it
only where it predicts the held-out batches better than the linear step; models without one stay linear.

Load latency per tier (``local`` folder, ``host`` RAM, ``s3``): ``latency_s + bytes / bandwidth``,
fitted on measured reads.

When only a pixel mask ratio is known (traces, routing before ``prepare`` ran), masked tokens per
level are estimated as ``(sqrt(r * N_l) + edge_l)^2``: the masked area in that level's cells,
grown by the cells its boundary touches, so coarse levels get the larger masked fraction that
OR-pooling really produces (DESIGN.md section 2). ``edge_l`` is fitted by the profiler on the
realistic masks it measured (irregular blobs need about 3-4 cells; a compact aligned square
``1 - 1/s``, the default).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.steptime import BatchPredictor, JobShape, engine_job_shape

FORMAT = "stencil-costmodel"
VERSION = 1
STEP_FEATURES = ("fullmap_gmacs", "linear_gmacs", "attn_gmacs", "copy_melems", "jobs")
TIERS = ("host", "local", "s3")


# -- architecture and feature derivation -------------------------------------------------------


@dataclass(frozen=True)
class BlockSpec:
    """One ``BasicTransformerBlock``: where it sits and how wide it is."""

    name: str
    level: int
    channels: int
    cross_dim: int
    ff_inner: int
    last_in_transformer: bool


def level_hw(latent_hw: tuple[int, int], level: int) -> tuple[int, int]:
    """Feature-map size at ``level`` (stride-2 convs: ceil halving, as the real UNet)."""
    h, w = latent_hw
    for _ in range(level):
        h, w = (h + 1) // 2, (w + 1) // 2
    return h, w


def _per_block(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _unet_fullmap_macs(cfg: dict[str, Any], latent_hw: tuple[int, int]) -> float:
    """Full-map MACs per row (convs, ResNets, proj_in/out, samplers) from a UNet config.

    Mirrors diffusers' ``UNet2DConditionModel`` constructor; ops/bench/profile.py checks it against MACs
    counted with forward hooks on the real model.
    """
    chans = list(cfg["block_out_channels"])
    n = len(chans)
    down_types = list(cfg["down_block_types"])
    up_types = list(cfg["up_block_types"])
    lpb = _per_block(cfg.get("layers_per_block", 2), n)
    tlpb = _per_block(cfg.get("transformer_layers_per_block", 1), n)
    toks = [level_hw(latent_hw, lvl)[0] * level_hw(latent_hw, lvl)[1] for lvl in range(n)]
    temb = 4 * chans[0]
    macs = toks[0] * 9 * cfg.get("in_channels", 9) * chans[0]  # conv_in
    macs += chans[0] * temb + temb * temb  # time embedding MLP (per row)

    def resnet(lvl: int, cin: int, cout: int) -> float:
        m = toks[lvl] * 9 * (cin * cout + cout * cout) + temb * cout
        return m + (toks[lvl] * cin * cout if cin != cout else 0)

    def proj(lvl: int, c: int) -> float:
        return 2 * toks[lvl] * c * c  # proj_in + proj_out

    cin = chans[0]
    for i, kind in enumerate(down_types):
        cout = chans[i]
        for j in range(lpb[i]):
            macs += resnet(i, cin if j == 0 else cout, cout)
            if "CrossAttn" in kind:
                macs += proj(i, cout)
        if i < n - 1:
            macs += toks[i + 1] * 9 * cout * cout  # Downsample2D conv, stride 2
        cin = cout
    mid = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn") or ""
    if mid:
        macs += 2 * resnet(n - 1, chans[-1], chans[-1])
        if "CrossAttn" in mid:
            macs += proj(n - 1, chans[-1])
    rev = list(reversed(chans))
    rev_lpb = list(reversed(lpb))
    prev = rev[0]
    for i, kind in enumerate(up_types):
        lvl = n - 1 - i
        cout = rev[i]
        cin_skip = rev[min(i + 1, n - 1)]
        layers = rev_lpb[i] + 1
        for j in range(layers):
            skip = cin_skip if j == layers - 1 else cout
            res_in = prev if j == 0 else cout
            macs += resnet(lvl, res_in + skip, cout)
            if "CrossAttn" in kind:
                macs += proj(lvl, cout)
        if i < n - 1:
            macs += toks[lvl - 1] * 9 * cout * cout  # Upsample2D conv at the finer level
        prev = cout
    macs += toks[0] * 9 * chans[0] * cfg.get("out_channels", 4)  # conv_out
    del tlpb
    return float(macs)


def _unet_blocks(cfg: dict[str, Any]) -> tuple[BlockSpec, ...]:
    """Transformer blocks of a UNet config, named by module path as ``MaskAwareUNet`` names them."""
    chans = list(cfg["block_out_channels"])
    n = len(chans)
    lpb = _per_block(cfg.get("layers_per_block", 2), n)
    tlpb = _per_block(cfg.get("transformer_layers_per_block", 1), n)
    cross = _per_block(cfg.get("cross_attention_dim", 768), n)
    blocks: list[BlockSpec] = []

    def add(prefix: str, lvl: int, c: int, d: int, depth: int) -> None:
        for k in range(depth):
            blocks.append(BlockSpec(f"{prefix}.transformer_blocks.{k}", lvl, c, d, 4 * c, k == depth - 1))

    for i, kind in enumerate(cfg["down_block_types"]):
        if "CrossAttn" in kind:
            for j in range(lpb[i]):
                add(f"down_blocks.{i}.attentions.{j}", i, chans[i], cross[i], tlpb[i])
    mid = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn") or ""
    if "CrossAttn" in mid:
        add("mid_block.attentions.0", n - 1, chans[-1], cross[-1], tlpb[-1])
    rev_c, rev_l, rev_t, rev_x = (list(reversed(v)) for v in (chans, lpb, tlpb, cross))
    for i, kind in enumerate(cfg["up_block_types"]):
        if "CrossAttn" in kind:
            for j in range(rev_l[i] + 1):
                add(f"up_blocks.{i}.attentions.{j}", n - 1 - i, rev_c[i], rev_x[i], rev_t[i])
    return tuple(blocks)


@dataclass(frozen=True)
class UNetArch:
    """What the features of an SD-family UNet need; derived from its config, stored in the model."""

    latent_hw: tuple[int, int]
    num_levels: int
    blocks: tuple[BlockSpec, ...]
    fullmap_macs_per_row: float  # at ``latent_hw``
    text_len: int = 77
    rows_per_job: int = 2  # classifier-free guidance: (uncond, cond)
    vae_factor: int = 8
    dtype_bytes: int = 4
    layout: str = "kv+y"
    kind: str = "unet"
    # Per level, cells a mask's boundary adds to the side of its area (``tokens_from_ratio``);
    # fitted by ops/bench/profile.py on the real masks it measured; empty = a compact, aligned blob.
    edge_cells: tuple[float, ...] = ()

    @classmethod
    def from_unet_config(cls, cfg: dict[str, Any], latent_hw: tuple[int, int], **kw: Any) -> "UNetArch":
        return cls(latent_hw=tuple(latent_hw), num_levels=len(cfg["block_out_channels"]),  # type: ignore[arg-type]
                   blocks=_unet_blocks(cfg), fullmap_macs_per_row=_unet_fullmap_macs(cfg, latent_hw), **kw)

    def level_tokens(self) -> list[int]:
        return [h * w for h, w in (level_hw(self.latent_hw, lvl) for lvl in range(self.num_levels))]

    def tokens_from_ratio(self, ratio: float) -> tuple[int, ...]:
        """Masked tokens per level for a mask of pixel ratio ``ratio``: per level ``l`` with
        ``A`` = masked area in that level's cells, ``(sqrt(A) + edge_l)^2`` tokens (module doc)."""
        ratio = min(max(float(ratio), 0.0), 1.0)
        totals = self.level_tokens()
        if ratio <= 0.0:
            return tuple(0 for _ in totals)
        if ratio >= 1.0:
            return tuple(totals)
        out = []
        for lvl, total in enumerate(totals):
            s = self.vae_factor * 2 ** lvl
            edge = self.edge_cells[lvl] if lvl < len(self.edge_cells) else 1.0 - 1.0 / s
            side = math.sqrt(ratio * total) + edge
            out.append(min(total, max(1, round(side * side))))
        return tuple(out)

    def with_edges(self, samples: Sequence[tuple[float, Sequence[int]]]) -> "UNetArch":
        """This arch with ``edge_cells`` fitted (least squares in sqrt space) on real masks:
        ``samples`` = (pixel ratio, masked tokens per level) with 0 < ratio < 1."""
        totals = self.level_tokens()
        edges = []
        for lvl, total in enumerate(totals):
            diffs = [math.sqrt(c[lvl]) - math.sqrt(r * total) for r, c in samples if 0 < r < 1 and c[lvl] < total]
            edges.append(round(max(0.0, sum(diffs) / len(diffs)), 4) if diffs else 1.0)
        return dataclasses.replace(self, edge_cells=tuple(edges))

    def job_features(self, masked_tokens: Sequence[int] | None) -> tuple[float, ...]:
        """Step features of one job; ``None`` = full compute (no cache or mask ratio 1)."""
        totals = self.level_tokens()
        t = self.text_len
        lin = att = copy = 0.0
        for b in self.blocks:
            n = totals[b.level]
            m = n if masked_tokens is None else min(n, int(masked_tokens[b.level]))
            c = b.channels
            lin += 6 * m * c * c + 3 * m * c * b.ff_inner + 2 * t * b.cross_dim * c
            att += 2 * m * n * c + 2 * m * t * c
            if masked_tokens is not None and m < n:
                copy += (3 if m else 1) * n * c
        r = self.rows_per_job
        return (r * self.fullmap_macs_per_row / 1e9, r * lin / 1e9, r * att / 1e9, r * copy / 1e6, 1.0)

    def cache_bytes_per_step(self) -> int:
        """Bytes of one step of a template cache for one job (``MaskAwareUNet.cache_nbytes``)."""
        totals = self.level_tokens()
        per_row = 0
        for b in self.blocks:
            n_t = (2 if self.layout == "kv+y" else 0) + (1 if (b.last_in_transformer or self.layout == "y") else 0)
            per_row += n_t * totals[b.level] * b.channels
        return self.rows_per_job * self.dtype_bytes * per_row

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocks"] = [asdict(b) for b in self.blocks]
        d["latent_hw"] = list(self.latent_hw)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UNetArch":
        d = dict(d)
        d["blocks"] = tuple(BlockSpec(**b) for b in d["blocks"])
        d["latent_hw"] = tuple(d["latent_hw"])
        d["edge_cells"] = tuple(d.get("edge_cells", ()))
        return cls(**d)


# -- mask -> masked tokens (numpy, no torch: the dispatcher uses it) ---------------------------


def token_counts_from_mask(mask: Any, latent_hw: tuple[int, int], num_levels: int) -> tuple[int, ...]:
    """Masked tokens per level of a pixel mask, as ``workers.maskaware.tokens`` pools it.

    Latent cell = OR over its pixels; each coarser level = 2x2 OR with ceil (odd sizes padded).
    """
    import numpy as np

    m = np.asarray(mask).astype(bool)
    h, w = latent_hw

    def pool(a: np.ndarray, n: int, axis: int) -> np.ndarray:
        # adaptive_max_pool bins: [floor(i*L/n), ceil((i+1)*L/n)); "any" via a cumulative sum.
        length = a.shape[axis]
        i = np.arange(n)
        start, end = (i * length) // n, -((-(i + 1) * length) // n)
        c = np.concatenate([np.zeros_like(np.take(a, [0], axis=axis), dtype=np.int64),
                            np.cumsum(a, axis=axis, dtype=np.int64)], axis=axis)
        return (np.take(c, end, axis=axis) - np.take(c, start, axis=axis)) > 0

    lat = pool(pool(m, h, 0), w, 1)
    counts = [int(lat.sum())]
    cur = lat
    for _ in range(num_levels - 1):
        ph, pw = cur.shape[0] % 2, cur.shape[1] % 2
        if ph or pw:
            cur = np.pad(cur, ((0, ph), (0, pw)))
        cur = cur.reshape(cur.shape[0] // 2, 2, cur.shape[1] // 2, 2).any(axis=(1, 3))
        counts.append(int(cur.sum()))
    return tuple(counts)


# -- fitted models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitReport:
    """How well a fit predicts points it never saw (held out before fitting)."""

    r2_train: float
    r2_test: float
    mape_test: float
    n_train: int
    n_test: int
    residuals_test: tuple[float, ...] = ()  # measured - predicted, seconds

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["residuals_test"] = [round(r, 6) for r in self.residuals_test]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FitReport":
        d = dict(d)
        d["residuals_test"] = tuple(d.get("residuals_test", ()))
        return cls(**d)


@dataclass(frozen=True)
class TierFit:
    """Load latency of one storage tier: ``latency_s + nbytes / bandwidth``."""

    latency_s: float
    bytes_per_s: float
    report: FitReport | None = None

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class StepCurve:
    """A batch step's seconds as a smooth roofline of its work ``W`` (module docstring):
    ``t(W) = (h^p + (c W)^p)^(1/p)``. Convex and increasing in ``W``, which the router's lower bound uses."""

    floor_s: float  # h: the host-bound step, whatever the batch
    per_job_s: float  # c: one more full job's seconds once the device bounds the step
    knee: float  # p: how sharp the knee between the two is

    def __post_init__(self) -> None:
        if self.floor_s <= 0 or self.per_job_s <= 0 or self.knee < 1:
            raise ValueError(f"a step curve needs h > 0, c > 0 and p >= 1, got {self}")

    def seconds(self, work: float) -> float:
        p = self.knee
        return (self.floor_s ** p + (self.per_job_s * max(work, 0.0)) ** p) ** (1.0 / p)

    def to_dict(self) -> dict[str, Any]:
        return {"form": "t(W) = (h^p + (c W)^p)^(1/p)", "h_s": self.floor_s, "c_s": self.per_job_s, "p": self.knee}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepCurve":
        return cls(float(d["h_s"]), float(d["c_s"]), float(d["p"]))


def fit_step_curve(work: Sequence[float], seconds: Sequence[float]) -> StepCurve:
    """The ``StepCurve`` of least relative squared error through ``(work, seconds)`` (3 points or more).

    Shared by ``ops.bench.profile`` (a deployment's own measured steps) and ``ops.sim.gpu_costs``
    (the GPU points shipped as data), so both fit the same curve the same way. Relative error because
    a step's seconds span 1-4x over a batch and a router cares about ratios. For each knee ``p`` on a
    grid (1 to 8 by 0.01), ``t^p = h^p + c^p W^p`` is linear in ``h^p`` and ``c^p``; weighted by
    ``1 / t^p`` its least squares is the relative fit of that ``p``, and the ``p`` of least relative
    error wins: deterministic, no starting point to choose. Offline only (numpy, imported here)."""
    import numpy as np

    x, y = np.asarray(work, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if len(x) < 3:
        raise ValueError("a step curve has 3 parameters: fit it on 3 points or more")
    best: tuple[float, StepCurve] | None = None
    for p in np.round(np.arange(1.0, 8.0 + 1e-9, 0.01), 2):
        yp = y ** p
        design = np.stack([np.ones_like(x), x ** p], axis=1) / yp[:, None]
        (a, b), *_ = np.linalg.lstsq(design, np.ones_like(x), rcond=None)
        if a <= 0 or b <= 0:
            continue
        err = float(np.mean((((a + b * x ** p) ** (1 / p) - y) / y) ** 2))
        if best is None or err < best[0]:
            best = (err, StepCurve(float(a ** (1 / p)), float(b ** (1 / p)), float(p)))
    if best is None:
        raise ValueError("no step curve fits these points (a step must not get cheaper with more work)")
    return best[1]


@dataclass
class CostModel:
    """Step and load latency predictions for one (model id, device kind)."""

    model_id: str
    device_kind: str
    arch: UNetArch
    intercept: float
    coef: tuple[float, ...]
    tiers: dict[str, TierFit] = field(default_factory=dict)
    step_report: FitReport | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # Resolution-aware step time of whole batches (``app/steptime.py``), fitted on mixed-size batches
    # by ``ops.bench.profile --sizes``; when present it is what SLO admission and deadlines use.
    batch: BatchPredictor | None = None
    # Batch-step curve in full-job work units (module docstring); None = the linear step.
    curve: StepCurve | None = None
    _memo: dict[tuple[Any, ...], float] = field(default_factory=dict, repr=False, compare=False)

    # -- step latency --------------------------------------------------------------------------
    def features_seconds(self, features: Sequence[float]) -> float:
        return sum(c * f for c, f in zip(self.coef, features))

    def job_step_seconds(self, masked_tokens: Sequence[int] | None) -> float:
        """Marginal seconds one job adds to every step it shares (``None`` = full compute)."""
        key = ("t", None if masked_tokens is None else tuple(masked_tokens))
        value = self._memo.get(key)
        if value is None:
            value = self.features_seconds(self.arch.job_features(masked_tokens))
            if len(self._memo) > 100_000:
                self._memo.clear()
            self._memo[key] = value
        return value

    def job_seconds_from_ratio(self, ratio: float, cached: bool = True) -> float:
        """Marginal step seconds from a pixel mask ratio (tokens estimated, module doc)."""
        if not cached or ratio >= 1.0:
            return self.job_step_seconds(None)
        key = ("r", round(float(ratio), 4))
        value = self._memo.get(key)
        if value is None:
            value = self.job_step_seconds(self.arch.tokens_from_ratio(ratio))
            self._memo[key] = value
        return value

    def job_seconds(self, *, mask_ratio: float = 1.0, masked_tokens: Sequence[int] | None = None,
                    cached: bool = True) -> float:
        """Marginal step seconds of a job described however much is known about it."""
        if not cached:
            return self.job_step_seconds(None)
        if masked_tokens is not None and len(masked_tokens) == self.arch.num_levels:
            return self.job_step_seconds(masked_tokens)
        return self.job_seconds_from_ratio(mask_ratio, cached)

    def step_seconds(self, job_seconds: Iterable[float]) -> float:
        """Predicted latency of one step of a batch whose jobs add ``job_seconds``."""
        if self.curve is not None:
            return self.curved_step(sum(job_seconds))
        return self.intercept + sum(job_seconds)

    def curved_step(self, job_seconds_sum: float) -> float:
        """One step on the curve of a batch whose jobs' marginal seconds sum to ``job_seconds_sum``:
        the sum in work units (a full job's seconds each), then ``t(W)``. Needs ``curve``."""
        assert self.curve is not None
        return self.curve.seconds(job_seconds_sum / self.job_step_seconds(None))

    def step_function(self) -> Callable[[float], float] | None:
        """Step seconds from the sum of a batch's job seconds when the step is curved; None when it
        is ``intercept + sum`` (callers keep their linear arithmetic, exactly as before)."""
        return self.curved_step if self.curve is not None else None

    # -- load latency --------------------------------------------------------------------------
    def load_seconds(self, nbytes: float, tier: str = "local") -> float:
        fit = self.tiers.get(tier)
        if fit is None:
            raise KeyError(f"cost model has no load fit for tier {tier!r} (has {sorted(self.tiers)})")
        return fit.seconds(nbytes)

    def template_fetch_seconds(self, steps: int, tier: str = "local") -> float:
        """Fetching a template's whole activation cache (``steps`` steps) from ``tier`` to RAM."""
        if tier not in self.tiers:
            return 0.0
        return self.load_seconds(steps * self.arch.cache_bytes_per_step(), tier)

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "model_id": self.model_id, "device_kind": self.device_kind,
            "arch": self.arch.to_dict(),
            "step": {"features": list(STEP_FEATURES), "intercept": self.intercept, "coef": list(self.coef),
                     "report": self.step_report.to_dict() if self.step_report else None},
            "load": {name: {"latency_s": t.latency_s, "bytes_per_s": t.bytes_per_s,
                            "report": t.report.to_dict() if t.report else None} for name, t in self.tiers.items()},
            "meta": self.meta,
            **({"batch": self.batch.to_dict()} if self.batch is not None else {}),
            **({"curve": self.curve.to_dict()} if self.curve is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a Stencil cost model (format {d.get('format')!r})")
        if int(d.get("version", 0)) != VERSION:
            raise ValueError(f"cost model version {d.get('version')} is not supported (want {VERSION})")
        step = d["step"]
        if list(step["features"]) != list(STEP_FEATURES):
            raise ValueError(f"cost model features {step['features']} differ from {list(STEP_FEATURES)}")
        tiers = {name: TierFit(float(t["latency_s"]), float(t["bytes_per_s"]),
                               FitReport.from_dict(t["report"]) if t.get("report") else None)
                 for name, t in d.get("load", {}).items()}
        return cls(model_id=d["model_id"], device_kind=d["device_kind"], arch=UNetArch.from_dict(d["arch"]),
                   intercept=float(step["intercept"]), coef=tuple(float(c) for c in step["coef"]),
                   tiers=tiers, step_report=FitReport.from_dict(step["report"]) if step.get("report") else None,
                   meta=dict(d.get("meta", {})),
                   batch=BatchPredictor.from_dict(d["batch"]) if d.get("batch") else None,
                   curve=StepCurve.from_dict(d["curve"]) if d.get("curve") else None)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def proxy(cls, arch: UNetArch, macs_per_second: float = 2e10) -> "CostModel":
        """An unfitted stand-in (FLOPs at a nominal rate): right ordering, rough seconds."""
        coef = (1e9 / macs_per_second, 1e9 / macs_per_second, 1e9 / macs_per_second, 1e6 / 2e9, 1e-3)
        return cls(model_id="proxy", device_kind="nominal", arch=arch, intercept=1e-3, coef=coef,
                   meta={"proxy": True, "created": time.time()})


def min_service_seconds(model: CostModel, steps: int, *, mask_ratio: float = 1.0,
                        masked_tokens: Sequence[int] | None = None, cached: bool = True,
                        latent_hw: tuple[int, int] | None = None, rows: int = 2) -> float:
    """Fastest denoising time of a job: alone on an idle worker (SLO lower bound). With the
    resolution-aware batch predictor and the job's latent size, that predictor's; else the linear
    model's (at the model's profiled size)."""
    if model.batch is not None and latent_hw is not None:
        levels = model.batch.spec.levels
        tokens = masked_tokens if cached and masked_tokens is not None and len(masked_tokens) == levels else None
        if cached and tokens is None and 0.0 < mask_ratio < 1.0:  # estimated at the job's own size
            tokens = dataclasses.replace(model.arch, latent_hw=tuple(latent_hw)).tokens_from_ratio(mask_ratio)[:levels]
        shape = JobShape(tuple(latent_hw), tuple(tokens) if tokens is not None else None, rows)  # type: ignore[arg-type]
        return model.batch.alone_seconds(shape, steps)
    if model.curve is not None:
        return steps * model.curved_step(model.job_seconds(mask_ratio=mask_ratio, masked_tokens=masked_tokens,
                                                           cached=cached))
    return steps * (model.intercept + model.job_seconds(mask_ratio=mask_ratio, masked_tokens=masked_tokens,
                                                        cached=cached))


def step_time_predictor(model: CostModel) -> Callable[[Sequence[Any]], float]:
    """``BatchScheduler(step_time=...)`` from a cost model; jobs need ``mask_ratio``,
    ``masked_tokens`` and ``cached`` attributes (``EngineJob`` has them), and for the
    resolution-aware batch predictor (used when the model has one) ``latent_hw`` and ``rows``."""
    batch = model.batch
    if batch is not None:
        levels, default_hw = batch.spec.levels, tuple(model.arch.latent_hw)

        def shape(job: Any) -> JobShape:
            cached = getattr(job, "_step_shape", None)  # a job's shape never changes: computed once
            if cached is None:
                cached = engine_job_shape(job, levels, default_hw)  # type: ignore[arg-type]
                try:
                    job._step_shape = cached
                except AttributeError:
                    pass
            return cached

        def predict_batch(jobs: Sequence[Any]) -> float:
            return batch.step_seconds([shape(j) for j in jobs])

        def predict_sets(jobs: Sequence[Any], sets: Any) -> Any:
            return batch.predict_sets([shape(j) for j in jobs], sets)

        predict_batch.predict_sets = predict_sets  # type: ignore[attr-defined]
        return predict_batch

    if model.curve is not None:
        def predict_curve(jobs: Sequence[Any]) -> float:
            return model.curved_step(sum(
                model.job_seconds(mask_ratio=j.mask_ratio, masked_tokens=j.masked_tokens, cached=j.cached)
                for j in jobs))

        return predict_curve

    def predict(jobs: Sequence[Any]) -> float:
        return model.intercept + sum(
            model.job_seconds(mask_ratio=j.mask_ratio, masked_tokens=j.masked_tokens, cached=j.cached) for j in jobs)

    return predict


SLO_ADMISSION_MODES = ("auto", "on", "off")


def slo_admission_on(mode: str, model: CostModel | None) -> bool:
    """Whether an engine runs SLO-aware admission (``STENCIL_SLO_ADMISSION``): never without a fitted
    model; ``auto`` only with the resolution-aware batch predictor (a single-size linear model
    mispredicts mixed-size batches); ``on`` (also 1/true/yes) with any fitted model."""
    mode = (mode or "auto").strip().lower()
    mode = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "auto"}.get(mode, mode)
    if mode not in SLO_ADMISSION_MODES:
        raise ValueError(f"STENCIL_SLO_ADMISSION must be one of {SLO_ADMISSION_MODES}, got {mode!r}")
    if model is None or mode == "off":
        return False
    return mode == "on" or model.batch is not None


def default_path(home: Path, model_id: str, device_kind: str) -> Path:
    """Where ``ops.bench.profile`` writes a model by default: ``<home>/costmodels/<model>--<device>.json``."""
    safe = lambda s: "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in s)  # noqa: E731
    return home / "costmodels" / f"{safe(model_id)}--{safe(device_kind)}.json"


def find_model(home: Path, model_id: str, explicit: str = "") -> CostModel | None:
    """The configured model file, else the newest one for ``model_id`` under ``home``, else None."""
    if explicit:
        return CostModel.load(explicit)
    folder = home / "costmodels"
    if not folder.is_dir():
        return None
    prefix = default_path(home, model_id, "x").name.split("--")[0] + "--"
    files = sorted((p for p in folder.glob(prefix + "*.json")), key=lambda p: p.stat().st_mtime)
    return CostModel.load(files[-1]) if files else None


# Cost models fitted on this repository's reference machine for its embedded models
# (ops/bench/profile.py wrote them), used for routing when a deployment fitted none of its own.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "ops" / "sim" / "costmodels"


def device_type(device: str) -> str:
    """``cuda:1`` -> ``cuda``: the part of a device name a cost model's ``device_kind`` starts with."""
    return device.split(":", 1)[0].strip().lower()


def shipped_model(model_id: str, device: str, blocks: tuple[BlockSpec, ...] | None = None,
                  folder: Path = SHIPPED_DIR) -> tuple[CostModel, Path] | None:
    """The shipped cost model that fits the configured model on ``device``: fitted on the same device
    type, for the same model id or (``blocks``: the model's transformer blocks, from its UNet config)
    the same architecture; by the id before the architecture, measured before projected. None if none."""
    if not folder.is_dir():
        return None
    fits = []
    for path in sorted(folder.glob("*--*.json")):
        if path.name.endswith(".points.json"):
            continue
        model = CostModel.load(path)
        same_id, same_arch = model.model_id == model_id, blocks is not None and model.arch.blocks == blocks
        if (same_id or same_arch) and model.device_kind.split("-", 1)[0] == device_type(device):
            fits.append((not same_id, "projected" in model.device_kind, path.name, model, path))
    if not fits:
        return None
    *_, model, path = min(fits, key=lambda f: f[:3])
    return model, path


# -- integrating step times over a batch's future -----------------------------------------------


def finish_times(remaining: Sequence[int], step_time: Callable[[Sequence[int]], float]) -> list[float]:
    """Seconds until each job finishes if the batch runs with no further admissions.

    ``step_time(active_indices)`` predicts one step of the jobs still running; jobs leave as they
    finish, so later steps are cheaper. Used by SLO admission (general predictor).
    """
    order = sorted(range(len(remaining)), key=lambda i: remaining[i])
    out = [0.0] * len(remaining)
    t = 0.0
    done = 0
    active = list(order)
    pos = 0
    while pos < len(order):
        k = remaining[order[pos]] - done
        if k > 0:
            t += k * step_time(active)
            done += k
        while pos < len(order) and remaining[order[pos]] <= done:
            out[order[pos]] = t
            active.remove(order[pos])
            pos += 1
    return out


def admission_profile(running: Sequence[tuple[float, int]], queued: Sequence[tuple[float, int]],
                      max_batch: int, intercept: float, step: Callable[[float], float] | None = None
                      ) -> tuple[float, list[tuple[float, int]]]:
    """When would a job placed after ``queued`` get a batch slot, and who runs with it then?

    ``running``: (marginal step seconds, remaining steps) of the batch; ``queued``: jobs admitted
    in order into free slots as running ones finish (continuous batching). Returns (seconds until
    a slot is free for one more job, [(step seconds, remaining steps)] of the jobs alive then).
    Independent of the job being placed, so routers cache it per worker state. ``step``: a curved
    step from the sum of job seconds (``CostModel.step_function``); None = ``intercept + sum``.
    """
    import heapq

    heap: list[tuple[int, float]] = []  # (step index at which the job finishes, its step seconds)
    step_sum = 0.0
    done = 0
    t = 0.0
    for sec, rem in running[:max_batch]:
        heap.append((rem, sec))
        step_sum += sec
    heapq.heapify(heap)
    queue = list(running[max_batch:]) + list(queued)
    qi = 0
    while True:
        while qi < len(queue) and len(heap) < max_batch:
            sec, rem = queue[qi]
            heapq.heappush(heap, (done + rem, sec))
            step_sum += sec
            qi += 1
        if qi == len(queue) and len(heap) < max_batch:
            return t, [(sec, end - done) for end, sec in heap]
        end = heap[0][0]
        if end > done:
            t += (end - done) * (intercept + step_sum if step is None else step(step_sum))
            done = end
        while heap and heap[0][0] <= done:
            step_sum -= heapq.heappop(heap)[1]


def finish_after_admission(t_admit: float, alive: Sequence[tuple[float, int]], job_seconds: float,
                           steps: int, intercept: float, step: Callable[[float], float] | None = None) -> float:
    """Seconds until a job admitted at ``t_admit`` finishes: every step costs the intercept, its own
    seconds and those of the jobs still alive (each alive job shares ``min(remaining, steps)``).
    With a curved ``step`` (``admission_profile``) each step costs ``step(sum of the seconds of the jobs
    in it)``, integrated as the alive jobs leave."""
    if step is not None:
        t = t_admit
        in_step = job_seconds + sum(g for g, _ in alive)
        done = 0
        for g, r in sorted(alive, key=lambda a: a[1]):
            if r >= steps:
                break
            t += (r - done) * step(in_step)
            done = r
            in_step -= g
        return t + (steps - done) * step(in_step)
    t = t_admit + steps * (intercept + job_seconds)
    for g, r in alive:
        t += g * (r if r < steps else steps)
    return t


def queue_finish_time(running: Sequence[tuple[float, int]], queued: Sequence[tuple[float, int]],
                      max_batch: int, intercept: float, step: Callable[[float], float] | None = None) -> float:
    """Seconds until the LAST entry of ``queued`` finishes on a worker (linear step model).

    The paper's Algorithm 2 cost: the batch's predicted step latency integrated over the steps
    until the new job is done, with jobs leaving as they finish and queued ones taking free slots.
    """
    if not queued:
        raise ValueError("queued must end with the job whose finish time is wanted")
    t_admit, alive = admission_profile(running, queued[:-1], max_batch, intercept, step)
    sec, steps = queued[-1]
    return finish_after_admission(t_admit, alive, sec, steps, intercept, step)


__all__ = [
    "BlockSpec", "CostModel", "FitReport", "STEP_FEATURES", "TierFit", "UNetArch", "admission_profile",
    "SHIPPED_DIR", "StepCurve", "default_path", "device_type", "find_model", "finish_after_admission",
    "finish_times", "fit_step_curve", "level_hw",
    "min_service_seconds", "shipped_model",
    "queue_finish_time", "slo_admission_on", "step_time_predictor", "token_counts_from_mask",
]
