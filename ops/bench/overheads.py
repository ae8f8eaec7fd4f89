"""Engine overheads and batch scaling, in process (no Celery), on the e2e benchmark's model.

- Per-step batching overhead: one ``Engine.step_once`` minus the denoiser call inside it
  (scheduling, input assembly, per-job scheduler steps, bookkeeping), by batch size.
- Per-job serialization and transfer: pack a prepared job's tensors as safetensors, put them in
  Redis and read them back, unpack (what every job pays between CPU and GPU workers, twice).
- Throughput vs batch size (denoising steps x jobs per second) for full compute and mask-aware.
- Kernel-launching operators of a steady step outside the denoiser's forward, by batch size (a
  dispatch count): on a GPU the forward replays as one CUDA graph, and what remains launches one
  kernel at a time from the host.

    python -m ops.bench.overheads --out docs/bench/overheads.md
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import redis

from app.demo import demo_templates
from app.embedded import RedisServer
from app.jobs import JobParams
from app.maskgen import make_mask
from ops.bench.harness import cli
from ops.bench.harness.edits import Family
from ops.bench.harness.engine import kernels_around_the_model, record, step_costs
from workers.tensors import pack, unpack

log = logging.getLogger(__name__)


def serialization_cost(tensors: dict, meta: dict, repeats: int = 20) -> tuple[float, int]:
    """Seconds per pack + SET + GET + unpack of a job's prepared inputs, and their bytes."""

    server = RedisServer(Path(tempfile.mkdtemp(prefix="stencil-ovh-")))
    try:
        r = redis.Redis.from_url(server.url)
        start = time.perf_counter()
        for i in range(repeats):
            blob = pack(tensors, meta)
            r.set(f"b{i}", blob)
            unpack(r.get(f"b{i}"))
        return (time.perf_counter() - start) / repeats, len(blob)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/overheads.md", seed=None)
    p.add_argument("--family", default="sd", choices=["sd", "flux"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--ratio", type=float, default=0.1)
    run = cli.start(p, argv, __file__, quick=dict(steps=3, batches="1,2"))
    args = run.args
    fam = Family(args.family)
    image = demo_templates(128)[0][1].resize((fam.size, fam.size))
    params = JobParams(prompt="a hat", seed=1, steps=args.steps, guidance=7.5 if args.family == "sd" else 30.0)
    mask = make_mask(args.ratio, (fam.size, fam.size), "blob", seed=1)
    tensors, meta = fam.prepare(image, mask, params)
    key = fam.key("t0", params, meta)
    record(fam.runner_ma, tensors, meta, key, resident_steps=args.steps)
    ma_meta = dict(meta, cache_mode="masked", cache_key=key.to_dict())
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        full_step, full_over = step_costs(fam.runner_full, [(tensors, dict(meta))], b, args.steps)
        ma_step, ma_over = step_costs(fam.runner_ma, [(tensors, dict(ma_meta))], b, args.steps)
        model = getattr(fam.runner_ma, "unet", None) or fam.runner_ma.transformer
        kernels = kernels_around_the_model(fam.runner_ma, model, [(tensors, dict(ma_meta))], b, args.steps)
        rows.append((b, full_step, full_over, ma_step, ma_over, *kernels))
        log.info("batch %d: full %.1f ms/step (overhead %.2f ms), mask-aware %.1f ms/step (overhead %.2f ms)",
                 b, full_step * 1e3, full_over * 1e3, ma_step * 1e3, ma_over * 1e3)
    ser, nbytes = serialization_cost(tensors, meta)
    lines = [f"# Engine overheads and batch scaling ({args.family})\n",
             f"Command: `{run.command}` ({args.threads} torch thread(s), tiny embedded model, {fam.size}px, "
             f"mask ratio {args.ratio}).\n",
             "| batch | full ms/step | full overhead ms/step | full steps x jobs / s | mask-aware ms/step | "
             "mask-aware overhead ms/step | mask-aware steps x jobs / s | mask-aware kernels/step | "
             "of them outside the model |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, fs, fo, ms, mo, kw, ko in rows:
        lines.append(f"| {b} | {fs * 1e3:.1f} | {fo * 1e3:.2f} | {b / fs:.1f} | {ms * 1e3:.1f} | {mo * 1e3:.2f} | "
                     f"{b / ms:.1f} | {kw} | {ko} |")
    lines.append(f"\nPer-job serialization + Redis transfer of the prepared inputs ({nbytes} bytes, safetensors): "
                 f"{ser * 1e3:.2f} ms (pack + SET + GET + unpack).\n")
    run.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
