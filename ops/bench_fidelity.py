"""Fidelity of mask-aware edits against full compute, with prompts and seeds unlike the warm-up.

For each mask-ratio trace, draws ratios and realistic mask shapes, warms each template the way
production does (empty mask, ``STENCIL_WARM_PROMPT``/seed), then runs every edit twice through
the engine's own runner and scheduler (in process, no Redis): mask-aware with the template's
cache, and full compute. Reports SSIM and PSNR of the decoded images over the whole image and over
the unmasked region, per model family.

    python -m ops.bench_fidelity --out docs/bench/fidelity.md
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

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

    def __init__(self, name: str, activations: ActivationStore, sd_model: str = "tiny-sd-inpaint-trained") -> None:
        self.name = name
        if name == "sd":
            from workers.engine.sd_runner import SDRunner
            from workers.maskaware.unet import MaskAwareUNet

            self.pipe = load_sd_pipeline(sd_model)
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
            from workers.models.tiny_flux import build_flux_fill_pipeline

            self.pipe = build_flux_fill_pipeline(0)
            model = self.pipe.transformer.eval()
            self.size, self.layout = 64, "flux-kv-raw"
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


def load_sd_pipeline(model: str):  # type: ignore[no-untyped-def]
    """The SD pipeline to measure: an embedded model id (saved to a temporary home) or a folder.
    Fidelity of the random-init model measures noise against noise, so the default is the trained one."""
    from diffusers import StableDiffusionInpaintPipeline

    from app.settings import Settings
    from workers.models.loader import ensure_model_dir

    if Path(model).is_dir():
        folder = Path(model)
    else:
        folder = ensure_model_dir(Settings.from_env(home=Path(tempfile.mkdtemp(prefix="stencil-fid-home-")),
                                                   model_dir="", model_id=model))
    pipe = StableDiffusionInpaintPipeline.from_pretrained(folder, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# Edit prompts: captions the trained model knows, none of them the warm-up prompt ("").
EDIT_PROMPTS = ["a cat", "an astronaut", "grass", "a brick wall", "the moon", "a cup of coffee", "a rocket"]


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
    out = {"ssim": float(ssim_full), "psnr": float(peak_signal_noise_ratio(a, b, data_range=255))}
    for region, sel in (("unmasked", ~mask), ("masked", mask)):
        if sel.any():
            out[f"ssim_{region}"] = float(ssim_map[sel].mean())
            err = ((a[sel].astype(float) - b[sel].astype(float)) ** 2).mean()
            out[f"psnr_{region}"] = float(10 * np.log10(255**2 / err)) if err > 0 else float("inf")
    return out


def bench_family(name: str, traces: list[str], n: int, steps: int, seed: int,
                 sd_model: str = "tiny-sd-inpaint-trained", edit_seed: int = -1,
                 sd_guidance: float = 7.5) -> list[dict[str, Any]]:
    from app.demo import demo_templates

    tmp = tempfile.mkdtemp(prefix="stencil-fid-")
    activations = ActivationStore(LocalStore(tmp))
    fam = Family(name, activations, sd_model)
    guidance = sd_guidance if name == "sd" else 30.0
    templates = [img.resize((fam.size, fam.size)) for _n, img in demo_templates(128)]
    # Warm-ups the way production runs them: empty mask, the warm prompt and seed.
    for i, image in enumerate(templates):
        params = JobParams(prompt="", seed=0, steps=steps, guidance=guidance)
        tensors, meta = fam.prepare(image, np.zeros((fam.size, fam.size), bool), params)
        key = fam.key(f"t{i}", params, meta)
        meta.update(cache_mode="record", cache_key=key.to_dict())
        out = run(fam.runner_ma, [(tensors, meta)])[0]
        out["commit"].result(timeout=300)
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
                continue  # empty: the template is returned; full: equals full compute by construction
            job_seed = int(rng.integers(1 << 30))
            params = JobParams(prompt=str(rng.choice(EDIT_PROMPTS)),
                               seed=job_seed if edit_seed < 0 else edit_seed, steps=steps, guidance=guidance)
            tensors, meta = fam.prepare(templates[t], mask, params)
            full = run(fam.runner_full, [(tensors, dict(meta))])[0]
            ma_meta = dict(meta, cache_mode="masked", cache_key=fam.key(f"t{t}", params, meta).to_dict())
            fam.runner_ma.caches.wait(fam.key(f"t{t}", params, meta), 0, 30)  # type: ignore[union-attr]
            ma_tensors = dict(tensors)
            if params.seed != 0:  # as the service does: the warm-up's noise outside the mask
                warm_t, _ = fam.prepare(templates[t], mask, dataclasses.replace(params, seed=0))
                blend = noise_blend.blend_sd if name == "sd" else noise_blend.blend_flux
                ma_tensors["latents"] = blend(tensors["latents"], warm_t["latents"], tensors["pixel_mask"],
                                              fam.pipe.vae_scale_factor)
            ma = run(fam.runner_ma, [(ma_tensors, ma_meta)])[0]
            a, b = fam.decode(full["latents"]), fam.decode(ma["latents"])
            pixel_mask = tensors["pixel_mask"].bool().numpy()
            rows.append({"family": name, "trace": trace, "ratio": float(pixel_mask.mean()),
                         "masked_steps": ma["masked_steps"], **metrics(a, b, pixel_mask)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="sd,flux")
    p.add_argument("--traces", default="spring,controlnet,adetailer")
    p.add_argument("--n", type=int, default=12, help="edits per trace")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sd-model", default="tiny-sd-inpaint-trained",
                   help="embedded model id or a pipeline folder (Flux is always the random-init tiny model)")
    p.add_argument("--edit-seed", type=int, default=-1,
                   help="diagnosis only: give every edit this seed (0 = the warm-up's); -1 = a random seed per edit")
    p.add_argument("--sd-guidance", type=float, default=7.5,
                   help="classifier-free guidance of SD warm-ups and edits (the demo uses 3.0 on the trained model)")
    p.add_argument("--out", default="docs/bench/fidelity.md")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    for fam in args.families.split(","):
        rows += bench_family(fam, args.traces.split(","), args.n, args.steps, args.seed, args.sd_model, args.edit_seed,
                             args.sd_guidance)
    lines = ["# Fidelity: mask-aware vs full compute (prompt and seed differ from the warm-up)\n",
             f"Command: `python -m ops.bench_fidelity --families {args.families} --traces {args.traces} "
             f"--n {args.n} --steps {args.steps} --sd-model {args.sd_model} --sd-guidance {args.sd_guidance}"
             + (f" --edit-seed {args.edit_seed}" if args.edit_seed >= 0 else "")
             + f"` ({time.monotonic() - t0:.0f} s). "
             f"Models: SD = `{args.sd_model}` (128x128), Flux = the random-init tiny Flux Fill (64x64); "
             "warm-ups use an empty mask, prompt \"\" and seed 0, edits other prompts "
             f"({', '.join(EDIT_PROMPTS)}) and seeds. Ratios 0 and 1 are skipped (exact by construction). "
             "Each column compares the mask-aware result with the full-compute result of the same job.\n",
             "| family | trace | edits | mean mask ratio | SSIM | PSNR dB | SSIM unmasked | PSNR unmasked dB "
             "| SSIM in mask | PSNR in mask dB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fam in args.families.split(","):
        for trace in args.traces.split(","):
            sel = [r for r in rows if r["family"] == fam and r["trace"] == trace]
            if not sel:
                continue

            def avg(k: str) -> float:
                vals = [r[k] for r in sel if k in r and np.isfinite(r[k])]
                return float(np.mean(vals)) if vals else float("nan")

            lines.append(f"| {fam} | {trace} | {len(sel)} | {avg('ratio'):.3f} | {avg('ssim'):.3f} | "
                         f"{avg('psnr'):.1f} | {avg('ssim_unmasked'):.3f} | {avg('psnr_unmasked'):.1f} | "
                         f"{avg('ssim_masked'):.3f} | {avg('psnr_masked'):.1f} |")
    write_markdown(Path(args.out), lines)
    return 0


def write_markdown(out: Path, lines: list[str]) -> None:
    """Write a benchmark's report lines (shared by the in-process benchmarks)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    log.info("wrote %s", out)


if __name__ == "__main__":
    raise SystemExit(main())
