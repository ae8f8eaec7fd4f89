"""Where the non-denoising stages should run on a GPU host: measured CPU costs at true sizes next to
published GPU costs, and the expected latency of each placement (``STENCIL_STAGE_PLACEMENT``).

A job's stages outside the denoising loop: the text encoders (prompt, and the negative prompt under
CFG), two VAE encodes (the template, for the initial latents at strength < 1, and the masked
template; the SD, SDXL and Flux Fill inpainting pipelines both) and one VAE decode. Each stage's
module is built at true size from its public config (random init, no download; the configs are
written below) and timed once at the true input size, in float32 (what the stage tasks run today):

- VAE: ``AutoencoderKL`` of SD 1.5 / SDXL (4 latent channels; the two share the architecture) at
  512 px and 1024 px, and of FLUX.1 (16 latent channels, no quant convs) at 1024 px;
- text: CLIP ViT-L/14 (77 tokens), OpenCLIP ViT-bigG/14 (77 tokens) and the T5-XXL encoder (512
  tokens, Flux's sequence length). T5-XXL is 4.7 B parameters (19 GB in float32): ``--t5-layers``
  of its 24 blocks are built at full width and timed, and the encoder's time is that x 24 / layers
  (every block has the same shape; the embedding lookup is negligible).

One torch thread, CPU time of that thread (robust to the other processes of this shared machine);
a host CPU with more cores is credited with ideal linear scaling over ``--host-cores`` (optimistic
for the CPU placement). GPU costs are published numbers (sources in the report); where no
measurement is published (text encoders) the report gives a FLOP-based estimate and says so.

    python -m ops.bench.placement --out docs/bench/placement.md
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ops.bench.harness import cli

log = logging.getLogger(__name__)

# -- public configs (diffusers / transformers config.json values) --------------------------------

# runwayml/stable-diffusion-inpainting vae/config.json; the SDXL VAE
# (diffusers/stable-diffusion-xl-1.0-inpainting-0.1 vae/) has the same layers (scaling_factor 0.13025).
VAE_SD: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "sample_size": 512, "scaling_factor": 0.18215,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
# black-forest-labs/FLUX.1-Fill-dev vae/config.json: 16 latent channels, no quant convs, shifted latents.
VAE_FLUX: dict[str, Any] = {
    **VAE_SD, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "use_quant_conv": False, "use_post_quant_conv": False,
}
# openai/clip-vit-large-patch14 text model (text_encoder of SD 1.5, SDXL and Flux).
CLIP_L: dict[str, Any] = {
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
}
# laion/CLIP-ViT-bigG-14 text model (SDXL's text_encoder_2, CLIPTextModelWithProjection).
CLIP_BIGG: dict[str, Any] = {
    "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 20, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280,
}
# google/t5-v1_1-xxl encoder (Flux's text_encoder_2, T5EncoderModel).
T5_XXL: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "is_encoder_decoder": False,
}

# Which stages a job runs, per model: (encoder, tokens, calls per job). SD and SDXL inpainting encode
# the prompt and the negative prompt (CFG); Flux Fill has no CFG: one call per encoder.
MODELS: dict[str, dict[str, Any]] = {
    "sd15": {"title": "SD 1.5 inpainting, 512 px", "size": 512, "vae": "sd",
             "text": [("clip-l", 77, 2)]},
    "sdxl": {"title": "SDXL inpainting, 1024 px", "size": 1024, "vae": "sd",
             "text": [("clip-l", 77, 2), ("clip-bigg", 77, 2)]},
    "flux": {"title": "FLUX.1 Fill, 1024 px", "size": 1024, "vae": "flux",
             "text": [("clip-l", 77, 1), ("t5-xxl", 512, 1)]},
}
ENCODES_PER_JOB = 2  # template (initial latents at strength < 1) + masked template
FULL_LAYERS = {"clip-l": CLIP_L["num_hidden_layers"], "clip-bigg": CLIP_BIGG["num_hidden_layers"],
               "t5-xxl": T5_XXL["num_layers"]}

# -- published GPU costs (seconds) ---------------------------------------------------------------

SOURCES = {
    "hf-vae": "diffusers docs, Hybrid Inference: VAE Decode / VAE Encode, memory tables "
              "(https://huggingface.co/docs/diffusers/hybrid_inference/vae_decode, .../vae_encode), RTX 4090",
    "fal": "fal-ai/stable-diffusion-benchmarks README (A100 80G SXM, 50 steps, diffusers + torch 2.1 SDPA; "
           "https://github.com/fal-ai/stable-diffusion-benchmarks)",
    "flux-a100": "varadrane1707/BenchmarkFlux README, A100, FLUX.1-dev 1024x1024, 28 steps, BF16 "
                 "(https://github.com/varadrane1707/BenchmarkFlux)",
    "a100-peak": "NVIDIA A100 datasheet: 312 TFLOPS dense BF16/FP16 tensor; 40 % utilisation assumed",
}
# VAE seconds per call on the GPU. SDXL's VAE at 1024 px decodes in 0.256 s (hf-vae, SDXL table);
# encode: the SD v1.5 VAE (the same layers as SDXL's) at 1024x1024, 0.078 s; at 512x512: decode
# 0.031 s, encode 0.015 s. Flux's VAE differs only in its latent convs (16 channels): SDXL's times.
GPU_VAE = {"sd15": {"encode": (0.015, "hf-vae"), "decode": (0.031, "hf-vae")},
           "sdxl": {"encode": (0.078, "hf-vae"), "decode": (0.256, "hf-vae")},
           "flux": {"encode": (0.078, "hf-vae"), "decode": (0.256, "hf-vae")}}
# Denoising loop on the GPU: the published whole-pipeline time (an upper bound of the loop: it includes
# the stages) at the published step count, and per step.
GPU_DENOISE = {"sd15": (1.591, 50, "fal"), "sdxl": (5.933, 50, "fal"), "flux": (15.65, 28, "flux-a100")}
GPU_FLOPS = 312e12 * 0.4


# -- measurement ---------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    with torch.no_grad():
        fn()
    return time.thread_time() - start


def build_vae(kind: str):  # type: ignore[no-untyped-def]
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**(VAE_FLUX if kind == "flux" else VAE_SD)).eval()


def measure_vae(kind: str, size: int, warm_size: int) -> dict[str, float]:
    """Seconds of one encode (image -> latent distribution -> sample) and one decode at ``size``."""
    vae = build_vae(kind)
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    out = {}
    for px in (warm_size, size):  # the first pass at a small size: lazy init outside the timing
        image = torch.randn(1, 3, px, px)
        latents = torch.randn(1, vae.config.latent_channels, px // f, px // f)
        out = {"encode": _timed(lambda: vae.encode(image).latent_dist.sample()),
               "decode": _timed(lambda: vae.decode(latents).sample)}
    return out  # the VAE is freed with this frame


def build_text(name: str, layers: int, quick: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    if name == "t5-xxl":
        from transformers import T5Config, T5EncoderModel

        cfg = dict(T5_XXL, num_layers=layers)
        if quick:  # smoke run: a narrow stand-in
            cfg.update(d_model=256, d_ff=512, num_heads=4)
        return T5EncoderModel(T5Config(**cfg)).eval()
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = dict(CLIP_L if name == "clip-l" else CLIP_BIGG, num_hidden_layers=layers)
    cls = CLIPTextModel if name == "clip-l" else CLIPTextModelWithProjection
    return cls(CLIPTextConfig(**cfg)).eval()


def linear_flops(model: torch.nn.Module, tokens: int) -> float:
    """2 x tokens x the weights of its linear layers (attention scores add < 5 % at these lengths)."""
    return 2.0 * tokens * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def measure_text(name: str, tokens: int, layers: int, quick: bool) -> dict[str, float]:
    """Seconds (and FLOPs) of one call of the full encoder, scaled from ``layers`` built blocks."""
    model = build_text(name, layers, quick)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    _timed(lambda: model(input_ids=ids[:, :8]))
    seconds = _timed(lambda: model(input_ids=ids))
    scale = FULL_LAYERS[name] / layers
    out = {"seconds": seconds * scale, "measured_layers": layers, "scale": scale,
           "flops": linear_flops(model, tokens) * scale,
           "params_built": sum(p.numel() for p in model.parameters())}
    return out  # the encoder is freed with this frame


def measure(args: Any) -> dict[str, Any]:
    sizes = {"sd15": 64, "sdxl": 128, "flux": 128} if args.quick else {m: MODELS[m]["size"] for m in MODELS}
    vae: dict[str, dict[str, float]] = {}
    for model in args.models.split(","):
        key = f"{MODELS[model]['vae']}-{sizes[model]}"
        if key not in vae:
            log.info("VAE %s at %d px", MODELS[model]["vae"], sizes[model])
            vae[key] = measure_vae(MODELS[model]["vae"], sizes[model], 64)
    text: dict[str, dict[str, float]] = {}
    for model in args.models.split(","):
        for name, tokens, _ in MODELS[model]["text"]:
            if name in text:
                continue
            layers = {"t5-xxl": args.t5_layers}.get(name, FULL_LAYERS[name])
            if args.quick:
                layers = 1
            log.info("text encoder %s: %d of %d layers, %d tokens", name, layers, FULL_LAYERS[name], tokens)
            text[name] = measure_text(name, tokens, layers, args.quick)
    return {"sizes": sizes, "vae": vae, "text": text, "threads": torch.get_num_threads()}


# -- report --------------------------------------------------------------------------------------


def rows(data: dict[str, Any], host_cores: int, steps: int) -> list[dict[str, Any]]:
    """Per model: stage seconds on this CPU (1 thread), on a host CPU (ideal scaling), on the GPU,
    the denoising loop on the GPU, and each placement's expected end-to-end latency."""
    out = []
    for model, spec in MODELS.items():
        key = f"{spec['vae']}-{data['sizes'].get(model, 0)}"
        if key not in data["vae"]:
            continue
        v = data["vae"][key]
        text_cpu = sum(calls * data["text"][name]["seconds"] for name, _, calls in spec["text"])
        text_flops = sum(calls * data["text"][name]["flops"] for name, _, calls in spec["text"])
        vae_cpu = ENCODES_PER_JOB * v["encode"] + v["decode"]
        cpu_1t = text_cpu + vae_cpu
        gv = GPU_VAE[model]
        text_gpu = text_flops / GPU_FLOPS
        gpu = text_gpu + ENCODES_PER_JOB * gv["encode"][0] + gv["decode"][0]
        total, pub_steps, src = GPU_DENOISE[model]
        denoise = total / pub_steps * steps
        out.append({"model": model, "title": spec["title"], "encode_cpu": v["encode"], "decode_cpu": v["decode"],
                    "text_cpu": text_cpu, "cpu_1t": cpu_1t, "cpu_host": cpu_1t / host_cores,
                    "text_gpu": text_gpu, "encode_gpu": gv["encode"][0], "decode_gpu": gv["decode"][0],
                    "gpu": gpu, "denoise": denoise, "denoise_src": src, "pub": (total, pub_steps),
                    "e2e_cpu_1t": cpu_1t + denoise, "e2e_cpu_host": cpu_1t / host_cores + denoise,
                    "e2e_gpu": gpu + denoise})
    return out


def report(run: cli.Run, data: dict[str, Any]) -> list[str]:
    args = run.args
    table = rows(data, args.host_cores, args.steps)
    lines = [
        "# Stage placement: text encoders and VAE on the host CPU or on the GPU\n",
        f"Command: `{data['command']}` ({data['seconds']:.0f} s)"
        f"{' - QUICK: smoke run, not a measurement' if args.quick else ''}.",
        "Modules built at true size from their public configs (random init, float32), one torch thread, "
        "CPU time of the compute thread, one timed call per stage after a small warm-up call. "
        f"T5-XXL: {args.t5_layers} of its 24 blocks built at full width, time x 24 / {args.t5_layers}. "
        f"A job = text encoders (x2 under CFG for SD/SDXL) + {ENCODES_PER_JOB} VAE encodes + 1 decode.\n",
        "## Measured on this CPU (seconds per call, 1 thread)\n",
        "| stage | input | seconds | notes |", "|---|---|---|---|",
    ]
    for key, v in data["vae"].items():
        kind, px = key.split("-")
        name = "AutoencoderKL 16-ch (Flux)" if kind == "flux" else "AutoencoderKL 4-ch (SD 1.5 / SDXL)"
        lines.append(f"| VAE encode, {name} | {px}x{px} | {v['encode']:.2f} | |")
        lines.append(f"| VAE decode, {name} | {px}x{px} | {v['decode']:.2f} | |")
    for name, t in data["text"].items():
        tokens = next(tok for spec in MODELS.values() for n, tok, _ in spec["text"] if n == name)
        note = (f"{t['measured_layers']} of {FULL_LAYERS[name]} layers timed, x {t['scale']:.0f}"
                if t["scale"] != 1 else "whole encoder")
        lines.append(f"| text encoder {name} | {tokens} tokens | {t['seconds']:.2f} | {note}; "
                     f"{t['flops'] / 1e9:.0f} GFLOP |")
    lines += [
        "",
        f"## Expected latency per job on a GPU host ({args.steps} denoising steps)\n",
        f"CPU placement: the stages in the CPU Celery workers; 'host' = this machine's 1-thread time / "
        f"{args.host_cores} cores (ideal scaling, the CPU placement's best case). GPU placement "
        "(`STENCIL_STAGE_PLACEMENT=gpu_host`, `STENCIL_STAGE_DEVICE=cuda`): published GPU stage times. "
        "Denoising: published GPU pipeline time per step x steps (an upper bound of the loop: the "
        "published time includes the stages).\n",
        "| model | stages, CPU 1 thread (s) | stages, host CPU (s) | stages, GPU (s) | denoising, GPU (s) "
        "| job, stages on CPU 1 thread (s) | job, stages on host CPU (s) | job, stages on GPU (s) "
        "| GPU placement speedup (vs host CPU) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['title']} | {r['cpu_1t']:.2f} (text {r['text_cpu']:.2f}, encode {r['encode_cpu']:.2f} x2, "
            f"decode {r['decode_cpu']:.2f}) | {r['cpu_host']:.2f} | {r['gpu']:.3f} (text {r['text_gpu']:.3f}*, "
            f"encode {r['encode_gpu']:.3f} x2, decode {r['decode_gpu']:.3f}) | {r['denoise']:.2f} "
            f"({r['pub'][0]:.2f} s / {r['pub'][1]} steps [{r['denoise_src']}]) | {r['e2e_cpu_1t']:.2f} "
            f"| {r['e2e_cpu_host']:.2f} | {r['e2e_gpu']:.2f} | {r['e2e_cpu_host'] / r['e2e_gpu']:.2f}x |")
    lines += [
        "",
        "\\* text encoders on the GPU: no published per-encoder time was found; estimated as the encoder's "
        "linear-layer FLOPs / (A100 peak x 40 %) [a100-peak].\n",
        "Sources:\n",
        *[f"- [{k}] {v}" for k, v in SOURCES.items()],
        "",
        "Caveats: the published GPU VAE times are from an RTX 4090 and the denoising times from an A100 (no "
        "single source gives both stage and loop times for one GPU); the stages' share is small either way. "
        "The stage times on this CPU are float32 on one thread of a shared 2-core VM; a real host CPU with "
        "AMX/AVX-512 and bfloat16 would be faster than the 1-thread figure, the ideal-scaling column bounds that.",
        "",
        "Raw measurements (JSON):\n",
        "```json", json.dumps(data, indent=1), "```",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/placement.md", seed=None)
    p.add_argument("--models", default="sd15,sdxl,flux")
    p.add_argument("--t5-layers", type=int, default=2, help="T5-XXL blocks built and timed (of 24)")
    p.add_argument("--host-cores", type=int, default=16, help="cores a GPU host's CPU gives the stage workers")
    p.add_argument("--steps", type=int, default=20, help="denoising steps of the latency table")
    p.add_argument("--json", default="", help="also write the raw measurements here")
    p.add_argument("--from-json", default="", help="re-render a saved run's measurements (no measuring)")
    run = cli.start(p, argv, __file__, quick=dict(t5_layers=1), hide=("--from-json",))
    args = run.args
    if args.from_json:  # the report cites the command that measured
        data = json.loads(Path(args.from_json).read_text())
    else:
        data = measure(args)
        data.update(command=run.command, seconds=run.elapsed())
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    run.write(report(run, data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
