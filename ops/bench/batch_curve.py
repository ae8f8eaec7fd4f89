"""Throughput vs batch size of each engine, in process, on one model folder.

Three engines, same model weights, same image size and step count, one torch thread:

- ``stock``: ``StableDiffusionInpaintPipeline.__call__`` on a batch of B jobs (what the stock
  worker runs; text encoding, VAE encode and decode included, as in the stock loop);
- ``stencil-full``: the Stencil engine's denoising steps, full compute, B jobs in the batch;
- ``stencil-maskaware``: the same with every job masked-only against a warmed template cache.

Jobs per second of denoising work (``B / (steps * step seconds)`` for the engines, ``B / call
seconds`` for the pipeline) show whether a step of B jobs costs less than B steps of one job:
on a GPU it does (batching pays), on this CPU it is close to linear, which is what decides
whether continuous batching can beat static batching here (see ``docs/bench/e2e``).

    python -m ops.bench.batch_curve --size 256 --steps 4 --batches 1,2,4
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ops.bench.harness import cli
from ops.bench.harness.engine import batch_curve, curve_table
from ops.bench.harness.models import saved_sd_pipeline


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/batch_curve.md", seed=None)
    p.add_argument("--model-dir", default="", help="a pipeline folder (default: the e2e benchmark's model)")
    p.add_argument("--unet-hidden", default="64,128", help="block_out_channels of the default model's UNet")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--json", default="")
    run = cli.start(p, argv, __file__, quick=dict(unet_hidden="32,64", size=64, steps=2, batches="1,2"))
    args = run.args
    model_dir = Path(args.model_dir) if args.model_dir else saved_sd_pipeline(
        Path(tempfile.mkdtemp(prefix="stencil-curve-")), tuple(int(x) for x in args.unet_hidden.split(",")))
    rows = batch_curve(model_dir, size=args.size, steps=args.steps,
                       batches=[int(x) for x in args.batches.split(",")], ratio=args.ratio)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    run.write([f"# Throughput vs batch size, in process ({model_dir.name})\n",
               f"Command: `{run.command}` ({run.elapsed():.0f} s). Jobs per second of denoising, one torch thread; "
               "the stock pipeline's call includes its text encoding and VAE work.\n", curve_table(rows)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
