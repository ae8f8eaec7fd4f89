"""Baselines that say what the fidelity numbers can be compared with (``docs/bench/fidelity.md``).

- ``seed``: two full-compute runs of the same edit with seeds 1 and 2 (the 4 demo templates, 12 %
  blob masks, "a cat"): how much the model's output depends on the noise at all.
- ``outside``: one edit per seed (0 = the warm-up's, 7 = another), PSNR to the template outside
  the mask of full compute, of mask-aware with the edit's own noise everywhere (the behaviour
  before ``workers/noise_blend.py``) and of mask-aware with the warm-up's noise at cached tokens.

    python -m ops.bench.fidelity_baselines --model tiny-sd-inpaint-trained --guidance 3.0
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from app.demo import demo_templates
from app.jobs import JobParams
from app.maskgen import make_mask
from ops.bench.harness import cli, engine
from ops.bench.harness.edits import Family, metrics, warm
from workers import noise_blend


def seed_baseline(fam: Family, guidance: float, steps: int) -> dict[str, float]:
    rows = []
    for k, (_name, img) in enumerate(demo_templates(fam.size)):
        mask = make_mask(0.12, (fam.size, fam.size), "blob", seed=k)
        out = [fam.full(*fam.prepare(img, mask, JobParams(prompt="a cat", seed=seed, steps=steps, guidance=guidance)))
               for seed in (1, 2)]
        rows.append(metrics(out[0], out[1], mask.astype(bool)))
    return {k: round(float(np.mean([r[k] for r in rows])), 3) for k in rows[0]}


def outside_psnr(fam: Family, guidance: float, steps: int) -> list[dict[str, float]]:
    img = demo_templates(fam.size)[1][1]
    tpl = np.asarray(img).astype(float)
    key = warm(fam, "t", img, np.zeros((fam.size, fam.size), bool),
               JobParams(prompt="", seed=0, steps=steps, guidance=guidance))
    fam.runner_ma.caches.wait(key, 0, 30)  # type: ignore[union-attr]
    mask = make_mask(0.15, (fam.size, fam.size), "blob", seed=3)
    keep = ~mask.astype(bool)

    def psnr(a: np.ndarray) -> float:
        return round(float(10 * np.log10(255**2 / ((a[keep] - tpl[keep]) ** 2).mean())), 1)

    rows = []
    for seed in (0, 7):
        p = JobParams(prompt="a cat", seed=seed, steps=steps, guidance=guidance)
        t, m = fam.prepare(img, mask, p)
        masked = dict(m, cache_mode="masked", cache_key=key.to_dict())
        full = fam.full(t, m).astype(float)
        own = fam.decode(engine.run(fam.runner_ma, [(t, dict(masked))])[0]["latents"]).astype(float)
        warm_t, _ = fam.prepare(img, mask, dataclasses.replace(p, seed=0))
        blended = dict(t, latents=noise_blend.blend_sd(t["latents"], warm_t["latents"], t["pixel_mask"],
                                                       fam.pipe.vae_scale_factor))
        blend = fam.decode(engine.run(fam.runner_ma, [(blended, dict(masked))])[0]["latents"]).astype(float)
        rows.append({"seed": seed, "full": psnr(full), "maskaware_own_noise": psnr(own),
                     "maskaware_blended": psnr(blend)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="", seed=None)
    p.add_argument("--family", default="sd", choices=("sd", "flux"))
    p.add_argument("--model", default="", help="embedded model id or folder (default: the family's trained one)")
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=20)
    run = cli.start(p, argv, __file__, quick=dict(steps=2))
    args = run.args
    fam = Family(args.family, model=args.model or None)
    result: dict[str, object] = {"seed_to_seed_full_compute": seed_baseline(fam, args.guidance, args.steps)}
    if args.family == "sd":  # the warm-up-noise comparison is the SD path's (noise_blend.blend_sd)
        result["outside_mask_psnr_to_template_db"] = outside_psnr(fam, args.guidance, args.steps)
    run.write([f"# Fidelity baselines ({args.family}, guidance {args.guidance:g})\n",
                f"Command: `{run.command}` ({run.elapsed():.0f} s).\n", "```json", json.dumps(result, indent=1),
                "```"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
