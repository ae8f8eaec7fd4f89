"""Fidelity with add-ons: late LoRA patching, and mask-aware caches with adapters and ControlNets.

On the trained embedded model with its trained add-ons (``workers/models/trained/``: the sepia
and noir LoRAs, the canny ControlNet), at the client's default guidance 7.5:

- ``late``: a job that starts without its adapter and applies it from step ``k`` (late patching,
  SwiftDiffusion's bounded asynchronous loading) against the same job with the adapter from
  step 0 (exact): SSIM over the image and inside the mask, per fraction ``k / steps``; and the
  latency it saves when loading the adapter takes ``--load-s`` seconds (measured: the job run
  with a store that answers after that long, exact vs late).
- ``caches``: mask-aware edits under the default policy (``fast``: refresh steps) of jobs with an
  add-on, from (a) a template warm-up recorded with that add-on ("keyed") and (b) the template's
  warm-up without it ("plain"), against the same job's full compute with the add-on. Decides what
  the service does when a job's add-ons have no cache of their own.

    python -m ops.bench.addon_fidelity --parts late,caches --out docs/bench/addon_fidelity.md
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.controls import controlnet_key
from app.demo import demo_templates
from app.fidelity import policy_schedule
from app.jobs import JobParams
from app.maskgen import make_mask
from app.storage import LocalStore
from ops.bench.harness import cli
from ops.bench.harness.edits import metrics
from ops.bench.harness.service import InProcess, add_lora
from ops.sim.traces import load_trace
from workers.engine.engine import Engine
from workers.engine.scheduler import BatchScheduler
from workers.maskaware.activation_store import TemplateCacheKey
from workers.models.loader import TRAINED_DIR

log = logging.getLogger(__name__)

MODEL = TRAINED_DIR / "tiny-sd-inpaint-trained"
LORAS = {"sepia": 1.0, "noir": 0.5}  # the scales their model cards recommend
CONTROLNET = TRAINED_DIR / "tiny-sd-controlnet-canny"
SIZE = 128


def service(work: Path, **kw: Any) -> InProcess:
    store = LocalStore(work / "store")
    for name in LORAS:
        add_lora(store, MODEL, name, TRAINED_DIR / "loras" / name / "pytorch_lora_weights.safetensors")
    for f in ("config.json", "diffusion_pytorch_model.safetensors"):
        store.put(controlnet_key("canny", f), (CONTROLNET / f).read_bytes())
    return InProcess(MODEL, store, **kw)


def edits(n: int, seed: int) -> list[tuple[Image.Image, np.ndarray, Image.Image, str]]:
    """Edits of the demo templates with masks drawn like the spring trace's, canny controls of the templates."""
    from skimage.feature import canny

    rng = np.random.default_rng(seed)
    templates = [img.resize((SIZE, SIZE)) for _n, img in demo_templates(SIZE)]
    ratios = rng.choice(load_trace("spring"), size=n)
    prompts = ["a cat", "grass", "the moon", "a rocket", "a cup of coffee"]
    out = []
    for k, ratio in enumerate(ratios):
        image = templates[k % len(templates)]
        mask = make_mask(float(min(max(ratio, 0.05), 0.6)), (SIZE, SIZE), ("blob", "rect", "stroke")[k % 3], seed=k)
        edges = canny(np.asarray(image.convert("L"), dtype=np.float32) / 255, sigma=1.5)
        out.append((image, mask, Image.fromarray((edges * 255).astype(np.uint8)).convert("RGB"), prompts[k % 5]))
    return out


def _run(svc: InProcess, tensors: dict, meta: dict, before: Any = None) -> dict:
    engine = Engine(svc.runner, BatchScheduler(max_batch=4))
    h = engine.submit("x", tensors, meta, total_steps=int(meta["num_steps"]))
    engine._drain_inbox(block=False)
    while not h.future.done():
        if before is not None:
            before(h)
        if not engine.step_once():
            time.sleep(0.002)
    return h.future.result()


def part_late(args: Any, work: Path) -> list[str]:
    svc = service(work / "late")
    svc.engine.stop()
    svc.runner.lora_late_max_fraction = 1.0  # measure every fraction (the service caps it, 0.3 by default)
    gate = threading.Event()
    read = svc.bank.read
    svc.bank.read = lambda i: (gate.wait(600), read(i))[1]
    fractions = [float(f) for f in args.fractions.split(",")]
    rows: dict[tuple[str, float], list[dict[str, float]]] = {}
    for k, (image, mask, _edges, prompt) in enumerate(edits(args.n, args.seed)):
        for name, scale in LORAS.items():
            params = JobParams(prompt=prompt, steps=args.steps, guidance=7.5, seed=k, loras=((name, scale),))
            results = {}
            for f in fractions:
                gate.clear()
                svc.bank.host.clear()
                svc.lora.merge(())
                svc.lora.forget(name)
                start_at = round(f * args.steps)

                def release(job: Any, start_at: int = start_at) -> None:
                    if job.steps_done >= start_at and not gate.is_set():
                        gate.set()
                        while not svc.bank.ready([name]):
                            time.sleep(0.002)

                tensors, meta = svc.prepare(image, mask, params)
                out = _run(svc, tensors, dict(meta, lora_patch="late"), release)
                assert out["lora_applied_step"] == start_at, (out["lora_applied_step"], start_at)
                results[f] = np.asarray(svc.decode(out["latents"]))
            for f in fractions:
                rows.setdefault((name, f), []).append(metrics(results[f], results[0.0], mask))
    svc.close()
    lines = ["| adapter | applied from | SSIM vs exact | in-mask SSIM | PSNR |", "|---|---|---|---|---|"]
    for (name, f), ms in rows.items():
        lines.append(f"| {name} ({LORAS[name]}) | {f:.0%} of steps | {np.mean([m['ssim'] for m in ms]):.3f} | "
                     f"{np.mean([m.get('ssim_masked', 1) for m in ms]):.3f} | {np.mean([m['psnr'] for m in ms]):.1f} |")
    return ["## Late patching\n",
            f"{args.n} edits x {len(LORAS)} trained LoRAs, {args.steps} steps, guidance 7.5: the adapter applied from "
            "step round(fraction x steps) against applied from step 0 (exact; 0 % = the exact job itself).\n",
            *lines, ""] + _late_latency(args, work)


def _late_latency(args: Any, work: Path) -> list[str]:
    """Latency of one job when the adapter's load takes ``--load-s``: exact waits, late starts."""
    svc = service(work / "late-latency")
    read = svc.bank.read
    svc.bank.read = lambda i: (time.sleep(args.load_s), read(i))[1]
    image, mask, _edges, prompt = edits(1, args.seed)[0]
    lines = ["| patching | latency | loading hidden |", "|---|---|---|"]
    base = None
    for policy, fraction in (("exact", 0.0), *(("late", float(f)) for f in args.late_caps.split(","))):
        svc.bank.host.clear()
        svc.lora.merge(())
        svc.lora.forget("sepia")
        svc.runner.lora_late_max_fraction = fraction
        params = JobParams(prompt=prompt, steps=args.steps, guidance=7.5, seed=0, loras=(("sepia", 1.0),),
                           lora_patch=policy)
        t0 = time.perf_counter()
        tensors, meta = svc.prepare(image, mask, params)
        svc.bank.prefetch(["sepia"])  # routed: the fetch starts while the job is prepared
        out = svc.submit(tensors, dict(meta, lora_patch=policy)).future.result()
        seconds = time.perf_counter() - t0
        base = seconds if base is None else base
        label = "exact" if policy == "exact" else f"late, at most {fraction:.0%} of steps"
        lines.append(f"| {label} (applied at step {out['lora_applied_step']}) | {seconds:.2f} s | "
                     f"{base - seconds:.2f} s |")
    svc.close()
    return [f"One job ({args.steps} steps) whose adapter takes {args.load_s:.1f} s to load (a store answering after "
            "that long), the load starting when the job is routed:\n", *lines, ""]


def part_caches(args: Any, work: Path) -> list[str]:
    svc = service(work / "caches", mask_aware=True)
    svc.engine.stop()
    runner = svc.runner
    addons = {"sepia LoRA 1.0": dict(loras=(("sepia", 1.0),)), "noir LoRA 0.5": dict(loras=(("noir", 0.5),)),
              "canny ControlNet 0.5": dict(controls=(("canny", 0.5, 0.0, 1.0),)), "none": {}}
    templates = [img.resize((SIZE, SIZE)) for _n, img in demo_templates(SIZE)]
    empty = np.zeros((SIZE, SIZE), bool)
    keys: dict[tuple[int, str], TemplateCacheKey] = {}

    def warm(t: int, name: str) -> TemplateCacheKey:
        if (t, name) not in keys:
            params = JobParams(prompt="", seed=0, steps=args.steps, guidance=7.5, **addons[name])
            controls = [_control(templates[t])] if params.controls else []
            tensors, meta = svc.prepare(templates[t], empty, params, controls)
            key = TemplateCacheKey("bench", f"t{t}", SIZE, SIZE, "DDIMScheduler", args.steps, 1.0, "cfg2",
                                   f"kv+y/{name.replace(' ', '-')}")
            _run(svc, tensors, dict(meta, cache_mode="record", cache_key=key.to_dict()))["commit"].result(600)
            for step in range(args.steps):
                runner.caches.wait(key, step, 60)
            keys[(t, name)] = key
        return keys[(t, name)]

    schedule = policy_schedule("fast", args.steps)
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for k, (_image, mask, _edges, prompt) in enumerate(edits(args.n, args.seed)):
        t = k % len(templates)
        image = templates[t]
        for name, extra in addons.items():
            params = JobParams(prompt=prompt, steps=args.steps, guidance=7.5, seed=k + 1, **extra)
            controls = [_control(image)] if params.controls else []
            tensors, meta = svc.prepare(image, mask, params, controls)
            full = np.asarray(svc.decode(_run(svc, tensors, dict(meta))["latents"]))
            for cache in ("keyed", "plain") if name != "none" else ("plain",):
                key = warm(t, name if cache == "keyed" else "none")
                out = _run(svc, tensors, dict(meta, cache_mode="masked", cache_key=key.to_dict(),
                                              refresh_steps=schedule))
                rows.setdefault((name, cache), []).append(metrics(np.asarray(svc.decode(out["latents"])), full, mask))
    svc.close()
    lines = ["| add-on | template cache | SSIM vs full compute | in-mask SSIM | PSNR |", "|---|---|---|---|---|"]
    for (name, cache), ms in rows.items():
        label = {"keyed": "recorded with the add-on", "plain": "recorded without add-ons"}[cache]
        lines.append(f"| {name} | {label} | {np.mean([m['ssim'] for m in ms]):.3f} | "
                     f"{np.mean([m.get('ssim_masked', 1) for m in ms]):.3f} | {np.mean([m['psnr'] for m in ms]):.1f} |")
    return ["## Add-ons and mask-aware caches\n",
            f"{args.n} edits (masks drawn like the spring trace's), {args.steps} steps, guidance 7.5, policy `fast` "
            f"(refresh steps {schedule}); warm-ups with prompt \"\" and seed 0, with or without the edit's add-on "
            "(the ControlNet's warm-up with the template's own canny edges); against each edit's full compute "
            "with its add-on.\n", *lines, ""]


def _control(image: Image.Image) -> Image.Image:
    from skimage.feature import canny

    edges = canny(np.asarray(image.convert("L"), dtype=np.float32) / 255, sigma=1.5)
    return Image.fromarray((edges * 255).astype(np.uint8)).convert("RGB")


PARTS = {"late": part_late, "caches": part_caches}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/addon_fidelity.md")
    p.add_argument("--parts", default="late,caches")
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fractions", default="0,0.1,0.2,0.3,0.5")
    p.add_argument("--load-s", type=float, default=2.0)
    p.add_argument("--late-caps", default="0.1,0.3")
    run = cli.start(p, argv, __file__, quick=dict(n=1, steps=4, fractions="0,0.5", load_s=0.2, late_caps="0.5"))
    torch.set_num_threads(max(1, run.args.threads))
    cli.report_parts(run, "Fidelity with add-ons", PARTS, Path(tempfile.mkdtemp(prefix="stencil-addon-fidelity-")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
