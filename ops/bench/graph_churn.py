"""How many of the engine's steps replay a CUDA graph under continuous batching.

A step graph is keyed by the batch's signature: every job's mode and rows, and its token counts
per level or, with ragged batch indices, the batch's bucketed token totals
(``workers/engine/graph_calls.py``). It is captured the second time a signature runs (or when it
comes back after others, however short its stretch) and replayed whenever it runs again; a job
joining or leaving (or a refresh step changing a job's mode) makes another signature. So the
share of steps that replay depends on how the batch churns, not on the device: this benchmark
counts it with the real engine (``Engine``, ``BatchScheduler``, ``SDRunner`` with step graphs on)
and the CPU stand-in for a graph (``graphs.EagerReplay``: the same signatures, captures and
replays as on a GPU), on the embedded model at 256 px (1,024 tokens at its first level).

Arrivals are counted in engine steps: a burst (every job at once, as ``ops.bench.gpu_engine`` runs)
and Poisson arrivals at ``--loads`` x the batch's capacity (``max_batch / steps`` jobs per step).
Jobs are edits of one warmed template, mask ratios from ``--trace``, the ``fast`` policy's refresh
steps. Reported per arrival pattern: engine steps, the shares of steps replayed, captured and run
eagerly, how many of all steps and of the steps not replayed had a job taking a refresh step (its
mode, full, is in the signature), and the jobs' mean latency in steps (arrival to result).

``--indices``: ``ragged`` (what a CUDA device runs: a graph's shapes name the batch's rows and
bucketed token totals, not each job's counts, ``workers/maskaware/batched.py``) and/or ``runs``
(each job's count rounded to its own bucket: what a device without a variable-length attention
kernel runs).

``--admit-every K`` (an ablation, not an engine setting): the scheduler admits waiting jobs only
every K steps (or into an empty batch), so jobs join, and finish, together; what that buys in
replays and costs in latency.

``--growth G`` (an ablation of ``workers/maskaware/buckets.GROWTH``): token buckets growing by G
instead; coarser buckets make fewer signatures (a batch's bucketed totals are in them) at the cost
of more padded tokens, whose device time only a GPU measures.

``--widen L`` (an ablation of ``workers/engine/graph_calls.WIDEN_LIMIT``; 1 = off): a step with
no graph of its own replays a wider batch's graph when its token totals, padded by at most L x,
reach that graph's; the report gives the steps that did and the token rows they padded.

A run starts with no graph captured, so its first steps miss more than a service that has been
serving for a while: the report gives the shares over the run's second half apart (steady).

    python -m ops.bench.graph_churn --out docs/bench/graph_churn.md
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from app.fidelity import policy_schedule
from ops.bench.harness import load_trace
from ops.bench.harness.ablations import add_options, bucket_growth, widen_limit
from ops.bench.harness.cli import parser, start
from ops.bench.harness.models import cfg_job, pixel_mask
from ops.bench.harness.runner_timing import ModelUnderTest, RecordedCaches, load_model
from workers.engine import graph_calls
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.engine.sd_runner import SDRunner
from workers.maskaware import buckets
from workers.maskaware.activation_store import TemplateCacheKey
from workers.maskaware.unet import MaskAwareUNet

log = logging.getLogger(__name__)


class GatedAdmission(BatchScheduler):
    """Admits waiting jobs only every ``every`` steps, or into an empty batch (the ablation above)."""

    def __init__(self, max_batch: int, every: int) -> None:
        super().__init__(max_batch=max_batch)
        self.every = every
        self._calls = 0

    def schedule(self) -> tuple[list[Any], list[Any]]:
        gated = self.every > 1 and bool(self.running) and self._calls % self.every != 0
        self._calls += 1
        return (self._batch(), []) if gated else super().schedule()


class _Caches(RecordedCaches):
    """The recorded template, resident (no object store behind it)."""

    def store_bytes_of(self, key: Any) -> int:
        return 0


def arrivals(pattern: str, jobs: int, max_batch: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """Engine step at which each job arrives: ``burst`` (all at 0) or a load (``0.9``: Poisson at
    0.9 x the batch's capacity of ``max_batch / steps`` jobs per step)."""
    if pattern == "burst":
        return np.zeros(jobs)
    rate = float(pattern) * max_batch / steps
    return np.cumsum(rng.exponential(1.0 / rate, jobs))


def padding(growth: float, tokens: int = 4096, max_batch: int = 8, trace: str = "spring", samples: int = 20000,
            seed: int = 0) -> tuple[float, float]:
    """(mean, P90) of a batch's padded tokens over its real ones when its token total is bucketed
    with ``growth``: batches of 1..``max_batch`` jobs of ``tokens`` tokens each, mask ratios from
    ``trace`` (a job's tokens: ratio x tokens, not a token mask's own count). What coarser buckets
    cost in device work, against the replays they buy (``--growth``)::

        python -c "from ops.bench.graph_churn import padding; print(padding(2.0))"
    """
    rng = np.random.default_rng(seed)
    ratios = np.clip(np.asarray(load_trace(trace), dtype=float), 0.01, 0.9)
    pads = []
    with bucket_growth(growth):
        for _ in range(samples):
            n = int(rng.integers(1, max_batch + 1))
            real = int(np.ceil(rng.choice(ratios, n) * tokens).sum())
            pads.append((buckets.token_bucket(real, n * tokens) - real) / real)
    return float(np.mean(pads)), float(np.quantile(pads, 0.9))


def run(mut: ModelUnderTest, pattern: str, every: int, indices: str, growth: float, widen: float,
        args: Any) -> dict[str, Any]:
    """One arrival pattern on a fresh engine (its own mask-aware hooks, removed after)."""
    ctrl = MaskAwareUNet(mut.unet)
    ctrl.ragged = indices == "ragged"
    try:
        with bucket_growth(growth), widen_limit(widen):
            return {"indices": indices, "growth": growth, "widen": widen, **_run(mut, ctrl, pattern, every, args)}
    finally:
        ctrl.remove()


def _run(mut: ModelUnderTest, ctrl: MaskAwareUNet, pattern: str, every: int, args: Any) -> dict[str, Any]:
    """Step counts by how the denoiser call ran."""
    hw = (mut.latent, mut.latent)
    caches = _Caches()
    runner = SDRunner(mut.unet, mut.scheduler_config, "cpu", maskaware=ctrl, caches=caches, recorder=caches,
                      prefetch_steps=0, graphs=True)
    key = TemplateCacheKey(model_id=mut.model_id, template_id="t", height=hw[0] * 8, width=hw[1] * 8,
                           scheduler=str(mut.scheduler_config["_class_name"]), steps=args.steps, strength=1.0,
                           guidance="cfg2", layout=ctrl.cache_layout).to_dict()
    engine = Engine(runner, GatedAdmission(args.max_batch, every))
    text = (mut.text_len, mut.cross_dim)
    tensors, meta = cfg_job(pixel_mask(hw[0] * 8, 0.0, "blob", 7), hw, args.steps, text, 1, mode="record",
                            cache_key=key)
    warm = engine.submit("warm", tensors, meta, total_steps=args.steps)
    while not warm.future.done():
        engine._drain_inbox(block=False)
        engine.step_once()
    graphs = runner.graphs
    assert graphs is not None
    graphs.reset_counts()
    signatures: set[Any] = set()
    inner = graphs.run

    def noting(key: Any, *rest: Any, **kw: Any) -> Any:
        signatures.add(key)
        return inner(key, *rest, **kw)

    graphs.run = noting  # type: ignore[method-assign]
    compositions: set[tuple[int, int]] = set()  # (jobs in the batch, of them taking a refresh step)
    rng = np.random.default_rng(args.seed)
    trace = load_trace(args.trace)
    at = arrivals(pattern, args.jobs, args.max_batch, args.steps, rng)
    ran_as: list[str] = []  # how each engine step's denoiser call ran, in order
    refresh = set(policy_schedule("fast", args.steps))
    refreshing_steps = missed_refreshing = 0  # steps with a job taking a refresh step: all, not replayed
    handles: list[Any] = []
    done_at: dict[int, int] = {}
    step = submitted = 0
    while submitted < args.jobs or not all(h.future.done() for h in handles):
        while submitted < args.jobs and at[submitted] <= step:
            ratio = float(np.clip(trace[rng.integers(len(trace))], 0.01, 0.9))
            tensors, meta = cfg_job(pixel_mask(hw[0] * 8, ratio, ("blob", "rect")[submitted % 2], 100 + submitted),
                                    hw, args.steps, text, 100 + submitted, mode="masked", cache_key=key)
            meta["refresh_steps"] = policy_schedule("fast", args.steps)
            handles.append(engine.submit(f"j{submitted}", tensors, meta, total_steps=args.steps))
            submitted += 1
        engine._drain_inbox(block=False)
        if engine.step_once():
            ran_as.append(runner.last_step_graph)
            ran_ids = set(engine.stats.history[-1].job_ids)
            refreshing_jobs = sum(h.steps_done - 1 in refresh for h in handles if h.job_id in ran_ids)
            compositions.add((len(ran_ids), refreshing_jobs))
            refreshing = refreshing_jobs > 0
            refreshing_steps += refreshing
            missed_refreshing += runner.last_step_graph != "replayed" and refreshing
        step += 1
        for i, h in enumerate(handles):
            if i not in done_at and h.future.done():
                done_at[i] = step
    ran = len(ran_as)
    counts = {k: ran_as.count(k) for k in ("replayed", "captured", "eager")}
    results = [h.future.result() for h in handles]
    replayed_job_steps = sum(r["graph_replayed_steps"] for r in results) / (len(results) * args.steps)
    latency = float(np.mean([done_at[i] - at[i] for i in range(len(handles))]))
    log.info("%s, admit every %d: %d engine steps %s, job steps replayed %.3f, latency %.1f steps", pattern, every,
             ran, counts, replayed_job_steps, latency)
    missed = ran - counts["replayed"]
    second = ran_as[len(ran_as) // 2:]
    steady = {f"steady_{k}": second.count(k) / max(len(second), 1) for k in counts}
    return {"pattern": pattern, "admit_every": every, "steps": ran, **{k: v / ran for k, v in counts.items()}, **steady,
            "refreshing": refreshing_steps / ran, "missed_refreshing": missed_refreshing / missed if missed else 0.0,
            "captures": graphs.captures, "signatures": len(signatures), "compositions": len(compositions),
            "widened": graphs.widened / ran,
            "widened_padding": graphs.widened_rows[0] / graphs.widened_rows[1] if graphs.widened_rows[1] else 0.0,
            "job_steps_replayed": replayed_job_steps, "latency_steps": latency}


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, out="docs/bench/graph_churn.md")
    p.add_argument("--patterns", type=lambda s: s.split(","), default=["burst", "0.5", "0.9"],
                   help="burst and/or loads (x the batch's capacity)")
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--latent", type=int, default=32, help="latent side of the jobs (32: 1,024 first-level tokens)")
    p.add_argument("--trace", default="spring")
    p.add_argument("--indices", type=lambda s: s.split(","), default=["ragged", "runs"],
                   help="ragged (CUDA's batch indices) and/or runs (per-job token buckets)")
    p.add_argument("--admit-every", type=lambda s: [int(v) for v in s.split(",")], default=[1],
                   help="ablation: admit waiting jobs only every K steps (1 = every step, the engine's way)")
    add_options(p)
    run_ = start(p, argv, __file__, quick=dict(patterns=["burst", "0.9"], jobs=8, max_batch=4, steps=8, latent=8))
    args = run_.args
    torch.manual_seed(args.seed)
    mut = load_model("tiny", args.latent, args.seed)
    rows = [run(mut, pattern, every, indices, growth, widen, args) for pattern in args.patterns
            for indices in args.indices for every in args.admit_every for growth in args.growth for widen in args.widen]
    lines = ["# Step graphs under continuous batching", "", f"Command: `{run_.command}`", "",
             f"The embedded model at {args.latent * 8} px, {args.jobs} edits of one warmed template per pattern, "
             f"{args.steps} steps, max batch "
             f"{args.max_batch}, policy `fast` (refresh steps {policy_schedule('fast', args.steps)}), mask ratios from "
             f"the {args.trace} trace; step graphs on (the CPU stand-in: the same signatures, captures and replays "
             "as on a GPU). Shares of the engine's steps by how their denoiser call ran; job steps replayed: the "
             "share of the jobs' steps that a replay computed. Batch indices: `ragged` (a CUDA device's: one "
             "variable-length attention call per block, token totals bucketed, no job's count in a graph's "
             "shapes) or `runs` (each job's count rounded up to its own bucket).", "",
             "With a refresh step: the share of steps (of all, and of those not replayed) whose batch had a "
             "job taking a refresh step (a full step: the job's mode is in the signature). Steady: the shares "
             "over the run's second half (a run starts with no graph captured). Bucket growth: how token "
             f"buckets grow (the engine's: {buckets.GROWTH}; others are an ablation). Signatures / compositions: the "
             "distinct step signatures the run ran (a widened step: the graph's it replayed), and the distinct batch "
             "compositions among them (jobs in the batch, how many take a refresh step): the rest of the signatures "
             "differ in token counts. Widen: "
             "how far a step's ragged token totals may be padded to replay a wider batch's graph (the engine's: "
             f"{graph_calls.WIDEN_LIMIT}; 1 = off); widened: the steps that did, and the token rows they padded over "
             "their own (bucketed) ones.", "",
             "| arrivals | batch indices | admit every | bucket growth | widen | engine steps | replayed | captured | "
             "eager | steady: replayed / captured / eager | widened: steps / padded rows | signatures / compositions | "
             "with a refresh step: all / not replayed | job steps replayed | mean latency (steps) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "burst (all at once)" if r["pattern"] == "burst" else f"Poisson, load {float(r['pattern']):g}"
        lines.append(f"| {name} | {r['indices']} | {r['admit_every']} | {r['growth']:g} | {r['widen']:g} | "
                     f"{r['steps']} | {r['replayed']:.1%} | {r['captured']:.1%} | {r['eager']:.1%} | "
                     f"{r['steady_replayed']:.1%} / {r['steady_captured']:.1%} / {r['steady_eager']:.1%} | "
                     f"{r['widened']:.1%} / {r['widened_padding']:.1%} | "
                     f"{r['signatures']} / {r['compositions']} | "
                     f"{r['refreshing']:.1%} / {r['missed_refreshing']:.1%} | "
                     f"{r['job_steps_replayed']:.1%} | "
                     f"{r['latency_steps']:.1f} |")
    run_.write(lines + [""])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
