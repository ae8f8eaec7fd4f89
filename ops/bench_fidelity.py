"""Fidelity of mask-aware edits against full compute, per fidelity option, at given guidance.

For each mask-ratio trace, draws ratios and realistic mask shapes, warms each template the way
production does (empty mask, ``STENCIL_WARM_PROMPT``/seed), then runs every edit through the
engine's own runner and scheduler (in process, no Redis): full compute, and mask-aware under each
option (``OPTIONS``: the policies of ``app/fidelity.py`` and the alternatives they were chosen
over). Reports SSIM and PSNR of the decoded images over the whole image, the unmasked region and
the mask, per model family, option and guidance; ``--json`` keeps the means for the frontier
table (``ops/bench_policy_speed.py``) and ``--write-expected`` the policies' means for job records.

    python -m ops.bench_fidelity --guidance 1.0,3.0,7.5 --out docs/bench/fidelity.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from skimage.metrics import structural_similarity

from app.fidelity import EXPECTED_FILE, REFRESHES, refresh_schedule
from app.jobs import JobParams
from app.maskgen import SHAPES, make_mask
from app.storage import LocalStore
from ops.sim.traces import load_trace
from workers import noise_blend
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.engine.template_cache import CacheRecorder, StepCacheProvider
from workers.maskaware.activation_store import ActivationStore, TemplateCacheKey

log = logging.getLogger("bench_fidelity")


class Family:
    """Model-family specifics: pipeline, runner, prepare and decode."""

    @property
    def scheduler_config(self) -> dict:
        """The scheduler config as a saved folder holds it (with its class name)."""
        return {**dict(self.pipe.scheduler.config), "_class_name": type(self.pipe.scheduler).__name__}

    def __init__(self, name: str, activations: ActivationStore, model: str = "tiny-sd-inpaint-trained") -> None:
        self.name = name
        if name == "sd":
            from workers.engine.sd_runner import SDRunner
            from workers.maskaware.unet import MaskAwareUNet

            self.pipe = load_sd_pipeline(model)
            model = self.pipe.unet.eval()
            self.size, self.layout = 128, "kv+y"
            self.runner_full = SDRunner(model, self.scheduler_config)
            self.ctrl = MaskAwareUNet(model)
            self.runner_ma = SDRunner(model, self.scheduler_config, maskaware=self.ctrl,
                                      caches=StepCacheProvider(activations, 1 << 30),
                                      recorder=CacheRecorder(activations), prefetch_steps=64)
        else:
            from workers.engine.flux_runner import FluxRunner
            from workers.maskaware.flux import MaskAwareFlux

            self.pipe = load_flux_pipeline(model)
            model = self.pipe.transformer.eval()
            self.size, self.layout = (128 if model else 64), "flux-kv-raw"
            cfg = self.scheduler_config
            self.runner_full = FluxRunner(model, cfg, self.pipe.vae_scale_factor)
            self.ctrl = MaskAwareFlux(model)
            self.runner_ma = FluxRunner(model, cfg, self.pipe.vae_scale_factor, maskaware=self.ctrl,
                                        caches=StepCacheProvider(activations, 1 << 30),
                                        recorder=CacheRecorder(activations), prefetch_steps=64)

    def prepare(self, image: Image.Image, mask: np.ndarray, params: JobParams) -> tuple[dict, dict]:
        mask_img = Image.fromarray(mask.astype(np.uint8) * 255)
        cfg = self.scheduler_config
        if self.name == "sd":
            from workers.sd_inputs import prepare_job_tensors

            prep = prepare_job_tensors(self.pipe, cfg, image, mask_img, params, self.size, self.size)
        else:
            from workers.flux_inputs import prepare_flux_job_tensors

            prep = prepare_flux_job_tensors(self.pipe, cfg, image, mask_img, params, self.size, self.size)
        return dict(prep.tensors), dict(prep.meta)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        if self.name == "sd":
            from workers.sd_inputs import decode_latents

            img = decode_latents(self.pipe, latents)
        else:
            from workers.flux_inputs import decode_flux_latents

            img = decode_flux_latents(self.pipe, latents, self.size, self.size)
        return np.asarray(img)

    def key(self, template_id: str, params: JobParams, meta: dict) -> TemplateCacheKey:
        return TemplateCacheKey(model_id=f"bench-{self.name}", template_id=template_id, height=self.size,
                                width=self.size, scheduler=str(self.pipe.scheduler.config["_class_name"]),
                                steps=params.steps, strength=params.strength,
                                guidance="cfg2" if meta["do_cfg"] else "single", layout=self.layout)


def load_flux_pipeline(model: str):  # type: ignore[no-untyped-def]
    """The Flux Fill pipeline to measure: an embedded model id, a folder, or "" for the random-init
    tiny model (64x64)."""
    from diffusers import FluxFillPipeline

    from workers.models.tiny_flux import build_flux_fill_pipeline

    if not model:
        return build_flux_fill_pipeline(0)
    pipe = FluxFillPipeline.from_pretrained(_model_folder(model), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model_folder(model: str) -> Path:
    """A pipeline folder, or an embedded model id saved to a temporary home."""
    from app.settings import Settings
    from workers.models.loader import ensure_model_dir

    if Path(model).is_dir():
        return Path(model)
    return ensure_model_dir(Settings.from_env(home=Path(tempfile.mkdtemp(prefix="stencil-fid-home-")),
                                              model_dir="", model_id=model))


def load_sd_pipeline(model: str):  # type: ignore[no-untyped-def]
    """The SD pipeline to measure: an embedded model id (saved to a temporary home) or a folder.
    Fidelity of the random-init model measures noise against noise, so the default is the trained one."""
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(_model_folder(model), safety_checker=None,
                                                          feature_extractor=None, requires_safety_checker=False,
                                                          torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# Edit prompts: captions the trained model knows, none of them the warm-up prompt ("").
EDIT_PROMPTS = ["a cat", "an astronaut", "grass", "a brick wall", "the moon", "a cup of coffee", "a rocket"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run a mask-aware edit: refresh steps (with the offset correction of
    ``runner_base``), the warm-up's noise outside the mask, or a warm-up of the edit itself."""

    name: str
    refreshes: int = 0
    warm_noise: bool = False  # start from the warm-up's noise at cached tokens (noise_blend)
    region: bool = False  # a warm-up recorded with this edit's mask, prompt and seed: exact
    at: tuple[int, ...] = ()  # explicit refresh steps (schedules no policy uses)

    def schedule(self, steps: int) -> list[int]:
        return list(self.at) if self.at else refresh_schedule(self.refreshes, steps)


OPTIONS = {o.name: o for o in (
    Option("cache-as-is", warm_noise=True),  # the path before refresh steps (warm-up noise outside)
    Option("refresh-1", 1), Option("fast", REFRESHES["fast"]), Option("balanced", REFRESHES["balanced"]),
    Option("refresh-4", 4), Option("exact-region", region=True),
)}


def run(runner: Any, jobs: list[tuple[dict, dict]]) -> list[dict]:
    """Run jobs to completion in one continuous-batching engine (in process)."""
    engine = Engine(runner, BatchScheduler(max_batch=4))
    handles = [engine.submit(f"j{i}", t, m, total_steps=int(m["num_steps"])) for i, (t, m) in enumerate(jobs)]
    engine._drain_inbox(block=False)
    while engine.step_once():
        engine._drain_inbox(block=False)
    return [h.future.result() for h in handles]


def metrics(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    ssim_full, ssim_map = structural_similarity(a, b, channel_axis=2, data_range=255, full=True)
    out = {"ssim": float(ssim_full), "psnr": psnr(a, b)}
    for region, sel in (("unmasked", ~mask), ("masked", mask)):
        if sel.any():
            out[f"ssim_{region}"] = float(ssim_map[sel].mean())
            out[f"psnr_{region}"] = psnr(a[sel], b[sel])
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB, capped at 100 for identical images (so means stay finite)."""
    err = float(((a.astype(float) - b.astype(float)) ** 2).mean())
    return min(100.0, float(10 * np.log10(255**2 / err))) if err > 0 else 100.0


def warm(fam: Family, template_id: str, image: Image.Image, mask: np.ndarray, params: JobParams) -> TemplateCacheKey:
    """Record a warm-up as the service does and wait until its cache is committed."""
    tensors, meta = fam.prepare(image, mask, params)
    key = fam.key(template_id, params, meta)
    run(fam.runner_ma, [(tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))])[0]["commit"].result(300)
    return key


def edit(fam: Family, option: Option, image: Image.Image, mask: np.ndarray, params: JobParams,
         key: TemplateCacheKey, warm_seed: int = 0) -> dict:
    """One mask-aware edit under ``option`` from the cache at ``key``."""
    tensors, meta = fam.prepare(image, mask, params)
    if option.warm_noise and params.seed != warm_seed:
        warm_t, _ = fam.prepare(image, mask, dataclasses.replace(params, seed=warm_seed))
        blend = noise_blend.blend_sd if fam.name == "sd" else noise_blend.blend_flux
        tensors = dict(tensors, latents=blend(tensors["latents"], warm_t["latents"], tensors["pixel_mask"],
                                              fam.pipe.vae_scale_factor))
    for step in range(int(meta["num_steps"])):  # resident, as after the service's prefetch
        fam.runner_ma.caches.wait(key, step, 30)  # type: ignore[union-attr]
    meta = dict(meta, cache_mode="masked", cache_key=key.to_dict(), refresh_steps=option.schedule(params.steps))
    return run(fam.runner_ma, [(tensors, meta)])[0]


def bench_family(name: str, traces: list[str], n: int, steps: int, seed: int, guidance: float,
                 options: list[Option], model: str = "") -> list[dict[str, Any]]:
    """Rows of (edit, option) metrics vs full compute for one family at one guidance."""
    from app.demo import demo_templates

    activations = ActivationStore(LocalStore(tempfile.mkdtemp(prefix="stencil-fid-")))
    fam = Family(name, activations, model or DEFAULT_MODELS[name])
    templates = [img.resize((fam.size, fam.size)) for _n, img in demo_templates(128)]
    empty = np.zeros((fam.size, fam.size), bool)
    keys = [warm(fam, f"t{i}", image, empty, JobParams(prompt="", seed=0, steps=steps, guidance=guidance))
            for i, image in enumerate(templates)]
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
            full = fam.decode(run(fam.runner_full, [(tensors, dict(meta))])[0]["latents"])
            pixel_mask = tensors["pixel_mask"].bool().numpy()
            for opt in options:
                key = warm(fam, f"t{t}-e{k}-{trace}", templates[t], mask, params) if opt.region else keys[t]
                out = edit(fam, opt, templates[t], mask, params, key)
                rows.append({"family": name, "trace": trace, "option": opt.name, "guidance": guidance,
                             "ratio": float(pixel_mask.mean()), "refresh_steps": out["refresh_steps"],
                             **metrics(full, fam.decode(out["latents"]), pixel_mask)})
    return rows


DEFAULT_MODELS = {"sd": "tiny-sd-inpaint-trained", "flux": "tiny-flux-fill-trained"}
COLUMNS = ("ratio", "ssim", "psnr", "ssim_unmasked", "psnr_unmasked", "ssim_masked", "psnr_masked")


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
    for r in sorted(summary, key=lambda r: (r["family"], r["guidance"], list(OPTIONS).index(r["option"]),
                                            r["trace"])):
        lines.append(f"| {r['family']} | {r['guidance']:g} | {r['option']} | {r['trace']} | {r['edits']} | "
                     f"{r['ratio']:.3f} | {r['ssim']:.3f} | {r['psnr']:.1f} | {r['ssim_unmasked']:.3f} | "
                     f"{r['ssim_masked']:.3f} | {r['psnr_masked']:.1f} |")
    return lines


def expected_table(summary: list[dict[str, Any]], models: dict[str, str]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean whole-image SSIM of each policy per model and guidance (over the traces' edits)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for fam, model in models.items():
        for policy in ("balanced", "fast"):
            for g in sorted({r["guidance"] for r in summary if r["family"] == fam}):
                sel = [r for r in summary if r["family"] == fam and r["option"] == policy and r["guidance"] == g]
                if sel:
                    mean = sum(r["ssim"] * r["edits"] for r in sel) / sum(r["edits"] for r in sel)
                    out.setdefault(model, {}).setdefault(policy, {})[f"{g:g}"] = round(mean, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="sd,flux")
    p.add_argument("--traces", default="spring,controlnet,adetailer")
    p.add_argument("--n", type=int, default=12, help="edits per trace")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidance", default="7.5", help="comma-separated guidance scales (CFG for SD, the "
                   "guidance embedding for Flux)")
    p.add_argument("--options", default=",".join(OPTIONS), help=f"of {', '.join(OPTIONS)}")
    p.add_argument("--sd-model", default=DEFAULT_MODELS["sd"], help="embedded model id or a pipeline folder")
    p.add_argument("--flux-model", default=DEFAULT_MODELS["flux"],
                   help="embedded model id or a pipeline folder ('' = the random-init tiny Flux Fill)")
    p.add_argument("--quick", action="store_true", help="3 edits per trace, 2 options, 10 steps")
    p.add_argument("--out", default="docs/bench/fidelity.md")
    p.add_argument("--json", default="", help="also write the summary as JSON here")
    p.add_argument("--write-expected", action="store_true",
                   help=f"write the policies' mean SSIM per model and guidance to {EXPECTED_FILE}")
    p.add_argument("--from-json", default="", help="measure nothing: rewrite --out (and --write-expected) "
                   "from an earlier run's --json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.quick:
        args.n, args.steps, args.options = 3, 10, "cache-as-is,balanced"
    torch.set_num_threads(1)
    t0 = time.monotonic()
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
                rows += bench_family(fam, args.traces.split(","), args.n, args.steps, args.seed, g, options,
                                     models[fam])
        summary, elapsed = summarize(rows), time.monotonic() - t0
        command = "python -m ops.bench_fidelity " + " ".join(argv if argv is not None else sys.argv[1:])
    named = {f: m or "tiny-flux-fill (random init)" for f, m in models.items()}
    write_markdown(Path(args.out), render(summary, command, elapsed, named))
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"command": command, "summary": summary, "elapsed_s": elapsed,
                                               "models": models}, indent=1) + "\n")
    if args.write_expected:
        table = json.loads(EXPECTED_FILE.read_text()) if EXPECTED_FILE.is_file() else {}
        for model, policies in expected_table(summary, {f: m for f, m in models.items() if m}).items():
            for policy, by_g in policies.items():
                table.setdefault(model, {}).setdefault(policy, {}).update(by_g)
        EXPECTED_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


def write_markdown(out: Path, lines: list[str]) -> None:
    """Write a benchmark's report lines (shared by the in-process benchmarks)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    log.info("wrote %s", out)


if __name__ == "__main__":
    raise SystemExit(main())
