"""Fidelity of mask-aware edits against full compute, per fidelity option, at given guidance.

For each mask-ratio trace, draws ratios and realistic mask shapes, warms each template the way
production does (empty mask, ``app.jobs.WARM_PROMPT``/``WARM_SEED``), then runs every edit through the
engine's own runner and scheduler (in process, no Redis): full compute, and mask-aware under each
option (``OPTIONS``: the policies of ``app/fidelity.py`` and the alternatives they were chosen
over). Reports SSIM and PSNR of the decoded images over the whole image, the unmasked region and
the mask, per model family, option and guidance; ``--json`` keeps the means for the frontier
table (``ops/bench/policy_speed.py``) and ``--write-expected`` the policies' means for job records.

    python -m ops.bench.fidelity --families sd --guidance 1.0,3.0,7.5 --out docs/bench/fidelity_sd.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from app.fidelity import EXPECTED_FILE, REFRESHES
from app.jobs import JobParams
from app.maskgen import SHAPES, make_mask
from ops.bench.harness import cli, load_trace
from ops.bench.harness.edits import (
    DEFAULT_MODELS,
    EDIT_PROMPTS,
    OPTIONS,
    Family,
    Option,
    edit,
    metrics,
    model_folder,
    warm,
)
from workers.maskaware import resnets as resnets_module
from workers.models.loader import model_identity

COLUMNS = ("ratio", "ssim", "psnr", "ssim_unmasked", "psnr_unmasked", "ssim_masked", "psnr_masked")


def bench_family(name: str, traces: list[str], n: int, steps: int, seed: int, guidance: float,
                 options: list[Option], model: str = "", pool_thresholds: tuple[float, ...] = (0.0,),
                 resnets: str = "full", size: int = 128) -> list[dict[str, Any]]:
    """Rows of (edit, option) metrics vs full compute for one family at one guidance; SD options run
    once per coarse-level token pooling threshold (named ``option+poolT`` when not the OR default);
    ``resnets="masked"``: SD's ResNets mask-aware too (options named ``option+resnets``)."""
    fam = Family(name, model=model or DEFAULT_MODELS[name], resnets=resnets, size=size)
    templates, keys = fam.warmed_templates(steps, guidance)
    rng = np.random.default_rng(seed)
    rows = []
    for trace in traces:
        ratios = load_trace(trace)
        picks = rng.choice(ratios, size=n)
        for k, ratio in enumerate(picks):
            t = int(rng.integers(len(templates)))
            mask = make_mask(float(ratio), (fam.size, fam.size), SHAPES[k % len(SHAPES)],
                             seed=int(rng.integers(1 << 30)))
            if mask.mean() == 0 or mask.mean() == 1:
                continue  # empty: the template is returned; full: full compute by construction
            params = JobParams(prompt=str(rng.choice(EDIT_PROMPTS)), seed=int(rng.integers(1 << 30)),
                               steps=steps, guidance=guidance)
            tensors, meta = fam.prepare(templates[t], mask, params)
            full = fam.full(tensors, meta)
            pixel_mask = tensors["pixel_mask"].bool().numpy()
            for opt, threshold in [(o, th) for o in options for th in (pool_thresholds if name == "sd" else (0.0,))]:
                key = warm(fam, f"t{t}-e{k}-{trace}", templates[t], mask, params) if opt.region else keys[t]
                fam.ctrl.pool_threshold = threshold  # type: ignore[union-attr]
                out = edit(fam, opt, templates[t], mask, params, key)
                label = opt.name if not threshold else f"{opt.name}+pool{threshold:g}"
                label += "+resnets" if resnets == "masked" else ""
                rows.append({"family": name, "trace": trace, "option": label, "guidance": guidance,
                             "ratio": float(pixel_mask.mean()), "refresh_steps": out["refresh_steps"],
                             **metrics(full, fam.decode(out["latents"]), pixel_mask)})
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Means per (family, guidance, option, trace)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["guidance"], r["option"], r["trace"]), []).append(r)
    out = []
    for (fam, g, opt, trace), sel in groups.items():
        means = {c: float(np.mean([r[c] for r in sel if c in r])) for c in COLUMNS}
        out.append({"family": fam, "guidance": g, "option": opt, "trace": trace, "edits": len(sel), **means})
    return out


def render(summary: list[dict[str, Any]], command: str, elapsed: float, models: dict[str, str]) -> list[str]:
    lines = ["# Fidelity: mask-aware vs full compute of the same edit, per option\n",
             f"Command: `{command}` ({elapsed:.0f} s). Models: "
             + ", ".join(f"{k} = `{v}`" for k, v in models.items())
             + ". Warm-ups as in production: empty mask, prompt \"\", seed 0; edits use other prompts ("
             + ", ".join(EDIT_PROMPTS) + ") and random seeds, masks drawn at the traces' ratios (0 and 1 "
             "skipped: exact by construction). Options: `cache-as-is` = no refresh, the warm-up's noise "
             "at cached tokens (the path before this change); `refresh-k` / `fast` / `balanced` = k "
             f"refresh steps ({', '.join(f'{k}: {v}' for k, v in REFRESHES.items())}) with the offset "
             "correction and the edit's own noise; `exact-region` = a warm-up recorded with the edit's "
             "mask, prompt and seed. PSNR is capped at 100 dB for identical images.\n",
             "| family | guidance | option | trace | edits | mean ratio | SSIM | PSNR dB | SSIM unmasked "
             "| SSIM in mask | PSNR in mask dB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    def order(r: dict[str, Any]) -> tuple:
        return (r["family"], r["guidance"], list(OPTIONS).index(r["option"].split("+")[0]), r["option"], r["trace"])

    for r in sorted(summary, key=order):
        lines.append(f"| {r['family']} | {r['guidance']:g} | {r['option']} | {r['trace']} | {r['edits']} | "
                     f"{r['ratio']:.3f} | {r['ssim']:.3f} | {r['psnr']:.1f} | {r['ssim_unmasked']:.3f} | "
                     f"{r['ssim_masked']:.3f} | {r['psnr_masked']:.1f} |")
    return lines


def expected_table(summary: list[dict[str, Any]], models: dict[str, str]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean whole-image SSIM of each policy per model and guidance (over the traces' edits)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for fam, model in models.items():
        for policy in REFRESHES:  # the approximate policies (exact needs no expectation)
            for g in sorted({r["guidance"] for r in summary if r["family"] == fam}):
                sel = [r for r in summary if r["family"] == fam and r["option"] == policy and r["guidance"] == g]
                if sel:
                    mean = sum(r["ssim"] * r["edits"] for r in sel) / sum(r["edits"] for r in sel)
                    out.setdefault(model, {}).setdefault(policy, {})[f"{g:g}"] = round(mean, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="")
    p.add_argument("--families", default="sd,flux")
    p.add_argument("--traces", default="spring,controlnet,adetailer")
    p.add_argument("--n", type=int, default=12, help="edits per trace")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", default="7.5", help="comma-separated guidance scales (CFG for SD, the "
                   "guidance embedding for Flux)")
    p.add_argument("--options", default=",".join(OPTIONS), help=f"of {', '.join(OPTIONS)}")
    p.add_argument("--sd-model", default=DEFAULT_MODELS["sd"], help="embedded model id or a pipeline folder")
    p.add_argument("--flux-model", default=DEFAULT_MODELS["flux"],
                   help="embedded model id or a pipeline folder ('' = the random-init tiny Flux Fill)")
    p.add_argument("--pool-thresholds", default="0",
                   help="comma-separated UNet coarse-level token pooling thresholds to compare (0 = OR, the default)")
    p.add_argument("--resnets", default="full", help="full,masked: SD's ResNets on the whole map and/or at "
                   "the masked tokens too (workers/maskaware/resnets.py; options named option+resnets)")
    p.add_argument("--resnet-grow", type=int, default=None, help="ablation: tokens by which masked ResNets "
                   f"compute beyond the mask (the engine's: resnets.GROW = {resnets_module.GROW})")
    p.add_argument("--size", type=int, default=128, help="image side in pixels (the trained models': 128; "
                   "larger sizes put more of a mask's UNet levels on the masked paths)")
    p.add_argument("--json", default="", help="also write the summary as JSON here")
    p.add_argument("--write-expected", action="store_true",
                   help=f"write the policies' mean SSIM per model and guidance to {EXPECTED_FILE}")
    p.add_argument("--from-json", default="", help="measure nothing: rewrite --out (and --write-expected) "
                   "from an earlier run's --json")
    run = cli.start(p, argv, __file__, quick=dict(traces="spring", n=1, steps=2, options="cache-as-is,fast"))
    args = run.args
    if args.resnet_grow is not None:
        resnets_module.GROW = args.resnet_grow  # read at each plan: this process's models compute with it
    args.out = args.out or f"docs/bench/fidelity_{args.families.replace(',', '_')}.md"
    models = {f: (args.sd_model if f == "sd" else args.flux_model) for f in args.families.split(",")}
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        command, summary, elapsed = saved["command"], saved["summary"], float(saved.get("elapsed_s", 0.0))
        models = saved.get("models", models)
    else:
        options = [OPTIONS[o] for o in args.options.split(",")]
        rows: list[dict[str, Any]] = []
        for g in (float(x) for x in args.guidance.split(",")):
            for fam in models:
                for resnets in args.resnets.split(",") if fam == "sd" else ["full"]:
                    rows += bench_family(fam, args.traces.split(","), args.n, args.steps, args.seed, g, options,
                                         models[fam], tuple(float(x) for x in args.pool_thresholds.split(",")),
                                         resnets, args.size)
        summary, elapsed, command = summarize(rows), run.elapsed(), run.command
    named = {f: m or "tiny-flux-fill (random init)" for f, m in models.items()}
    run.write(render(summary, command, elapsed, named))
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"command": command, "summary": summary, "elapsed_s": elapsed,
                                               "models": models}, indent=1) + "\n")
    if args.write_expected:
        table = json.loads(EXPECTED_FILE.read_text()) if EXPECTED_FILE.is_file() else {}
        # keyed by the model's identity (its weights), as workers name the model they serve
        ids = {f: model_identity(model_folder(m)) for f, m in models.items() if m}
        for model, policies in expected_table(summary, ids).items():
            for policy, by_g in policies.items():
                table.setdefault(model, {}).setdefault(policy, {}).update(by_g)
        EXPECTED_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
