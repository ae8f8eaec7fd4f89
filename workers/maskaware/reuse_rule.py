"""Which patches temporal reuse may take from the last step: a small random forest, served with numpy.

Trained by ``python -m ops.train.reuse_rule`` on errors recorded from real edits (the trained
models, the traces' masks, guidance 1 / 3 / 7.5): for every computed patch, the features of
``reuse.FEATURES`` at step t and whether reusing it at step t + 1 would have stayed within the
error bound ``tau`` (relative L2 error of the unit's output over the patch). The forest predicts
that; a patch is reused where the trees' mean vote for "safe" reaches ``cut`` and its measured
error lies within the training data's range (``err_limit``: trees extrapolate flat, so an error
far beyond any they saw would get the vote of the largest ones). The file keeps the
command, the data's size and the held-out accuracy beside the plain threshold rule's (reuse where
the last measured error is below ``tau``), the baseline it must beat.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from workers.maskaware.reuse import FEATURES

RULE_FILE = Path(__file__).with_name("reuse_rule.json")
RULE_FILES = {"sd": RULE_FILE, "flux": Path(__file__).with_name("reuse_rule_flux.json")}  # per model family


@dataclass
class Tree:
    """One decision tree as arrays (scikit-learn's layout; a leaf has feature -1)."""

    feature: np.ndarray
    threshold: np.ndarray
    left: np.ndarray
    right: np.ndarray
    value: np.ndarray  # per node: share of "safe" among its training samples

    def predict(self, x: np.ndarray) -> np.ndarray:
        node = np.zeros(len(x), dtype=np.int64)
        rows = np.arange(len(x))
        while True:
            f = self.feature[node]
            inner = f >= 0
            if not inner.any():
                return self.value[node]
            go_left = x[rows, np.maximum(f, 0)] <= self.threshold[node]
            node = np.where(inner, np.where(go_left, self.left[node], self.right[node]), node)


class ForestRule:
    """The shipped rule: reuse a patch where the forest's mean "safe" vote is at least ``cut``."""

    name = "forest"

    def __init__(self, trees: list[Tree], cut: float, tau: float, features: tuple[str, ...] = FEATURES,
                 about: dict | None = None, err_limit: float = math.inf) -> None:
        if tuple(features) != FEATURES:
            raise ValueError(f"rule trained on features {features}, the engine computes {FEATURES}")
        self.trees, self.cut, self.tau, self.about = trees, cut, tau, about or {}
        self.err_limit = err_limit  # the largest error in the training data (inf: not recorded)

    def safe_probability(self, x: np.ndarray) -> np.ndarray:
        return np.mean([t.predict(x) for t in self.trees], axis=0) if len(x) else np.zeros(0)

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return (self.safe_probability(features) >= self.cut) & (features[:, _ERR] <= self.err_limit)

    def to_json(self) -> dict:
        limit = {"err_limit": float(f"{self.err_limit:.6g}")} if math.isfinite(self.err_limit) else {}
        return {"features": list(FEATURES), "tau": self.tau, "cut": self.cut, **limit, "about": self.about,
                "trees": [{"feature": t.feature.tolist(), "threshold": [float(f"{v:.6g}") for v in t.threshold],
                           "left": t.left.tolist(), "right": t.right.tolist(),
                           "value": [round(float(v), 4) for v in t.value]} for t in self.trees]}

    @classmethod
    def from_json(cls, data: dict) -> "ForestRule":
        trees = [Tree(np.asarray(t["feature"], np.int64), np.asarray(t["threshold"], float),
                      np.asarray(t["left"], np.int64), np.asarray(t["right"], np.int64),
                      np.asarray(t["value"], float)) for t in data["trees"]]
        return cls(trees, float(data["cut"]), float(data["tau"]), tuple(data["features"]), data.get("about"),
                   float(data.get("err_limit", math.inf)))


_ERR = FEATURES.index("err")


class ThresholdRule:
    """The baseline: reuse a patch where its last measured error is below ``tau``."""

    name = "threshold"

    def __init__(self, tau: float) -> None:
        self.tau = tau

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return features[:, _ERR] < self.tau


@lru_cache(maxsize=None)
def default_rule(family: str = "sd") -> ForestRule:
    """The shipped forest of a model family (``RULE_FILES``): errors are measured per family's
    units (a UNet's transformer output, a Flux block's residual), so each has its own."""
    path = RULE_FILES[family]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run python -m ops.train.reuse_rule --family {family}")
    return ForestRule.from_json(json.loads(path.read_text()))


__all__ = ["ForestRule", "RULE_FILE", "RULE_FILES", "ThresholdRule", "Tree", "default_rule"]
