"""Where the mask-aware error comes from: each difference between warm-up and edit, one at a time.

A template's production warm-up differs from an edit in three inputs: the prompt (the conditional
branch of classifier-free guidance), the mask (the 9-channel inpainting UNet sees it in its input)
and the seed (the initial noise). This records, per edit, warm-ups that match the edit in a subset
of those inputs and runs the edit from each (no refresh steps), so each cause's share of the error
shows; then remedies on the production warm-up: a boundary ring (token-mask dilation), refresh
steps early only vs spread (``app/fidelity.py``), with and without the warm-up's noise outside
the mask; and how the offset drifts with the distance to the last refresh (error growth over
steps). SSIM vs full compute of the same edit, trained models.

    python -m ops.bench.fidelity_causes --family sd --guidance 7.5 --n 8 --out docs/bench/fidelity_causes.md
"""

from __future__ import annotations

import logging

import numpy as np

from app.fidelity import REFRESHES, refresh_schedule
from app.jobs import JobParams
from app.maskgen import SHAPES, make_mask
from ops.bench.harness import cli, load_trace
from ops.bench.harness.edits import DEFAULT_MODELS, EDIT_PROMPTS, Family, Option, edit, metrics, warm

log = logging.getLogger(__name__)

# name -> (warm-up matches the edit's mask, prompt, seed)
CAUSES = {
    "production warm-up (empty mask, prompt \"\", seed 0)": (False, False, False),
    "+ edit's mask": (True, False, False),
    "+ edit's seed": (False, False, True),
    "+ edit's prompt": (False, True, False),
    "+ mask and prompt": (True, True, False),
    "+ prompt and seed": (False, True, True),
    "+ mask, prompt and seed (exact)": (True, True, True),
}


def remedies(steps: int) -> dict[str, tuple[Option, int]]:
    """Remedies on the production warm-up: (option, token-mask dilation)."""
    return {
        "none (cache as is, warm-up noise outside the mask)": (Option("as-is", warm_noise=True), 0),
        "boundary ring: dilation 1 token": (Option("as-is", warm_noise=True), 1),
        "boundary ring: dilation 2 tokens": (Option("as-is", warm_noise=True), 2),
        "3 refresh steps early [0, 1, 2]": (Option("early", at=(0, 1, 2)), 0),
        "2 refresh steps [0, 12] (last one 8 steps before the end)": (Option("r12", at=(0, 12)), 0),
        "2 refresh steps [0, 16] (4 steps before the end)": (Option("r16", at=(0, 16)), 0),
        f"fast: {REFRESHES['fast']} refresh steps {refresh_schedule(REFRESHES['fast'], steps)}":
            (Option("fast", REFRESHES["fast"]), 0),
        f"balanced: {REFRESHES['balanced']} refresh steps {refresh_schedule(REFRESHES['balanced'], steps)}":
            (Option("balanced", REFRESHES["balanced"]), 0),
        "balanced, warm-up noise outside the mask": (Option("balanced-warm-noise", 3, warm_noise=True), 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/fidelity_causes.md")
    p.add_argument("--family", default="sd", choices=("sd", "flux"))
    p.add_argument("--model", default="", help="embedded model id or folder (default: the family's trained one)")
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--n", type=int, default=8, help="edits (spring trace ratios)")
    p.add_argument("--steps", type=int, default=20)
    run = cli.start(p, argv, __file__, quick=dict(n=1, steps=2))
    args = run.args
    fam = Family(args.family, model=args.model or None)
    g, steps = args.guidance, args.steps
    templates, base = fam.warmed_templates(steps, g)
    empty = np.zeros((fam.size, fam.size), bool)
    fixes = remedies(steps)
    scores: dict[str, list[dict[str, float]]] = {}
    rng = np.random.default_rng(args.seed)
    ratios = load_trace("spring")
    for k in range(args.n):
        ratio, t = float(rng.choice(ratios)), int(rng.integers(len(templates)))
        mask = make_mask(ratio, (fam.size, fam.size), SHAPES[k % len(SHAPES)], seed=int(rng.integers(1 << 30)))
        if mask.mean() in (0.0, 1.0):
            continue
        params = JobParams(prompt=str(rng.choice(EDIT_PROMPTS)), seed=int(rng.integers(1 << 30)), steps=steps,
                           guidance=g)
        tensors, meta = fam.prepare(templates[t], mask, params)
        full = fam.full(tensors, meta)
        for name, (m, pr, sd) in CAUSES.items():
            wp = JobParams(prompt=params.prompt if pr else "", seed=params.seed if sd else 0, steps=steps, guidance=g)
            key = warm(fam, f"c{k}-{m}{pr}{sd}", templates[t], mask if m else empty, wp)
            out = edit(fam, Option("as-is", warm_noise=True), templates[t], mask, params, key, warm_seed=wp.seed)
            scores.setdefault(name, []).append(metrics(full, fam.decode(out["latents"]), mask))
        for name, (opt, dilation) in fixes.items():
            fam.runner_ma.dilation = dilation
            out = edit(fam, opt, templates[t], mask, params, base[t])
            fam.runner_ma.dilation = 0
            scores.setdefault(name, []).append(metrics(full, fam.decode(out["latents"]), mask))
        log.info("edit %d done", k)
    lines = [f"# Fidelity: causes and remedies ({args.family}, `{args.model or DEFAULT_MODELS[args.family]}`)\n",
             f"Command: `{run.command}` ({run.elapsed():.0f} s). Guidance {g:g}, {steps} steps, "
             f"{len(next(iter(scores.values())))} edits at spring-trace ratios with other prompts and seeds than "
             "the production warm-up. Cause rows: a warm-up that matches the edit in the named inputs, the "
             "edit run from it without refresh steps. SSIM / PSNR vs full compute of the same edit.\n",
             "| warm-up or remedy | SSIM | SSIM unmasked | SSIM in mask | PSNR dB |", "|---|---|---|---|---|"]
    for name, rows in scores.items():
        def mean(c: str) -> float:
            return float(np.mean([r[c] for r in rows if c in r]))
        lines.append(f"| {name} | {mean('ssim'):.3f} | {mean('ssim_unmasked'):.3f} | {mean('ssim_masked'):.3f} | "
                     f"{mean('psnr'):.1f} |")
        if name.startswith("+ mask, prompt and seed"):
            lines += ["| **remedies, on the production warm-up** | | | | |"]
    run.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
