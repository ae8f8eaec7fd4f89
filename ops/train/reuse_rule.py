"""Train temporal reuse's rule (``workers/maskaware/reuse_rule.py``) on errors recorded from real edits.

Records: edits of the traces (``ops/data/mask_ratios``: ratios, ``app.maskgen`` shapes) on a
family's trained model (``--family``: SD or Flux, one rule each), the templates warmed as
production warms them, guidance 1 / 3 / 7.5, 20 and 50
steps, run as ``turbo`` with a recording rule that never reuses (so the trajectory is ``fast``'s)
and logs, per step, unit and patch, the relative error reuse would have made with the offset of
one step ago (``err``) and of two steps ago (``err2``: what is measured after a reused step).

Samples: a decision at step t for step t + 1 sees ``reuse.FEATURES`` built from the error measured
at t (age 1, or age 2 from ``err2``: the engine meets both) and is labelled safe when the error at
t + 1 with the one-step-old offset stays below ``--tau``. Runs are split by edit: the held-out
edits give the accuracy of the forest and of the threshold rule (reuse where the measured error is
below ``tau``) on the same samples, and the reuse each rule would allow.

    python -m ops.train.reuse_rule --edits 6                  # SD: workers/maskaware/reuse_rule.json
    python -m ops.train.reuse_rule --family flux --edits 6    # Flux: workers/maskaware/reuse_rule_flux.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from workers.maskaware.reuse import FEATURES
from workers.maskaware.reuse_rule import RULE_FILES, ForestRule, Tree

log = logging.getLogger(__name__)


class Recorder:
    """A rule that never reuses and keeps every step's errors (``TemporalReuse`` calls ``observe``)."""

    name = "record"
    record = True

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []

    def reuse(self, features: np.ndarray) -> np.ndarray:
        return np.zeros(len(features), bool)

    def observe(self, entry: dict[str, Any]) -> None:
        self.log.append(entry)


def record_runs(edits: int, guidance: list[float], steps: list[int], seed: int, family: str = "sd") -> list[dict]:
    """One record per (edit, guidance, steps): its edit id and its per-step unit logs."""
    from ops.bench.harness.edits import OPTIONS, TRACE_NAMES, Family, edit, trace_edits

    fam = Family(family)
    rng = np.random.default_rng(seed)
    runs = []
    for n_steps in steps:
        for g in guidance:
            templates, keys = fam.warmed_templates(n_steps, g)
            for trace in TRACE_NAMES:
                for k, mask, t, params in trace_edits(rng, trace, edits, fam.size, len(templates), n_steps, g):
                    rec = Recorder()
                    fam.runner_ma.reuse_rule = rec
                    edit(fam, OPTIONS["turbo"], templates[t], mask, params, keys[t])
                    runs.append({"edit": f"{trace}-{k}", "guidance": g, "steps": n_steps, "log": rec.log})
            log.info("recorded %d runs (steps %d, guidance %g)", len(runs), n_steps, g)
    fam.runner_ma.reuse_rule = None
    return runs


def samples(run: dict, tau: float, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(features, safe) of every decision of one run (module doc): a first reuse (``run`` 0) judged
    by the next step's error with the one-step-old offset, a second one in a row (``run`` 1) by
    the error two steps after the measurement with the two-steps-old offset."""
    by_unit: dict[str, dict[int, dict]] = {}
    for e in run["log"]:
        by_unit.setdefault(e["unit"], {})[e["step"]] = e
    last = run["steps"] - 1
    xs, ys = [], []

    def add(e: dict, err: np.ndarray, age: np.ndarray, nxt: int, reused: int, label: np.ndarray) -> None:
        cols = [np.full(len(err), nxt / max(1, last)), err, age.astype(float), np.full(len(err), err.mean()),
                np.full(len(err), err.max()), np.full(len(err), e["n"] / max_tokens), np.full(len(err), e["depth"]),
                np.full(len(err), run["guidance"]), np.full(len(err), float(reused))]
        xs.append(np.stack(cols, axis=1))
        ys.append(label)

    for per_step in by_unit.values():
        for t, e in per_step.items():
            measured = [(e["err"], e["age"])]  # as measured after a computed step ...
            if (e["age"] == 1).all() and t - 2 in per_step:
                measured.append((e["err2"], e["age"] + 1))  # ... and after a reused one
            one, two = per_step.get(t + 1), per_step.get(t + 2)
            if one is not None and t + 1 < last and (one["age"] == 1).all():
                for err, age in measured:
                    add(e, err, age, t + 1, 0, one["err"] < tau)
                if two is not None and t + 2 < last and (two["age"] == 1).all():
                    for err, age in measured:
                        add(e, err, age, t + 2, 1, two["err2"] < tau)
    if not xs:
        return np.zeros((0, len(FEATURES))), np.zeros(0, bool)
    return np.concatenate(xs), np.concatenate(ys)


def to_trees(forest: Any) -> list[Tree]:
    """A fitted ``RandomForestClassifier`` as numpy arrays (class 1 = safe)."""
    safe = list(forest.classes_).index(True)
    trees = []
    for est in forest.estimators_:
        t = est.tree_
        value = t.value[:, 0, :]
        share = value[:, safe] / value.sum(axis=1)
        trees.append(Tree(t.feature.astype(np.int64), t.threshold.astype(float), t.children_left.astype(np.int64),
                          t.children_right.astype(np.int64), share))
    return trees


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(RULE_FILES), default="sd", help="the model family the rule serves")
    p.add_argument("--edits", type=int, default=6, help="edits per trace, guidance and step count")
    p.add_argument("--guidance", default="1.0,3.0,7.5")
    p.add_argument("--steps", default="20,50")
    p.add_argument("--tau", type=float, default=0.1, help="largest relative error of a safe reuse")
    p.add_argument("--cut", type=float, default=0.5, help="the forest's 'safe' vote needed to reuse")
    p.add_argument("--trees", type=int, default=8)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="default: the family's shipped rule file")
    p.add_argument("--records", default="", help="JSON of the recorded runs: read if it exists, else written "
                   "(retrain with other --tau / --cut without recording again)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 edit per trace, 20 steps, guidance 7.5")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from sklearn.ensemble import RandomForestClassifier

    from ops.bench.harness.edits import DEFAULT_MODELS

    torch.set_num_threads(1)
    if args.quick:
        args.edits, args.guidance, args.steps, args.trees = 1, "7.5", "20", 4
    started = time.time()
    saved = Path(args.records) if args.records else None
    if saved is not None and saved.is_file():
        runs = [dict(r, log=[{k: np.asarray(v) if isinstance(v, list) else v for k, v in e.items()} for e in r["log"]])
                for r in json.loads(saved.read_text())]
    else:
        runs = record_runs(args.edits, [float(g) for g in args.guidance.split(",")],
                           [int(s) for s in args.steps.split(",")], args.seed, args.family)
        if saved is not None:
            saved.write_text(json.dumps([dict(r, log=[{k: v.tolist() if isinstance(v, np.ndarray) else v
                                                        for k, v in e.items()} for e in r["log"]]) for r in runs]))
    max_tokens = max(e["n"] for r in runs for e in r["log"])
    edits = sorted({r["edit"] for r in runs})
    held = set(edits[::3])  # every third edit (of each trace) held out, over all its runs
    parts: dict[bool, list[tuple[np.ndarray, np.ndarray]]] = {True: [], False: []}
    for r in runs:
        parts[r["edit"] in held].append(samples(r, args.tau, max_tokens))
    x_tr, y_tr = (np.concatenate([a for a, _ in parts[False]]), np.concatenate([b for _, b in parts[False]]))
    x_te, y_te = (np.concatenate([a for a, _ in parts[True]]), np.concatenate([b for _, b in parts[True]]))
    forest = RandomForestClassifier(n_estimators=args.trees, max_depth=args.depth, min_samples_leaf=20,
                                    random_state=args.seed, n_jobs=1).fit(x_tr, y_tr)
    rule = ForestRule(to_trees(forest), args.cut, args.tau, err_limit=float(x_tr[:, FEATURES.index("err")].max()))
    pred_f = rule.reuse(x_te)
    pred_t = x_te[:, FEATURES.index("err")] < args.tau

    def scores(pred: np.ndarray) -> dict[str, float]:
        return {"accuracy": round(float((pred == y_te).mean()), 4),
                "reuse_share": round(float(pred.mean()), 4),  # of the held-out decisions
                "unsafe_share_of_reuses": round(float((pred & ~y_te).sum() / max(1, pred.sum())), 4)}

    given = list(sys.argv[1:] if argv is None else argv)
    for flag in ("--records", "--out"):  # where the recording is cached or the rule written: not what it is
        if flag in given:
            i = given.index(flag)
            del given[i:i + 2]
    command = " ".join(["python -m ops.train.reuse_rule", *given])
    rule.about = {"command": command.strip(), "runs": len(runs), "train_samples": int(len(y_tr)),
                  "held_out_samples": int(len(y_te)), "held_out_edits": sorted(held),
                  "safe_share_held_out": round(float(y_te.mean()), 4),
                  "forest": scores(pred_f), "threshold_rule": scores(pred_t),
                  "model": DEFAULT_MODELS[args.family], "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out or RULE_FILES[args.family])
    out.write_text(json.dumps(rule.to_json(), separators=(",", ":")) + "\n")
    log.info("held out: forest %s; threshold %s; wrote %s in %.0f s", rule.about["forest"],
             rule.about["threshold_rule"], out, time.time() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
