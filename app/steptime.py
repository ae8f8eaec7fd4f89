"""Resolution-aware step time of a batch: an SVR on per-size job counts and token counts, kept as JSON.

Why. A batch that mixes image sizes runs one denoiser call per size (in lockstep, the transformer
blocks packing every size's tokens, ``workers/maskaware/lockstep.py``, or one after the other:
``workers.engine.sd_runner.mixed_size_calls``), so its step time depends on how many jobs of each size it holds,
how many tokens each computes per level (masked or full) and how many rows (CFG) each brings: a
single-size linear model cannot say what such a batch costs. PatchedServe predicts step latency with an SVR on task counts per resolution
and token counts; this module does the same with features that know resolutions and sizes
(``FeatureSpec``): per level the full-map tokens (convolutions), the computed tokens (token-wise
layers) and query x key pairs (self-attention), the calls (one per distinct size), jobs and rows,
and one job count per profiled size.

Where it lives. ``python -m ops.bench.profile --sizes ...`` measures mixed batches on the real
runner and fits the SVR with scikit-learn (``fit``), then stores it inside the cost-model JSON
(``CostModel.batch``): the scaler's means and scales, the support vectors, dual coefficients,
intercept and kernel parameters. The service predicts with numpy (``SVRModel.predict``): no
pickle, and no scikit-learn import outside fitting. The engine's SLO admission, the dispatcher's
deadline check and default deadlines all call ``BatchPredictor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMAT = "stencil-batch-svr"
KERNELS = ("rbf", "linear")
TARGETS = ("log", "seconds")


@dataclass(frozen=True)
class JobShape:
    """One job as the predictor sees it: its latent grid, the tokens it computes per level (None =
    every token: full compute, no cache) and its batch rows (2 with classifier-free guidance)."""

    latent_hw: tuple[int, int]
    tokens: tuple[int, ...] | None = None
    rows: int = 2


def level_grid(latent_hw: tuple[int, int], level: int) -> tuple[int, int]:
    """Feature-map size at ``level`` (stride-2 downsampling with ceil, as the UNet)."""
    h, w = latent_hw
    for _ in range(level):
        h, w = (h + 1) // 2, (w + 1) // 2
    return h, w


@dataclass(frozen=True)
class FeatureSpec:
    """How a batch becomes a feature vector (module docstring); stored with the model."""

    levels: int
    sizes: tuple[tuple[int, int], ...] = ()  # latent sizes with a job-count feature of their own

    def names(self) -> list[str]:
        out = ["jobs", "calls", "rows", "masked_jobs", "masked_rows_full0"]
        for lvl in range(self.levels):
            out += [f"full_l{lvl}", f"computed_l{lvl}", f"attn_l{lvl}"]
        out += [f"jobs_{h}x{w}" for h, w in self.sizes]
        return out

    def level_tokens(self, latent_hw: tuple[int, int]) -> list[int]:
        return [a * b for a, b in (level_grid(latent_hw, lvl) for lvl in range(self.levels))]

    def features(self, jobs: Sequence[JobShape]) -> list[float]:
        """The batch's features (sums over its jobs; token counts in thousands)."""
        n_lvl = self.levels
        full = [0.0] * n_lvl
        comp = [0.0] * n_lvl
        attn = [0.0] * n_lvl
        rows = masked = masked_full0 = 0.0
        per_size = [0.0] * len(self.sizes)
        size_index = {s: i for i, s in enumerate(self.sizes)}
        for job in jobs:
            totals = self.level_tokens(job.latent_hw)
            r = job.rows
            rows += r
            tokens = job.tokens if job.tokens is not None and len(job.tokens) == n_lvl else None
            if tokens is not None and all(t >= n for t, n in zip(tokens, totals)):
                tokens = None  # a mask covering everything computes like full compute
            if tokens is not None:
                masked += 1
                masked_full0 += r * totals[0] / 1e3
            for lvl, n in enumerate(totals):
                m = n if tokens is None else min(n, int(tokens[lvl]))
                full[lvl] += r * n / 1e3
                comp[lvl] += r * m / 1e3
                attn[lvl] += r * m * n / 1e6
            i = size_index.get(tuple(job.latent_hw))  # type: ignore[arg-type]
            if i is not None:
                per_size[i] += 1
        out = [float(len(jobs)), float(len({tuple(j.latent_hw) for j in jobs})), rows, masked, masked_full0]
        for lvl in range(n_lvl):
            out += [full[lvl], comp[lvl], attn[lvl]]
        return out + per_size

    def to_dict(self) -> dict[str, Any]:
        return {"levels": self.levels, "sizes": [list(s) for s in self.sizes], "names": self.names()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FeatureSpec":
        spec = cls(int(d["levels"]), tuple((int(h), int(w)) for h, w in d.get("sizes", ())))
        if "names" in d and list(d["names"]) != spec.names():
            raise ValueError(f"step-time features {d['names']} differ from this version's {spec.names()}")
        return spec


@dataclass
class SVRModel:
    """A fitted epsilon-SVR with its input scaler, as plain arrays: ``predict`` is numpy only.

    decision(x) = sum_i dual_i * K(sv_i, (x - mean) / scale) + intercept; the target is seconds or
    log(seconds). Kernels: rbf (exp(-gamma |a - b|^2)) and linear (a . b), as scikit-learn's.
    """

    kernel: str
    gamma: float
    mean: np.ndarray
    scale: np.ndarray
    support: np.ndarray  # (n_support, n_features), in scaled units
    dual: np.ndarray  # (n_support,)
    intercept: float
    target: str = "log"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        self.mean = np.asarray(self.mean, dtype=np.float64)
        self.scale = np.asarray(self.scale, dtype=np.float64)
        self.support = np.asarray(self.support, dtype=np.float64).reshape(-1, len(self.mean))
        self.dual = np.asarray(self.dual, dtype=np.float64).reshape(-1)
        # The linear kernel collapses to one weight vector (same sum, fewer operations).
        self._w = self.dual @ self.support if self.kernel == "linear" else None
        self._sv_sq = (self.support ** 2).sum(axis=1)

    def decision(self, x: np.ndarray) -> np.ndarray:
        xs = (np.atleast_2d(np.asarray(x, dtype=np.float64)) - self.mean) / self.scale
        if self._w is not None:
            return xs @ self._w + self.intercept
        sq = (xs ** 2).sum(axis=1)[:, None] + self._sv_sq[None, :] - 2.0 * xs @ self.support.T
        return np.exp(-self.gamma * np.maximum(sq, 0.0)) @ self.dual + self.intercept

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Seconds for each row of ``x`` (raw features)."""
        d = self.decision(x)
        return np.exp(d) if self.target == "log" else np.maximum(d, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "gamma": self.gamma, "target": self.target,
                "scaler_mean": self.mean.tolist(), "scaler_scale": self.scale.tolist(),
                "support_vectors": self.support.tolist(), "dual_coef": self.dual.tolist(),
                "intercept": self.intercept}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SVRModel":
        return cls(kernel=str(d["kernel"]), gamma=float(d["gamma"]), mean=np.array(d["scaler_mean"]),
                   scale=np.array(d["scaler_scale"]), support=np.array(d["support_vectors"]),
                   dual=np.array(d["dual_coef"]), intercept=float(d["intercept"]), target=str(d.get("target", "log")))

    @classmethod
    def from_sklearn(cls, scaler: Any, svr: Any, target: str) -> "SVRModel":
        """From a fitted ``StandardScaler`` and ``SVR`` (numeric gamma; the attributes are public)."""
        if not isinstance(svr.gamma, (int, float)):
            raise ValueError("fit the SVR with a numeric gamma (it is stored as a number)")
        return cls(kernel=svr.kernel, gamma=float(svr.gamma), mean=scaler.mean_, scale=scaler.scale_,
                   support=svr.support_vectors_, dual=svr.dual_coef_[0], intercept=float(svr.intercept_[0]),
                   target=target)


@dataclass
class BatchPredictor:
    """Seconds of one denoising step of a batch of ``JobShape``s (memoized per composition)."""

    spec: FeatureSpec
    svr: SVRModel
    vae_factor: int = 8
    report: dict[str, Any] = field(default_factory=dict)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def features(self, jobs: Sequence[JobShape]) -> list[float]:
        return self.spec.features(jobs)

    def step_seconds(self, jobs: Sequence[JobShape]) -> float:
        if not jobs:
            return 0.0
        key = tuple(sorted(jobs, key=_order))
        value = self._memo.get(key)
        if value is None:
            value = float(self.svr.predict(np.array([self.spec.features(key)]))[0])
            if len(self._memo) > 200_000:
                self._memo.clear()
            self._memo[key] = value
        return value

    def job_row(self, job: JobShape) -> np.ndarray:
        """Features of ``job`` as a batch of its own (memoized; batch features are sums of these,
        except ``calls``)."""
        key = ("row", job)
        row = self._memo.get(key)
        if row is None:
            row = np.array(self.spec.features([job]), dtype=np.float64)
            self._memo[key] = row
        return row

    def predict_sets(self, jobs: Sequence[JobShape], sets: np.ndarray) -> np.ndarray:
        """Step seconds of many batches at once: row ``k`` of the boolean ``sets`` (batches x jobs)
        selects the jobs of batch ``k``. One numpy pass (SLO admission asks for dozens per step)."""
        sets = np.asarray(sets, dtype=np.float64)
        x = sets @ np.stack([self.job_row(j) for j in jobs])
        sizes = {hw: i for i, hw in enumerate(dict.fromkeys(j.latent_hw for j in jobs))}
        onehot = np.zeros((len(jobs), len(sizes)))
        onehot[np.arange(len(jobs)), [sizes[j.latent_hw] for j in jobs]] = 1.0
        x[:, 1] = ((sets @ onehot) > 0).sum(axis=1)  # calls: one per distinct size
        out = self.svr.predict(x)
        out[sets.sum(axis=1) == 0] = 0.0
        return out

    def alone_seconds(self, job: JobShape, steps: int) -> float:
        """Denoising time of ``job`` alone on an idle worker (its SLO reference)."""
        return steps * self.step_seconds([job])

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        """The latent grid of an image processed at ``height`` x ``width`` pixels."""
        return max(1, height // self.vae_factor), max(1, width // self.vae_factor)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "features": self.spec.to_dict(), "svr": self.svr.to_dict(),
                "vae_factor": self.vae_factor, "report": self.report}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BatchPredictor":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a batch step-time predictor (format {d.get('format')!r})")
        return cls(FeatureSpec.from_dict(d["features"]), SVRModel.from_dict(d["svr"]),
                   int(d.get("vae_factor", 8)), dict(d.get("report") or {}))


def _order(job: JobShape) -> tuple[Any, ...]:
    return (job.latent_hw, job.rows, job.tokens is None, job.tokens or ())


def engine_job_shape(job: Any, levels: int, default_hw: tuple[int, int]) -> JobShape:
    """A ``JobShape`` from an engine (or simulated) job: ``latent_hw``, ``rows``, ``cached`` and
    ``masked_tokens`` attributes; a job whose tokens do not cover every level counts as full."""
    hw = getattr(job, "latent_hw", None) or default_hw
    tokens = getattr(job, "masked_tokens", None)
    if not getattr(job, "cached", False) or tokens is None or len(tokens) != levels:
        tokens = None
    return JobShape(tuple(hw), tuple(int(t) for t in tokens) if tokens is not None else None,  # type: ignore[arg-type]
                    int(getattr(job, "rows", 2) or 2))


# -- fitting (scikit-learn, at profile time only) --------------------------------------------------


def mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y))


def fit(x: np.ndarray, y: np.ndarray, *, seed: int = 0, kernels: Sequence[str] = KERNELS,
        targets: Sequence[str] = TARGETS, folds: int = 5,
        linear_margin: float = 0.005) -> tuple[SVRModel, dict[str, Any]]:
    """The SVR (kernel, target, C, gamma, epsilon) with the lowest cross-validated MAPE on (x, y)
    (a linear kernel within ``linear_margin`` of it preferred), refitted on all of it.
    scikit-learn is imported here only: serving never needs it."""
    from sklearn.model_selection import KFold
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n_feat = x.shape[1]
    grid = []
    for kernel in kernels:
        for target in targets:
            if kernel == "linear" and target == "log":
                continue  # step time is about linear in the features: exp(linear) is the wrong shape
            eps_grid = (0.005, 0.02, 0.05) if target == "log" else tuple(float(e) * float(np.median(y))
                                                                       for e in (0.005, 0.02, 0.05))
            # libsvm's linear kernel converges slowly at large C (minutes at C=100 on 240 points)
            for c in ((0.1, 1.0, 10.0) if kernel == "linear" else (1.0, 10.0, 100.0)):
                for eps in eps_grid:
                    gammas = (0.0,) if kernel == "linear" else tuple(g / n_feat for g in (0.03, 0.1, 0.3, 1.0))
                    grid += [(kernel, target, c, g, eps) for g in gammas]
    splits = list(KFold(min(folds, len(y)), shuffle=True, random_state=seed).split(x))

    def make(kernel: str, target: str, c: float, g: float, eps: float, xs: np.ndarray, ys: np.ndarray):  # type: ignore[no-untyped-def]
        scaler = StandardScaler().fit(xs)
        scaler.scale_ = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
        svr = SVR(kernel=kernel, C=c, epsilon=eps, gamma=g if kernel == "rbf" else 1.0)
        svr.fit(scaler.transform(xs), np.log(ys) if target == "log" else ys)
        return scaler, svr

    scores = []
    for params in grid:
        pred = np.empty(len(y))
        for tr, te in splits:
            scaler, svr = make(*params, x[tr], y[tr])
            model = SVRModel.from_sklearn(scaler, svr, params[1])
            pred[te] = model.predict(x[te])
        scores.append((mape(pred, y), params))
    if not scores:
        raise ValueError("no SVR setting to fit (kernels x targets is empty)")
    best = min(scores, key=lambda sp: sp[0])
    # A linear kernel within half a point of the best extrapolates more safely (batch sizes and image
    # sizes beyond the profiled ones): prefer it.
    linear = [sp for sp in scores if sp[1][0] == "linear" and sp[0] <= best[0] + linear_margin]
    if linear:
        best = min(linear, key=lambda sp: sp[0])
    kernel, target, c, g, eps = best[1]
    scaler, svr = make(kernel, target, c, g, eps, x, y)
    model = SVRModel.from_sklearn(scaler, svr, target)
    info = {"kernel": kernel, "target": target, "C": c, "gamma": g, "epsilon": eps, "cv_mape": best[0],
            "cv_mape_best_any": min(sp[0] for sp in scores),
            "folds": len(splits), "n_support": int(len(model.dual)), "grid": len(grid)}
    return model, info


def sklearn_predict(x: np.ndarray, y: np.ndarray, info: dict[str, Any]) -> tuple[Any, Any]:
    """(scaler, svr) of scikit-learn fitted as ``fit`` chose (for checking the JSON model against)."""
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR

    scaler = StandardScaler().fit(x)
    scaler.scale_ = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    svr = SVR(kernel=info["kernel"], C=info["C"], epsilon=info["epsilon"],
              gamma=info["gamma"] if info["kernel"] == "rbf" else 1.0)
    svr.fit(scaler.transform(x), np.log(y) if info["target"] == "log" else y)
    return scaler, svr


__all__ = ["BatchPredictor", "FeatureSpec", "JobShape", "SVRModel", "engine_job_shape", "fit", "level_grid", "mape",
           "sklearn_predict"]
