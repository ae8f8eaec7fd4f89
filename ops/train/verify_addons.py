"""Measure the trained LoRAs and the canny ControlNet with the stock diffusers pipelines.

Why a script: the verification tables in ``docs/bench/training_addons.md`` must be reproducible
from the committed weights (fixed templates, masks, seeds), and the tests reuse its functions.

Cases: held-out images only (``HELD_OUT``: clock, motorcycle), each as a centre crop and two
seeded random crops (``Crops``, the trainer's augmentation) at 128 px, one mask each (blob / rect
/ stroke, 30-40 %). Every edit: prompt = the image's caption, 15 DDIM steps, guidance 3.0,
generator seed 0 -- identical across the variants compared.

LoRAs (``StableDiffusionInpaintPipeline`` + ``load_lora_weights(dir, adapter_name=style)`` +
``set_adapters``): per case, the style statistics inside the mask (``ops.train.styles``) without
LoRA, with each LoRA at its recommended scale (``SCALES``; noir also at 1.0), with two combined
(``set_adapters([sepia, noir], [0.8, 0.5])``), with the sepia LoRA's text-encoder part disabled
and, as a negative control, with a random-init adapter of the same shape (``init_lora_weights=
False``); outside the mask the PSNR of each result to the no-LoRA result and to the template.

ControlNet (``StableDiffusionControlNetInpaintPipeline.from_pretrained(base, controlnet=...)``):
control = canny edges of the template; edge F1 inside the mask (eroded by 2 px so the seam at the
mask border does not count) between ``canny(result)`` and the control edges, with a 2-px
tolerance; variants: without ControlNet (the inpainting pipeline), conditioning scale 0, the
matched control at the pipeline's default scale (0.5, as trained) and at 1.0, a mismatched
control (a case of the other image), and a random-init ControlNet (trained weights, random
zero convolutions).

    python -m ops.train.verify_addons --json docs/bench/training_addons.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ops.train.common import HELD_OUT, Crops, load_source
from ops.train.controlnet import CANNY_SIGMA, canny_edges, control_image
from ops.train.styles import PRIMARY, STYLE_NAMES, mean_lch, style_scores

log = logging.getLogger("verify_addons")

BASE = Path("workers/models/trained/tiny-sd-inpaint-trained")
LORAS = Path("workers/models/trained/loras")
CONTROLNET = Path("workers/models/trained/tiny-sd-controlnet-canny")
STEPS, GUIDANCE, SEED = 15, 3.0, 0
COMBINED = (("sepia", 0.8), ("noir", 0.5))
# Recommended adapter scale per style: the noir LoRA overshoots at 1.0 under CFG 3 (fills near
# black, darkening leaking outside the mask), 0.5 lands on the style (docs/bench/training_addons.md).
SCALES = {"sepia": 1.0, "noir": 0.5}
MASKS = (("blob", 0.35, 3), ("rect", 0.3, 5), ("stroke", 0.4, 7))


@dataclass
class Case:
    image: str
    caption: str
    template: Image.Image
    mask: np.ndarray  # bool HxW

    @property
    def name(self) -> str:
        return self.image


def centre_crop(img: Image.Image, size: int = 128) -> Image.Image:
    side = min(img.size)
    return img.crop(((img.width - side) // 2, (img.height - side) // 2, (img.width + side) // 2,
                     (img.height + side) // 2)).resize((size, size), Image.BICUBIC)


def held_out_cases(per_image: int = 3, seed: int = 123) -> list[Case]:
    """``per_image`` templates per held-out image (centre crop, then seeded random crops), one mask each."""
    from app.maskgen import make_mask

    cases = []
    for k, (name, caption) in enumerate(HELD_OUT.items()):
        src = load_source(name)
        crops = Crops([src], np.random.default_rng(seed + k), min_cover=0.5)
        for j in range(per_image):
            if j == 0:
                tpl = centre_crop(src)
            else:
                arr = crops.sample(0)  # [-1, 1] CHW
                tpl = Image.fromarray(((arr.transpose(1, 2, 0) + 1) * 127.5).round().clip(0, 255).astype(np.uint8))
            shape, ratio, mseed = MASKS[j % len(MASKS)]
            cases.append(Case(name, caption, tpl, make_mask(ratio, (128, 128), shape, seed=mseed + 10 * k)))
    return cases


def inpaint_pipe(base: Path = BASE):  # type: ignore[no-untyped-def]
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(base, safety_checker=None, feature_extractor=None,
                                                          requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def controlnet_pipe(controlnet, base: Path = BASE):  # type: ignore[no-untyped-def]
    from diffusers import StableDiffusionControlNetInpaintPipeline

    pipe = StableDiffusionControlNetInpaintPipeline.from_pretrained(
        base, controlnet=controlnet, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def edit(pipe, case: Case, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    """One edit of ``case`` (fixed steps, guidance and seed) -> uint8 HxWx3."""
    out = pipe(prompt=case.caption, image=case.template, mask_image=Image.fromarray(case.mask.astype(np.uint8) * 255),
               height=128, width=128, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
               generator=torch.Generator("cpu").manual_seed(SEED), **kw).images[0]
    return np.asarray(out)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    err = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean()
    return float(10 * np.log10(255**2 / max(err, 1e-12)))


def edge_f1(result: np.ndarray, control: np.ndarray, mask: np.ndarray, tol: int = 2) -> float:
    """F1 of ``canny(result)`` vs the control edges inside ``mask`` eroded by 2 px, ``tol``-px tolerance."""
    from scipy.ndimage import binary_dilation, binary_erosion

    inner = binary_erosion(mask, iterations=2)
    er, ec = canny_edges(result) & inner, control & inner
    if er.sum() == 0 or ec.sum() == 0:
        return 0.0
    st = np.ones((2 * tol + 1, 2 * tol + 1), bool)
    precision = (er & binary_dilation(ec, st)).sum() / er.sum()
    recall = (ec & binary_dilation(er, st)).sum() / ec.sum()
    return float(0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))


def tile_row(tiles: list[np.ndarray]) -> np.ndarray:
    gap = np.full((tiles[0].shape[0], 4, 3), 255, np.uint8)
    parts: list[np.ndarray] = []
    for t in tiles:
        parts += [t, gap]
    return np.concatenate(parts[:-1], axis=1)


def mask_tile(case: Case) -> np.ndarray:
    base = np.asarray(case.template, dtype=np.float32)
    tint = base.copy()
    tint[case.mask] = 0.35 * tint[case.mask] + 0.65 * np.array([255.0, 0.0, 255.0])
    return tint.astype(np.uint8)


def save_strips(rows: dict[str, list[np.ndarray]], prefix: str, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for image, rs in rows.items():
        gap = np.full((4, rs[0].shape[1], 3), 255, np.uint8)
        parts: list[np.ndarray] = []
        for r in rs:
            parts += [r, gap]
        path = out_dir / f"{prefix}_{image}.jpg"
        # JPEG at quality 90: an illustration, about half a palette PNG's bytes (the repository's size)
        Image.fromarray(np.concatenate(parts[:-1], axis=0)).save(path, quality=90, optimize=True)
        written.append(str(path))
    return written


def random_lora(pipe, name: str, like: str, seed: int = 1) -> None:  # type: ignore[no-untyped-def]
    """A random-init adapter with ``like``'s UNet config (negative control: a LoRA that does *something*)."""
    import warnings

    from peft import LoraConfig

    cfg = pipe.unet.peft_config[like].to_dict()
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # "Already found a peft_config": a second adapter is the point
        warnings.simplefilter("ignore", UserWarning)
        pipe.unet.add_adapter(LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"],
                                         target_modules=list(cfg["target_modules"]), init_lora_weights=False),
                              adapter_name=name)


def verify_loras(cases: list[Case], strips: Path | None) -> dict:
    from diffusers.loaders.lora_base import disable_lora_for_text_encoder, enable_lora_for_text_encoder

    pipe = inpaint_pipe()
    for s in STYLE_NAMES:
        pipe.load_lora_weights(LORAS / s, adapter_name=s)
    random_lora(pipe, "random_init", STYLE_NAMES[0])
    combined = "+".join(n for n, _ in COMBINED)
    variants: list[tuple[str, list[str], list[float]]] = [("none", [], [])]
    variants += [(s, [s], [SCALES[s]]) for s in STYLE_NAMES]
    variants += [(f"{s}_scale_1.0", [s], [1.0]) for s in STYLE_NAMES if SCALES[s] != 1.0]
    variants.append((combined, [n for n, _ in COMBINED], [w for _, w in COMBINED]))
    variants.append(("random_init", ["random_init"], [1.0]))
    rows: list[dict] = []
    strip_rows: dict[str, list[np.ndarray]] = {}
    for i, case in enumerate(cases):
        tpl = np.asarray(case.template)
        outs: dict[str, np.ndarray] = {}
        for label, names, weights in variants:
            if names:
                pipe.enable_lora()
                pipe.set_adapters(names, weights)
            else:
                pipe.disable_lora()
            outs[label] = edit(pipe, case)
        if "sepia" in STYLE_NAMES:  # the sepia LoRA without its text-encoder part
            pipe.enable_lora()
            pipe.set_adapters(["sepia"], [1.0])
            disable_lora_for_text_encoder(pipe.text_encoder)
            outs["sepia_unet_only"] = edit(pipe, case)
            enable_lora_for_text_encoder(pipe.text_encoder)
        keep = ~case.mask
        for label, img in outs.items():
            row = {"case": i, "image": case.image, "variant": label, "mask_ratio": round(float(case.mask.mean()), 3),
                   "inside_psnr_to_none": round(psnr(img[case.mask], outs["none"][case.mask]), 2),
                   "outside_psnr_to_none": round(psnr(img[keep], outs["none"][keep]), 2),
                   "outside_psnr_to_template": round(psnr(img[keep], tpl[keep]), 2)}
            for s in STYLE_NAMES:
                sc = style_scores(s, img, tpl, case.mask)
                for k in style_keys(s):
                    row[f"{s}.{k}"] = round(sc[k], 4)
            row["mean_L"], row["mean_chroma"], row["hue_deg"] = (round(v, 1) for v in mean_lch(img, case.mask))
            rows.append(row)
        tiles = [tpl, mask_tile(case), outs["none"]] + [outs[s] for s in STYLE_NAMES] + [outs[combined]]
        strip_rows.setdefault(case.image, []).append(tile_row(tiles))
    files = save_strips(strip_rows, "lora", strips) if strips else []
    columns = ["template", "mask", "no LoRA", *(f"{s} ({SCALES[s]})" for s in STYLE_NAMES),
               combined + " (" + ", ".join(str(w) for _, w in COMBINED) + ")"]
    return {"rows": rows, "strips": files, "scales": SCALES, "combined": COMBINED, "strip_columns": columns}


def verify_controlnet(cases: list[Case], strips: Path | None, folder: Path = CONTROLNET) -> dict:
    from diffusers import ControlNetModel

    cn = ControlNetModel.from_pretrained(folder)
    pipe = controlnet_pipe(cn)
    plain = inpaint_pipe()
    # Negative control: the same architecture with random zero-convolutions (does something, not edges).
    rand = ControlNetModel.from_pretrained(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in [*rand.controlnet_down_blocks, rand.controlnet_mid_block, rand.controlnet_cond_embedding.conv_out]:
            m.weight.normal_(0, 0.02)
    rand_pipe = controlnet_pipe(rand)
    edges = [canny_edges(np.asarray(c.template)) for c in cases]
    rows: list[dict] = []
    strip_rows: dict[str, list[np.ndarray]] = {}
    for i, case in enumerate(cases):
        # Mismatched control: the edges of a case of the *other* held-out image.
        j = (i + len(cases) // 2) % len(cases)
        ctrl, wrong = control_image(edges[i]), control_image(edges[j])
        outs = {"without": edit(plain, case),
                "scale_0": edit(pipe, case, control_image=ctrl, controlnet_conditioning_scale=0.0),
                "matched": edit(pipe, case, control_image=ctrl),  # the pipeline default scale, 0.5 (as trained)
                "matched_scale_1.0": edit(pipe, case, control_image=ctrl, controlnet_conditioning_scale=1.0),
                "mismatched": edit(pipe, case, control_image=wrong),
                "random_init": edit(rand_pipe, case, control_image=ctrl)}
        keep = ~case.mask
        for label, img in outs.items():
            rows.append({"case": i, "image": case.image, "variant": label,
                         "edge_f1": round(edge_f1(img, edges[i], case.mask), 4),
                         "edge_f1_to_mismatched": round(edge_f1(img, edges[j], case.mask), 4),
                         "outside_psnr_to_without": round(psnr(img[keep], outs["without"][keep]), 2)})
        ctrl_tile = np.asarray(ctrl)
        strip_rows.setdefault(case.image, []).append(tile_row(
            [np.asarray(case.template), mask_tile(case), ctrl_tile, outs["without"], outs["matched"]]))
    files = save_strips(strip_rows, "controlnet", strips) if strips else []
    return {"rows": rows, "strips": files, "canny_sigma": CANNY_SIGMA,
            "strip_columns": ["template", "mask", "control (canny)", "without ControlNet", "with ControlNet"]}


def style_keys(style: str) -> list[str]:
    """The statistics reported per style: its own first, then the Lab distance."""
    return [PRIMARY[style]] + (["lab_w1"] if PRIMARY[style] != "lab_w1" else [])


def summarise(rows: list[dict], keys: list[str]) -> dict[str, dict[str, float]]:
    """Mean of ``keys`` per variant."""
    out: dict[str, dict[str, float]] = {}
    for v in dict.fromkeys(r["variant"] for r in rows):
        sel = [r for r in rows if r["variant"] == v]
        out[v] = {k: round(float(np.mean([r[k] for r in sel])), 4) for k in keys}
    return out


def markdown(summary: dict[str, dict[str, float]], keys: list[str]) -> str:
    lines = ["| variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {v} | " + " | ".join(f"{vals[k]:.3f}" for k in keys) + " |" for v, vals in summary.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="docs/bench/training_addons.json")
    p.add_argument("--strips", default="docs/img", help="'' to skip the strip images")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", choices=["lora", "controlnet"], default=None)
    p.add_argument("--controlnet", default=str(CONTROLNET))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    t0, c0 = time.monotonic(), time.process_time()
    cases = held_out_cases()
    strips = Path(args.strips) if args.strips else None
    result: dict = {"command": "python -m ops.train.verify_addons " + " ".join(argv or []),
                    "settings": {"steps": STEPS, "guidance": GUIDANCE, "seed": SEED, "cases": len(cases)}}
    if args.skip != "lora":
        lo = verify_loras(cases, strips)
        keys = [f"{s}.{k}" for s in STYLE_NAMES for k in style_keys(s)]
        keys += ["mean_L", "mean_chroma", "inside_psnr_to_none", "outside_psnr_to_none", "outside_psnr_to_template"]
        lo["summary"] = summarise(lo["rows"], keys)
        log.info("LoRAs (means over %d cases):\n%s", len(cases), markdown(lo["summary"], keys))
        result["lora"] = lo
    if args.skip != "controlnet":
        co = verify_controlnet(cases, strips, Path(args.controlnet))
        keys = ["edge_f1", "edge_f1_to_mismatched", "outside_psnr_to_without"]
        co["summary"] = summarise(co["rows"], keys)
        log.info("ControlNet (means over %d cases):\n%s", len(cases), markdown(co["summary"], keys))
        result["controlnet"] = co
    result["seconds"] = {"wall": round(time.monotonic() - t0, 1), "cpu": round(time.process_time() - c0, 1)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    log.info("wrote %s (%.0f s)", args.json, result["seconds"]["wall"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
