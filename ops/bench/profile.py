"""Profile the engine's runner on this device and fit the cost model (``app/costmodel.py``).

    python -m ops.bench.profile --model tiny       # embedded default, ~2 min
    python -m ops.bench.profile --model sd-l2      # SD-width blocks, ~15 min
    python -m ops.bench.profile --model tiny --sizes 128x128,96x128,128x96,128x64 --points 320
                                                   # mixed image sizes: + the batch step-time SVR

What is measured (never fake data, DESIGN.md section 3):
- Step latency: ``SDRunner.step`` (the engine's runner, with ``MaskAwareUNet`` when importable)
  on batches of 1..``--max-jobs`` CFG jobs; each job full compute (no cache) or masked (a real
  cache recorded by a warm-up run of the same runner), masks of realistic shape (blobs and
  rectangles, ``workers.maskaware.tokens``) with pixel ratios drawn from the public traces and a
  uniform spread. Each composition: one warm step, then ``--repeats`` timed steps (median).
  Compositions run in random order so drifting load on shared cores hits every kind alike.
- Load latency: ``ActivationStore.read_step`` on a local folder after evicting the file from the
  page cache (``posix_fadvise DONTNEED``), i.e. a cold disk read + safetensors parse (wall time),
  the same read warm (page cache), and a host-RAM copy (``copy_`` into a resident buffer, thread
  CPU time: on a GPU this is the H2D copy; on this CPU the runner reads host RAM directly, so it
  is an upper bound).
- Clock: by default one torch thread and the step's *thread CPU time*. This machine's 2 cores are
  shared with other jobs (load average 5-7 while profiling): wall time of identical 2-thread
  steps varied 20x (OpenMP threads spin while descheduled), so wall time measured the neighbours.
  A single thread's CPU time is what the step costs on a dedicated core. ``--clock wall`` fits
  wall time instead (use it on a dedicated machine).
- On a GPU (``--device cuda``, bfloat16 unless ``--dtype``): the period of steps run back to back
  (wall time, as the engine runs them: it launches a step while the device runs the last, so a
  step costs the longer of its host work and its kernels, not their sum), the host tier as the
  copy from pinned host memory to the device, and a device kind ``cuda-<GPU>-<dtype>``: the file
  a CUDA worker's routing and SLO admission pick (``app.costmodel.shipped_model``). A deployment
  profiles the model it serves (``--model tiny`` reads the configured model; ``--latent`` its
  size) or the true-size SD 1.5 inpainting UNet with random weights (``--model sd15-inpaint``):

      python -m ops.bench.profile --device cuda --model sd15-inpaint --points 64 --max-jobs 16

Fit: non-negative linear regression of step seconds on the features ``app.costmodel`` derives
from each job's masked tokens per level; per tier ``seconds ~ latency + bytes / bandwidth``.
A random quarter of the points is held out *before* fitting; R^2, MAPE and residuals are on
those. Output: one JSON model file (coefficients only) per (model id, device kind), and a plot.

Batch-step curve (``fit_curve``): on the same training points, ``t(W) = (h^p + (c W)^p)^(1/p)``
(``app.costmodel.StepCurve``, fitted by ``app.costmodel.fit_step_curve``, the fit the GPU simulators
use) with W a batch's work in full jobs under the linear fit. Both models' MAPE on the held-out
points goes into the JSON's meta (``step_curve``) and the report; the curve goes into the JSON
(``curve``) only where its held-out MAPE is lower by more than ``--curve-margin`` (half a point): a
host-bound GPU step, not a single CPU thread, whose step is linear and whose curve is the line.

Mixed image sizes (``--sizes WxH,...``): every job of a composition draws its size from the list
(uniformly: each size and mixture is covered), each size has its own template cache recorded by
a warm-up at that size, and the runner batches the sizes exactly (one call per size in lockstep
threads). The clock is then the process's CPU time (those threads compute one at a time; with
one torch thread that is the step's work). Besides the linear model (features of each job at its
own size) the resolution-aware batch predictor (``app/steptime.py``: an SVR with a scaler,
kernel/target/C/gamma/epsilon chosen by 5-fold cross-validated MAPE on the training points) is
fitted on the same training points, stored in the model JSON as plain arrays, and checked: its
MAPE on the held-out points (and on the held-out batches mixing sizes), and its numpy predictions
against scikit-learn's ``predict`` on every point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LinearRegression
from sklearn.metrics import r2_score

from app import steptime
from app.costmodel import (
    STEP_FEATURES,
    CostModel,
    FitReport,
    StepCurve,
    TierFit,
    UNetArch,
    default_path,
    device_type,
    fit_step_curve,
)
from app.settings import Settings
from app.storage.local import LocalStore
from ops.bench.harness import TRACES, cli, load_trace
from ops.bench.harness.gpu import DTYPES, hardware
from ops.bench.harness.report import pyplot, replace_section, save_figure
from ops.bench.harness.runner_timing import JobSpec, ModelUnderTest, RunnerTimer, load_model
from workers.engine.graphs import MIN_HORIZON
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey

log = logging.getLogger(__name__)


# -- device and sizes (the model under test and the runner's timer: ops.bench.harness.runner_timing) ----


def device_kind(device: str, dtype: torch.dtype = torch.float32) -> str:
    """What a cost model was measured on: ``cpu-<processor>-<threads>t`` or ``cuda-<GPU>-<dtype>``
    (a GPU's step depends on its precision, not on the host's threads)."""
    if device_type(device) == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        return f"cuda-{_slug(name)}-{str(dtype).removeprefix('torch.')}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{device}-{_slug(cpu)}-{torch.get_num_threads()}t"


def _slug(name: str) -> str:
    slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"128x128,96x128"`` (width x height in pixels) -> [(width, height), ...]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        w, _, h = part.lower().partition("x")
        out.append((int(w), int(h)))
    return out


# -- grid -----------------------------------------------------------------------------------------


def draw_ratio(rng: np.random.Generator) -> float:
    pick = rng.integers(0, len(TRACES) + 1)
    if pick == len(TRACES):
        return float(rng.uniform(0.01, 0.95))
    trace = load_trace(sorted(TRACES)[pick])
    return float(np.clip(trace[rng.integers(0, len(trace))], 0.005, 1.0))


def compositions(n: int, max_jobs: int, full_fraction: float, seed: int,
                 sizes: list[tuple[int, int]] | None = None) -> list[list[JobSpec]]:
    """Batch compositions: batch sizes cycle 1..max_jobs; ratios from traces + uniform; some uncached;
    with ``sizes`` (latent h, w) each job's size drawn uniformly from them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = 1 + i % max_jobs
        specs = [JobSpec(draw_ratio(rng), bool(rng.random() >= full_fraction), "blob" if rng.random() < 0.5 else "rect",
                         int(rng.integers(0, 10_000))) for _ in range(size)]
        if sizes and len(sizes) > 1:
            for spec in specs:
                spec.latent_hw = sizes[int(rng.integers(0, len(sizes)))]
        out.append(specs)
    order = rng.permutation(n)
    return [out[i] for i in order]


# -- fitting ------------------------------------------------------------------------------------

# The step curve is written only where its held-out MAPE beats the linear model's by more than this
# (half a percentage point, the margin ``app.steptime.fit`` gives its linear kernel): below it the
# two are a tie on a few dozen held-out points, and the linear step is the simpler, cheaper model.
CURVE_MARGIN = 0.005


def split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    k = max(2, int(round(n * test_fraction)))
    return np.sort(idx[k:]), np.sort(idx[:k])


class _NonNegFit:
    """Non-negative least squares for coefficients AND intercept (a negative fixed cost per step
    is unphysical; sklearn's ``positive=True`` leaves the intercept free)."""

    def __init__(self) -> None:
        self._reg = LinearRegression(positive=True, fit_intercept=False)
        self.coef_ = np.zeros(0)
        self.intercept_ = 0.0

    def fit(self, x: np.ndarray, y: np.ndarray) -> "_NonNegFit":
        self._reg.fit(np.hstack([x, np.ones((len(x), 1))]), y)
        self.coef_, self.intercept_ = self._reg.coef_[:-1], float(self._reg.coef_[-1])
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        return x @ self.coef_ + self.intercept_


def fit_linear(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[Any, FitReport, np.ndarray]:
    tr, te = split(len(y), test_fraction, seed)
    reg = _NonNegFit().fit(x[tr], y[tr])
    pred_te = reg.predict(x[te])
    report = FitReport(r2_train=float(r2_score(y[tr], reg.predict(x[tr]))), r2_test=float(r2_score(y[te], pred_te)),
                       mape_test=float(np.mean(np.abs(pred_te - y[te]) / y[te])), n_train=int(len(tr)),
                       n_test=int(len(te)), residuals_test=tuple(float(v) for v in (y[te] - pred_te)))
    return reg, report, te


def cross_validated_r2(x: np.ndarray, y: np.ndarray, folds: int, seed: int) -> float:
    """K-fold R^2 of the same fit (every point predicted by a model that never saw it)."""
    idx = np.random.default_rng(seed).permutation(len(y))
    pred = np.empty(len(y))
    for k in range(folds):
        te = idx[k::folds]
        tr = np.setdiff1d(idx, te)
        pred[te] = _NonNegFit().fit(x[tr], y[tr]).predict(x[te])
    return float(1 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2))


def fit_curve(model: CostModel, x: np.ndarray, y: np.ndarray, test_idx: np.ndarray,
              margin: float = CURVE_MARGIN) -> tuple[StepCurve | None, dict[str, Any]]:
    """The batch-step curve (``app.costmodel.StepCurve``) on the training points, and whether to keep it.

    A point's work is its jobs' marginal seconds under the linear fit over a full job's, the unit the
    curve is priced in (``CostModel.curved_step``), so the curve is fitted on exactly the numbers a
    deployment feeds it. Both models predict the held-out points through ``CostModel.step_seconds``
    (what routing and admission compute); the curve is kept only where its held-out MAPE is lower by
    more than ``margin``: a linear device (one CPU thread) gains nothing from it (its fit is the
    line, p = 1, and ties the linear model up to rounding), a host-bound GPU step does."""
    test = np.zeros(len(y), dtype=bool)
    test[test_idx] = True
    sums = x @ np.asarray(model.coef, dtype=np.float64)
    full = model.job_step_seconds(None)
    linear = np.array([model.step_seconds([s]) for s in sums])
    info: dict[str, Any] = {"form": "t(W) = (h^p + (c W)^p)^(1/p)", "n_train": int((~test).sum()),
                            "n_test": int(test.sum()), "linear_mape_test": steptime.mape(linear[test], y[test]),
                            "work_train": [float(sums[~test].min() / full), float(sums[~test].max() / full)]
                            if full > 0 else None}
    try:
        if full <= 0:
            raise ValueError("the linear fit gives a full job no seconds: no work unit")
        curve = fit_step_curve(sums[~test] / full, y[~test])
    except ValueError as exc:
        info.update(written=False, reason=str(exc))
        log.info("step curve: not fitted (%s)", exc)
        return None, info
    curved = dataclasses.replace(model, curve=curve, _memo={})
    pred = np.array([curved.step_seconds([s]) for s in sums])
    info.update(curve.to_dict(), curve_mape_train=steptime.mape(pred[~test], y[~test]),
                curve_mape_test=steptime.mape(pred[test], y[test]))
    info["margin"] = margin
    info["written"] = bool(info["curve_mape_test"] < info["linear_mape_test"] - margin)
    log.info("step curve: h %.2f ms, c %.2f ms, p %.2f; held-out MAPE %.1f%% vs linear %.1f%% on %d points: %s",
             curve.floor_s * 1e3, curve.per_job_s * 1e3, curve.knee, info["curve_mape_test"] * 100,
             info["linear_mape_test"] * 100, info["n_test"], "written" if info["written"] else "not written")
    return (curve if info["written"] else None), info


def profile_steps(mut: ModelUnderTest, args: argparse.Namespace, arch: UNetArch) -> dict[str, Any]:
    sizes = latent_sizes(args)
    graphed = device_type(args.device) == "cuda"  # the engine replays steady steps as CUDA graphs there
    # Graphed: steps to be seen and captured first, and enough left after them that the signature
    # is worth capturing (``graphs.MIN_HORIZON``).
    steps = args.repeats + (1 if not graphed else 2 + MIN_HORIZON)
    harness = RunnerTimer(mut, steps=steps, device=args.device, sizes=sizes)
    comps = compositions(args.points, args.max_jobs, args.full_fraction, args.seed, sizes)
    rows = []
    t_start = time.monotonic()
    for i, specs in enumerate(comps):
        # On a GPU the engine's steady period: steps back to back (a synchronised step would price
        # its host work on top of its kernels, which the engine overlaps).
        wall, cpu, jobs = harness.time_batch(specs, args.repeats, pipelined=graphed)
        feats = np.sum([arch.job_features(j.masked_tokens if j.cached else None) for j in jobs], axis=0)
        times = cpu if args.clock == "cpu" else wall
        med = statistics.median(times)
        rows.append({"jobs": len(jobs), "ratios": [round(s.ratio, 4) for s in specs],
                     "cached": [bool(j.cached) for j in jobs], "tokens": [j.masked_tokens for j in jobs],
                     "latent_hw": [list(j.latent_hw) for j in jobs],
                     "features": [float(v) for v in feats], "seconds": med, "wall": wall, "cpu": cpu})
        if args.raw:  # after every point: a run cut at its time limit leaves what --refit fits
            Path(args.raw).write_text(json.dumps({"rows": rows, "maskaware": True, "partial": True},
                                                 separators=(",", ":")))
        log.info("%d/%d: %d jobs, sizes %s, ratios %s, cached %s -> %.1f ms %s (wall %s) load %.1f", i + 1,
                 len(comps), len(jobs), [f"{w * 8}x{h * 8}" for h, w in (j.latent_hw for j in jobs)],
                 [f"{s.ratio:.2f}" for s in specs], [int(j.cached) for j in jobs], med * 1e3, args.clock,
                 "/".join(f"{t * 1e3:.0f}" for t in wall), os.getloadavg()[0])
    log.info("step profile: %d points in %.0f s", len(rows), time.monotonic() - t_start)
    graphs = harness.runner.graphs
    replayed = {} if graphs is None else {"graph_captures": graphs.captures, "graph_replays": graphs.replays,
                                          "graph_eager_calls": graphs.eager}
    if replayed:
        log.info("step graphs: %s", replayed)
    return {"rows": rows, "maskaware": True, "graphs": replayed}


def _evict(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def profile_loads(args: argparse.Namespace, work: Path) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) per tier: cold local-folder reads through ActivationStore, host copies."""
    sizes = [int(s * 2**20) for s in args.load_sizes_mib]
    store = ActivationStore(LocalStore(work / "store"))
    key = TemplateCacheKey("profile", "load", 64, 64, "DDIMScheduler", len(sizes), 1.0, "cfg2")
    g = torch.Generator().manual_seed(args.seed)
    for i, nbytes in enumerate(sizes):
        n = nbytes // 4
        store.put_step(key, i, {f"b{k}.k": torch.randn(n // 4, generator=g) for k in range(4)})
    store.commit(key)
    out: dict[str, list[tuple[int, float]]] = {"local": [], "host": [], "local_warm": []}
    for _ in range(args.load_repeats):
        for i, nbytes in enumerate(sizes):
            _evict(work / "store")
            start = time.perf_counter()
            tensors = store.read_step(key, i)
            out["local"].append((nbytes, time.perf_counter() - start))
            start = time.perf_counter()
            store.read_step(key, i)
            out["local_warm"].append((nbytes, time.perf_counter() - start))
            src = torch.cat([t.reshape(-1) for t in tensors.values()])
            out["host"].append((nbytes, host_copy_seconds(src, args.device)))
    return out


def host_copy_seconds(src: torch.Tensor, device: str) -> float:
    """One host-RAM tier read: on a GPU the copy from pinned host memory to the device (how the
    worker's host cache feeds a step), synchronised wall time; on the CPU a copy into a resident
    buffer, thread CPU time (the runner reads host RAM directly there, so this is an upper bound)."""
    if device_type(device) == "cuda":
        pinned = src.pin_memory()
        dst = torch.empty_like(src, device=device)
        dst.copy_(pinned, non_blocking=True)  # first copy: allocation and driver set-up, not timed
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    dst = torch.empty_like(src)
    dst.zero_()  # fault the pages in: a host cache copies into resident buffers
    start = time.thread_time()
    dst.copy_(src)
    return time.thread_time() - start


def fit_tiers(samples: dict[str, list[tuple[int, float]]], args: argparse.Namespace) -> dict[str, TierFit]:
    tiers = {}
    for name, pts in samples.items():
        x = np.array([[b] for b, _ in pts], dtype=np.float64)
        y = np.array([s for _, s in pts])
        reg, report, _ = fit_linear(x, y, args.test_fraction, args.seed)
        slope = max(float(reg.coef_[0]), 1e-15)
        tiers[name] = TierFit(latency_s=float(reg.intercept_), bytes_per_s=1.0 / slope, report=report)
        log.info("tier %s: latency %.2f ms, %.0f MiB/s, held-out R^2 %.4f", name, tiers[name].latency_s * 1e3,
                 tiers[name].bytes_per_s / 2**20, report.r2_test)
    return tiers


def plot(model: CostModel, rows: list[dict[str, Any]], test_idx: np.ndarray, out: Path) -> None:
    """Predicted vs measured step latency, held-out points marked."""
    y = np.array([r["seconds"] for r in rows])
    pred = np.array([model.step_seconds([model.features_seconds(r["features"])]) for r in rows])
    test = np.zeros(len(rows), dtype=bool)
    test[test_idx] = True
    fig, ax = pyplot().subplots(figsize=(5, 4.5))
    ax.scatter(y[~test] * 1e3, pred[~test] * 1e3, s=14, label="train", alpha=0.6)
    ax.scatter(y[test] * 1e3, pred[test] * 1e3, s=22, marker="s", label="held out")
    hi = max(y.max(), pred.max()) * 1e3 * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set_xlabel("measured step ms")
    ax.set_ylabel("predicted step ms")
    r = model.step_report
    title = f"{model.model_id} on {model.device_kind[:28]}\nheld-out R^2 = {r.r2_test:.3f}" if r else model.model_id
    info = model.meta.get("step_curve") or {}
    if model.curve is not None and "curve_mape_test" in info:  # the points are predicted on the curve
        title = title.replace("held-out R^2", "linear step: held-out R^2")
        title += (f"\nplotted, the step curve: held-out MAPE {info['curve_mape_test'] * 100:.1f}% "
                  f"(linear {info['linear_mape_test'] * 100:.1f}%)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    save_figure(fig, out)


def latent_sizes(args: argparse.Namespace) -> list[tuple[int, int]] | None:
    """``--sizes`` as latent (h, w) grids (None: the model's one profiled size)."""
    sizes = parse_sizes(getattr(args, "sizes", "") or "")
    return [(h // 8, w // 8) for w, h in sizes] or None


def features(arch: UNetArch, rows: list[dict[str, Any]], unet_config: dict[str, Any] | None = None
             ) -> tuple[UNetArch, np.ndarray]:
    """The architecture with the mask boundary cells the measured masks had, and each row's step
    features (each job's at its own size when rows carry sizes)."""
    own = [tuple(hw) for row in rows for hw in row.get("latent_hw", [])]
    def sizes_of(row: dict[str, Any]) -> list[Any]:
        return row.get("latent_hw") or [arch.latent_hw] * len(row["ratios"])

    at_size = [(r, t) for row in rows for r, t, c, hw in zip(row["ratios"], row["tokens"], row["cached"], sizes_of(row))
               if c and t is not None and tuple(hw) == tuple(arch.latent_hw)]
    arch = arch.with_edges(at_size)
    archs = {tuple(arch.latent_hw): arch}
    if unet_config is not None:
        for hw in set(own) - set(archs):
            archs[hw] = dataclasses.replace(arch, latent_hw=hw,  # type: ignore[arg-type]
                                            fullmap_macs_per_row=UNetArch.from_unet_config(unet_config, hw)
                                            .fullmap_macs_per_row)

    def job_features(t: Any, c: bool, hw: Any) -> Any:
        return archs.get(tuple(hw) if hw else arch.latent_hw, arch).job_features(t if c else None)

    return arch, np.array([np.sum([job_features(t, c, hw)
                                   for t, c, hw in zip(row["tokens"], row["cached"], sizes_of(row))], axis=0)
                           for row in rows], dtype=np.float64)


def shapes(row: dict[str, Any], default_hw: tuple[int, int]) -> list[steptime.JobShape]:
    """A measured composition as the batch predictor sees it."""
    hws = row.get("latent_hw") or [default_hw] * len(row["tokens"])
    return [steptime.JobShape(tuple(hw), tuple(t) if c and t is not None else None, 2)  # type: ignore[arg-type]
            for t, c, hw in zip(row["tokens"], row["cached"], hws)]


def fit_batch_predictor(rows: list[dict[str, Any]], arch: UNetArch, test_idx: np.ndarray,
                        sizes: list[tuple[int, int]] | None, seed: int) -> steptime.BatchPredictor:
    """The resolution-aware SVR on the training points; its held-out MAPE (all, and batches that
    mix sizes) and its numpy-vs-scikit-learn agreement in ``report``."""
    spec = steptime.FeatureSpec(arch.num_levels, tuple(sizes or ()))
    x = np.array([spec.features(shapes(r, arch.latent_hw)) for r in rows])
    y = np.array([r["seconds"] for r in rows])
    test = np.zeros(len(rows), dtype=bool)
    test[test_idx] = True
    svr, info = steptime.fit(x[~test], y[~test], seed=seed)
    scaler, sk = steptime.sklearn_predict(x[~test], y[~test], info)
    sk_pred = sk.predict(scaler.transform(x))
    sk_pred = np.exp(sk_pred) if info["target"] == "log" else np.maximum(sk_pred, 0.0)
    pred = svr.predict(x)
    mixed = np.array([len({tuple(hw) for hw in (r.get("latent_hw") or [])}) > 1 for r in rows])
    report = {**info, "n_train": int((~test).sum()), "n_test": int(test.sum()),
              "mape_train": steptime.mape(pred[~test], y[~test]), "mape_test": steptime.mape(pred[test], y[test]),
              "n_test_mixed": int((test & mixed).sum()),
              "mape_test_mixed": steptime.mape(pred[test & mixed], y[test & mixed]) if (test & mixed).any() else None,
              "max_abs_error_test_ms": float(np.max(np.abs(pred[test] - y[test]))) * 1e3,
              "sklearn_max_rel_diff": float(np.max(np.abs(pred - sk_pred) / sk_pred)),
              "test_measured_s": [round(float(v), 5) for v in y[test]],
              "test_predicted_s": [round(float(v), 5) for v in pred[test]]}
    log.info("batch predictor: %s kernel on %s, held-out MAPE %.1f%% (mixed-size batches %s), numpy vs "
             "scikit-learn max relative difference %.2e", info["kernel"], info["target"], report["mape_test"] * 100,
             "n/a" if report["mape_test_mixed"] is None else f"{report['mape_test_mixed'] * 100:.1f}%",
             report["sklearn_max_rel_diff"])
    return steptime.BatchPredictor(spec, svr, 8, report)


def project(args: argparse.Namespace, mut: ModelUnderTest, arch: UNetArch) -> int:
    """A what-if model for an architecture too slow to profile fully here: seconds = intercept +
    c * (total MACs), with ``c`` and the intercept fitted on the base model's measured points
    (that single-feature fit predicts them as well as the full feature set, see its meta), and
    the base model's load tiers. Validated on ``--points`` measured steps of the real target."""
    base_path = Path(args.project_from)
    base = CostModel.load(base_path)
    raw = json.loads(base_path.with_name(base_path.name.removesuffix(".json") + ".points.json").read_text())
    x = np.array([[sum(r["features"][:3])] for r in raw["rows"]])
    y = np.array([r["seconds"] for r in raw["rows"]])
    reg, rep, _ = fit_linear(x, y, args.test_fraction, args.seed)
    c = float(reg.coef_[0])
    meta: dict[str, Any] = {"created": time.time(), "projected": True, "projected_from": str(base_path),
                            "seconds_per_gmac": c, "base_total_macs_r2_test": rep.r2_test, "model": mut.description,
                            "latent": mut.latent,
                            "command": args.command}
    if args.points:
        with torch.no_grad():
            steps = profile_steps(mut, args, arch)
        rows = steps["rows"]
        arch, feats = features(arch, rows)
        pred = reg.intercept_ + c * feats[:, :3].sum(axis=1)
        meas = np.array([r["seconds"] for r in rows])
        meta["validation"] = {"points": len(rows), "r2": float(r2_score(meas, pred)) if len(rows) > 1 else None,
                              "mape": float(np.mean(np.abs(pred - meas) / meas)),
                              "measured_s": [round(float(v), 4) for v in meas],
                              "predicted_s": [round(float(v), 4) for v in pred]}
        log.info("projection validated on %d measured steps: R^2 %s, MAPE %.1f%%", len(rows),
                 meta["validation"]["r2"], meta["validation"]["mape"] * 100)
    model = CostModel(model_id=mut.model_id, device_kind=base.device_kind + "-projected", arch=arch,
                      intercept=float(reg.intercept_), coef=(c, c, c, 0.0, 0.0), tiers=base.tiers, step_report=None,
                      meta=meta)
    log.info("projected: %.4f s per GMAC", c)
    save(model, args, plotted=False)
    return 0


def save(model: CostModel, args: argparse.Namespace, plotted: bool = True) -> None:
    """The model JSON (``--out``, default in the home) and, with ``--report``, its section."""
    out = Path(args.out) if args.out else default_path(Settings.from_env().home, model.model_id, model.device_kind)
    model.save(out)
    log.info("wrote %s", out)
    if args.report:
        replace_section(Path(args.report), f"costmodel-{model.model_id}",
                        render_model(model, Path(args.plot).name if args.plot and plotted else ""))


def render_curve(info: dict[str, Any] | None) -> list[str]:
    """The batch-step curve's line of the report: both held-out MAPEs and whether the curve was written."""
    if not info:
        return []
    if "p" not in info:
        return [f"- Batch-step curve `{info['form']}`: not fitted ({info.get('reason')}); the model prices a step "
                f"linearly (held-out MAPE {info['linear_mape_test'] * 100:.1f}%)."]
    margin = info.get("margin", 0.0) * 100
    verdict = ("**written** into the model JSON (`curve`): routing and SLO admission price a step as t(total work)"
               if info["written"] else f"**not written** (it must beat the linear step by more than {margin:.1f} "
               "points): the model stays linear")
    work = info.get("work_train") or [float("nan")] * 2
    return [f"- Batch-step curve `{info['form']}` (W = a batch's work in full jobs at the profiled size), fitted by "
            f"relative least squares on the {info['n_train']} training points (W {work[0]:.2f}-{work[1]:.2f}): "
            f"h {info['h_s'] * 1e3:.3g} ms, c {info['c_s'] * 1e3:.3g} ms, p {info['p']:.2f}. Held-out MAPE on the "
            f"same {info['n_test']} points: **curve {info['curve_mape_test'] * 100:.1f}%, linear "
            f"{info['linear_mape_test'] * 100:.1f}%** (curve train {info['curve_mape_train'] * 100:.1f}%); {verdict}."]


def render_model(model: CostModel, plot_name: str = "") -> str:
    """A markdown section describing a fitted (or projected) model file."""
    m = model.meta
    cmds = [str(m.get("command", ""))]
    if m.get("fit_command", cmds[0]) != cmds[0]:
        cmds.append(str(m["fit_command"]))
    masked = " / ".join(f"{sum(model.arch.job_features(model.arch.tokens_from_ratio(r))[:3]):.3g}"
                        for r in (0.03, 0.2, 0.5))
    lines = [f"## Cost model `{model.model_id}` on `{model.device_kind}`", "",
             "Projected and checked (from the repo root):" if m.get("projected") else
             "Measured, then fitted (from the repo root):", "", "```", *cmds, "```", "",
             f"- Model: {m.get('model', '?')}; latent {m.get('latent')}x{m.get('latent')}; "
             f"{len(model.arch.blocks)} transformer blocks on {model.arch.num_levels} levels; full-map work "
             f"{model.arch.fullmap_macs_per_row / 1e9:.2f} GMAC per row; template cache "
             f"{model.arch.cache_bytes_per_step() / 2**20:.1f} MiB per step per CFG job.",
             f"- Full-compute CFG job: {sum(model.arch.job_features(None)[:3]):.3g} GMAC per step; masked at pixel "
             f"ratio 0.03 / 0.2 / 0.5: {masked} GMAC (mask boundary cells per level {list(model.arch.edge_cells)})."]
    if model.step_report:
        r = model.step_report
        lines += [f"- Step fit on {r.n_train} points, {r.n_test} held out before fitting ({m.get('clock', 'wall')} "
                  f"clock, {m.get('threads')} thread(s), median of {m.get('repeats')} steps, load average "
                  + (f"{m['loadavg_during'][0]}-{m['loadavg_during'][1]} during measurement" if m.get("loadavg_during")
                     else f"{m.get('loadavg_before')} -> {m.get('loadavg_after')}")
                  + f"): **held-out R^2 {r.r2_test:.3f}**, "
                  f"train {r.r2_train:.3f}, 5-fold CV {m.get('cv5_r2', float('nan')):.3f}, held-out MAPE "
                  f"{r.mape_test * 100:.1f}%, held-out residuals (ms) "
                  f"{[round(v * 1e3) for v in r.residuals_test]}. A single feature, total MACs, gives held-out "
                  f"R^2 {m.get('total_macs_only_r2_test', float('nan')):.3f}.",
                  "- Coefficients (seconds per unit; non-negative least squares, intercept >= 0): "
                  + ", ".join(f"`{f}` {c:.4g}" for f, c in zip(STEP_FEATURES, model.coef))
                  + f", intercept {model.intercept:.4g} s."]
    lines += render_curve(m.get("step_curve"))
    if m.get("projected"):
        v = m.get("validation") or {}
        lines += [f"- **Projected, not fitted**: {m['seconds_per_gmac']:.4g} s per GMAC (the base model's total-MACs "
                  f"fit, held-out R^2 {m['base_total_macs_r2_test']:.3f}) applied to this architecture. Checked on "
                  f"{v.get('points', 0)} real steps of it: R^2 {v.get('r2') or float('nan'):.3f}, MAPE "
                  f"{(v.get('mape') or 0) * 100:.1f}%, measured {v.get('measured_s')} s vs predicted "
                  f"{v.get('predicted_s')} s."]
    if model.tiers:
        lines += ["", "| load tier | latency ms | bandwidth MiB/s | held-out R^2 |", "|---|---|---|---|"]
        for name, t in model.tiers.items():
            lines.append(f"| {name} | {t.latency_s * 1e3:.2f} | {t.bytes_per_s / 2**20:.0f} | "
                         f"{t.report.r2_test:.3f} |" if t.report else f"| {name} | {t.latency_s * 1e3:.2f} | "
                         f"{t.bytes_per_s / 2**20:.0f} | - |")
    if model.batch is not None:
        b = model.batch.report
        mixed = b.get("mape_test_mixed")
        lines += ["", f"Resolution-aware batch step time (`app/steptime.py`), sizes {m.get('sizes', '?')}: an SVR "
                  f"({b.get('kernel')} kernel on "
                  f"{'log(step seconds)' if b.get('target') == 'log' else 'step seconds'}, "
                  f"C {b.get('C')}, gamma "
                  f"{b.get('gamma', 0):.4g}, epsilon {b.get('epsilon', 0):.4g}, {b.get('n_support')} support vectors, "
                  f"chosen among {b.get('grid')} settings by {b.get('folds')}-fold CV MAPE "
                  f"{b.get('cv_mape', 0) * 100:.1f}%) on {b.get('n_train')} measured batches; features "
                  f"{', '.join(f'`{n}`' for n in model.batch.spec.names())}.",
                  f"- **Held-out MAPE {b.get('mape_test', 0) * 100:.1f}%** on {b.get('n_test')} batches never seen "
                  f"in fitting; on the {b.get('n_test_mixed')} of them that mix sizes "
                  + ("n/a" if mixed is None else f"**{mixed * 100:.1f}%**")
                  + f" (train {b.get('mape_train', 0) * 100:.1f}%, largest held-out error "
                  f"{b.get('max_abs_error_test_ms', 0):.2f} ms).",
                  f"- Served from the JSON with numpy: largest relative difference to scikit-learn's `predict` on "
                  f"every measured batch {b.get('sklearn_max_rel_diff', 0):.1e}."]
    if plot_name:
        lines += ["", f"![{model.model_id}]({plot_name})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out=None, clock="cpu")
    p.add_argument("--model", default="tiny",
                   help="tiny (the configured model) | sd-l2 | sd15-inpaint (true size, random weights)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where the runner steps")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="the model's precision (auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--latent", type=int, default=None, help="latent side (tiny: 16, sd-l2: 32)")
    p.add_argument("--points", type=int, default=48, help="batch compositions measured")
    p.add_argument("--max-jobs", type=int, default=8, help="largest batch (CFG jobs)")
    p.add_argument("--sizes", default="",
                   help="image sizes WxH,... (multiples of 8): mixed-size batches and the batch step-time SVR")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--full-fraction", type=float, default=0.25, help="share of jobs without a cache")
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--load-sizes-mib", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--load-repeats", type=int, default=3)
    p.add_argument("--curve-margin", type=float, default=CURVE_MARGIN,
                   help="write the batch-step curve only where its held-out MAPE beats the linear model's by more")
    p.add_argument("--out", default="", help="model JSON (default: <STENCIL_HOME>/costmodels/<model>--<device>.json)")
    p.add_argument("--plot", default="", help="PNG of predicted vs measured step latency")
    p.add_argument("--raw", default="", help="also write the measured points (JSON)")
    p.add_argument("--refit", default="", help="fit points saved with --raw instead of measuring")
    p.add_argument("--report", default="", help="markdown file whose `costmodel-<model>` section is (re)written")
    p.add_argument("--report-only", default="", help="a model JSON: only write its --report section")
    p.add_argument("--project-from", default="",
                   help="a fitted model JSON (with its .points.json): carry its measured seconds per MAC over to "
                        "--model's architecture; --points real steps of that model validate the projection")
    run = cli.start(p, argv, __file__, quick=dict(latent=8, points=6, max_jobs=2, repeats=1,
                                                  load_sizes_mib=[0.25, 0.5, 1.0], load_repeats=2))
    args = run.args
    args.command = run.command
    if args.report_only:
        model = CostModel.load(args.report_only)
        replace_section(Path(args.report), f"costmodel-{model.model_id}",
                        render_model(model, Path(args.plot).name if args.plot else ""))
        return 0
    gpu = device_type(args.device) == "cuda"
    dtype = DTYPES["bfloat16" if gpu else "float32"] if args.dtype == "auto" else DTYPES[args.dtype]
    if gpu and args.clock == "cpu":
        args.clock = "wall"  # a GPU step's cost is the period of back-to-back steps, not the launching thread's CPU
        log.info("--device %s: timing the wall-time period of back-to-back steps", args.device)
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()
    mut = load_model(args.model, args.latent, args.seed, args.device, dtype, quick=args.quick)
    sizes = latent_sizes(args)
    arch = UNetArch.from_unet_config(dict(mut.unet.config), sizes[0] if sizes else (mut.latent, mut.latent),
                                     text_len=mut.text_len)
    if args.project_from:
        return project(args, mut, arch)
    loads: dict[str, list[tuple[int, float]]] | None = None
    if args.refit:
        raw = json.loads(Path(args.refit).read_text())
        steps = {"rows": raw["rows"], "maskaware": raw.get("maskaware", True),
                 "measurement": raw.get("measurement", {})}
        loads = {k: [tuple(v) for v in pts] for k, pts in raw["loads"].items()} if raw.get("loads") else None
        log.info("refitting %d measured points from %s", len(steps["rows"]), args.refit)
    else:
        with torch.no_grad():
            steps = profile_steps(mut, args, arch)
    rows = steps["rows"]
    arch, x = features(arch, rows, dict(mut.unet.config))
    log.info("mask boundary cells per level (ratio -> tokens estimate): %s", arch.edge_cells)
    for row, feats in zip(rows, x):
        row["features"] = [float(v) for v in feats]
    y = np.array([r["seconds"] for r in rows])
    reg, report, test_idx = fit_linear(x, y, args.test_fraction, args.seed)
    cv_r2 = cross_validated_r2(x, y, 5, args.seed)
    total = x[:, :3].sum(axis=1, keepdims=True)
    _, macs_only, _ = fit_linear(total, y, args.test_fraction, args.seed)
    log.info("step model: held-out R^2 %.4f (train %.4f, 5-fold CV %.4f), MAPE %.1f%%, coef %s, intercept %.4f; "
             "total-MACs-only fit: held-out R^2 %.4f", report.r2_test, report.r2_train, cv_r2, report.mape_test * 100,
             dict(zip(STEP_FEATURES, np.round(reg.coef_, 6))), reg.intercept_, macs_only.r2_test)
    if loads is None:
        with tempfile.TemporaryDirectory(prefix="stencil-profile-", dir=os.environ.get("STENCIL_PROFILE_TMP")) as tmp:
            loads = profile_loads(args, Path(tmp))
    tiers = fit_tiers(loads, args)
    dev = device_kind(args.device, dtype)
    command = args.command
    measurement = steps.get("measurement") or {
        "command": command, "clock": args.clock, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "hardware": hardware(torch.device(args.device)), "dtype": str(dtype).removeprefix("torch."),
        **steps.get("graphs", {}),
        **({"cpu_clock": "process_time (lockstep threads of mixed sizes compute one at a time)"} if sizes else {}),
        "loadavg_before": [round(v, 2) for v in load_before], "loadavg_after": [round(v, 2) for v in os.getloadavg()]}
    if args.raw:
        Path(args.raw).write_text(json.dumps({"rows": rows, "test_idx": test_idx.tolist(), "loads": loads,
                                              "maskaware": steps["maskaware"], "measurement": measurement},
                                             separators=(",", ":")))  # compact: the repository's size budget
    batch = fit_batch_predictor(rows, arch, test_idx, latent_sizes(args), args.seed) if args.sizes else None
    curve, curve_info = fit_curve(CostModel(model_id=mut.model_id, device_kind=dev, arch=arch,
                                            intercept=float(reg.intercept_), coef=tuple(float(c) for c in reg.coef_)),
                                  x, y, test_idx, args.curve_margin)
    model = CostModel(
        model_id=mut.model_id, device_kind=dev, arch=arch, intercept=float(reg.intercept_),
        coef=tuple(float(c) for c in reg.coef_), tiers=tiers, step_report=report,
        meta={"created": time.time(), "command": command, "model": mut.description, "latent": mut.latent,
              "maskaware_profiled": steps["maskaware"], "torch": torch.__version__, "points": len(rows),
              "cv5_r2": cv_r2, "total_macs_only_r2_test": macs_only.r2_test, **measurement,
              "fit_command": command, "step_curve": curve_info, **({"sizes": args.sizes} if args.sizes else {})},
        batch=batch, curve=curve)
    if args.plot:
        plot(model, rows, test_idx, Path(args.plot))
        log.info("wrote %s", args.plot)
    save(model, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
