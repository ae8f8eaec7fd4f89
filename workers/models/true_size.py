"""True-size architectures (SD 1.5 inpainting, SDXL inpainting, FLUX.1 Fill) with random weights.

Why: every other model in the tree is small; what decides whether mask-aware serving pays off
(step time, cache bytes, memory) has to be measured at the shapes users deploy. Weights cannot be
downloaded here, so the public configs are written below as dicts and the real diffusers /
transformers classes are built from them with a seeded random init.

Memory: a model is built on the meta device (no storage), then materialized one chunk (a
submodule of at most ``CHUNK_BYTES``) at a time directly in the target dtype, initialized with
the layers' own ``reset_parameters`` (PyTorch's default init), written to a safetensors shard and
dropped again. Saving needs about one shard plus one chunk of RAM, not the model (measured:
SDXL inpainting, 6.9 GB of bfloat16 weights, 3.0 GB peak RSS in 33 s; SD 1.5 1.8 GB in 13 s), so
even the 11.9 B-parameter Flux transformer (24 GB in bfloat16) can be written on a 24 GB host.
``build_module`` materializes a whole model in memory (benchmarks), which does need its bytes.

Sources of the configs (the ``config.json`` files of the public repositories):
- ``sd15-inpaint``: runwayml/stable-diffusion-inpainting (UNet in_channels 9, (320, 640, 1280,
  1280), cross_attention_dim 768; VAE (128, 256, 512, 512); CLIP ViT-L/14 text tower).
- ``sdxl-inpaint``: diffusers/stable-diffusion-xl-1.0-inpainting-0.1 (UNet (320, 640, 1280),
  transformer_layers_per_block (1, 2, 10), cross_attention_dim 2048, addition_embed_type
  "text_time", projection_class_embeddings_input_dim 2816 = 1280 + 6 x 256; CLIP ViT-L and
  OpenCLIP ViT-bigG (``CLIPTextModelWithProjection``); VAE with force_upcast).
- ``flux-fill``: black-forest-labs/FLUX.1-Fill-dev (transformer in 384 / out 64 channels, 19
  double + 38 single blocks, 24 heads x 128, joint_attention_dim 4096, pooled 768, guidance
  embeds; 16-channel VAE without quant convs; CLIP ViT-L; T5-v1.1-XXL encoder).
- ``flux-fill-subset``: ``flux-fill`` at full width with 2 double + 4 single blocks (stated
  reduction: the full transformer, 23.8 GB in bfloat16, cannot be held in RAM here for compute).

Stated reductions (everything else is the public config):
- Tokenizers are built locally (no download), as for the tiny models: a byte-level CLIP BPE
  tokenizer without merges (514 ids; the text towers keep CLIP's 49408-row embedding table, so
  shapes and bytes are true) and a small unigram T5 tokenizer (the T5 encoder keeps 32128 rows).
- T5 encoder: full width (d_model 4096, 64 heads x 64, d_ff 10240) with 24 layers in
  ``flux-fill`` and 2 layers in ``flux-fill-subset``.
- Schedulers: the service's (DDIM with SD's betas for SD 1.5 / SDXL, Flux's flow-matching Euler);
  SDXL's ``timestep_spacing="leading"`` Euler config is not needed by the benchmarks.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from safetensors.torch import save_file

log = logging.getLogger(__name__)

CHUNK_BYTES = 512 << 20   # materialize submodules of at most this many bytes at a time
SHARD_BYTES = 1 << 30     # safetensors shard size of saved weights

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

CLIP_VOCAB = 49408
_CLIP_TOKENIZER_IDS = {"bos_token_id": 512, "eos_token_id": 513, "pad_token_id": 513}  # byte-level tokenizer

SD15_UNET: dict[str, Any] = {
    "act_fn": "silu", "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 9, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}

SD_VAE: dict[str, Any] = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "sample_size": 512, "scaling_factor": 0.18215,
}

SDXL_UNET: dict[str, Any] = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "center_input_sample": False, "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3,
    "conv_out_kernel": 3, "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "downsample_padding": 1,
    "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None, "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 9, "layers_per_block": 2, "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05,
    "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False,
    "out_channels": 4, "projection_class_embeddings_input_dim": 2816, "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False, "resnet_time_scale_shift": "default", "sample_size": 128,
    "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}

SDXL_VAE: dict[str, Any] = dict(SD_VAE, sample_size=1024, scaling_factor=0.13025, force_upcast=True)

CLIP_L: dict[str, Any] = {   # openai/clip-vit-large-patch14 text tower (SD 1.5, SDXL text_encoder, Flux)
    "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
    "max_position_embeddings": 77, "vocab_size": CLIP_VOCAB, "hidden_act": "quick_gelu", "projection_dim": 768,
    "layer_norm_eps": 1e-05, **_CLIP_TOKENIZER_IDS,
}

CLIP_BIGG: dict[str, Any] = {   # SDXL text_encoder_2 (OpenCLIP ViT-bigG/14 text tower, with projection)
    "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32,
    "max_position_embeddings": 77, "vocab_size": CLIP_VOCAB, "hidden_act": "gelu", "projection_dim": 1280,
    "layer_norm_eps": 1e-05, **_CLIP_TOKENIZER_IDS,
}

FLUX_FILL_TRANSFORMER: dict[str, Any] = {
    "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": True, "in_channels": 384,
    "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38,
    "out_channels": 64, "patch_size": 1, "pooled_projection_dim": 768,
}
FLUX_SUBSET_BLOCKS = {"num_layers": 2, "num_single_layers": 4}

FLUX_VAE: dict[str, Any] = dict(
    SD_VAE, latent_channels=16, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True,
)

T5_XXL: dict[str, Any] = {   # google/t5-v1_1-xxl encoder (FLUX.1 text_encoder_2)
    "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.0, "layer_norm_epsilon": 1e-06, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0, "tie_word_embeddings": False,
}


_CONFIG_CLASSES = {"CLIPTextModel": "CLIPTextConfig", "CLIPTextModelWithProjection": "CLIPTextConfig",
                   "T5EncoderModel": "T5Config"}


@dataclass(frozen=True)
class Component:
    """One weighted component: library (``diffusers`` | ``transformers``), class name, config."""

    library: str
    cls: str
    config: dict[str, Any]

    @property
    def klass(self) -> type:
        return getattr(diffusers if self.library == "diffusers" else transformers, self.cls)


@dataclass(frozen=True)
class Spec:
    """A pipeline: its class, weighted components, tokenizers and scheduler; ``denoiser`` names the big one."""

    pipeline: str
    denoiser: str
    components: dict[str, Component]
    tokenizers: dict[str, str]   # name -> "clip" | "t5"
    scheduler: str               # "ddim" | "flow"
    extra: dict[str, Any] = field(default_factory=dict)   # model_index.json flags


def _sd15() -> Spec:
    return Spec("StableDiffusionInpaintPipeline", "unet", {
        "unet": Component("diffusers", "UNet2DConditionModel", SD15_UNET),
        "vae": Component("diffusers", "AutoencoderKL", SD_VAE),
        "text_encoder": Component("transformers", "CLIPTextModel", CLIP_L)},
        {"tokenizer": "clip"}, "ddim",
        {"feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False,
         "safety_checker": [None, None]})


def _sdxl() -> Spec:
    return Spec("StableDiffusionXLInpaintPipeline", "unet", {
        "unet": Component("diffusers", "UNet2DConditionModel", SDXL_UNET),
        "vae": Component("diffusers", "AutoencoderKL", SDXL_VAE),
        "text_encoder": Component("transformers", "CLIPTextModel", CLIP_L),
        "text_encoder_2": Component("transformers", "CLIPTextModelWithProjection", CLIP_BIGG)},
        {"tokenizer": "clip", "tokenizer_2": "clip"}, "ddim",
        {"feature_extractor": [None, None], "image_encoder": [None, None], "requires_aesthetics_score": False,
         "force_zeros_for_empty_prompt": True})


def _flux(subset: bool) -> Spec:
    transformer = dict(FLUX_FILL_TRANSFORMER, **(FLUX_SUBSET_BLOCKS if subset else {}))
    t5 = dict(T5_XXL, num_layers=2) if subset else T5_XXL
    return Spec("FluxFillPipeline", "transformer", {
        "transformer": Component("diffusers", "FluxTransformer2DModel", transformer),
        "vae": Component("diffusers", "AutoencoderKL", FLUX_VAE),
        "text_encoder": Component("transformers", "CLIPTextModel", CLIP_L),
        "text_encoder_2": Component("transformers", "T5EncoderModel", t5)},
        {"tokenizer": "clip", "tokenizer_2": "t5"}, "flow")


TRUE_SIZE_MODELS: dict[str, Spec] = {
    "sd15-inpaint": _sd15(),
    "sdxl-inpaint": _sdxl(),
    "flux-fill": _flux(subset=False),
    "flux-fill-subset": _flux(subset=True),
}


def spec(model_id: str) -> Spec:
    if model_id not in TRUE_SIZE_MODELS:
        raise ValueError(f"no true-size model named {model_id!r} (known: {sorted(TRUE_SIZE_MODELS)})")
    return TRUE_SIZE_MODELS[model_id]


def build_meta(comp: Component) -> torch.nn.Module:
    """The component's module with parameters on the meta device (no storage); buffers are real."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if comp.library == "diffusers":
            model = comp.klass.from_config(copy.deepcopy(comp.config))
        else:
            cfg_cls = getattr(transformers, _CONFIG_CLASSES[comp.cls])
            model = comp.klass(cfg_cls(**comp.config))
    if comp.library == "transformers":
        model.tie_weights()   # T5: encoder.embed_tokens is shared (a no-op under init_empty_weights)
    return model.eval()


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that alias another parameter (saved once, re-tied on load)."""
    return ({n for n, _ in model.named_parameters(remove_duplicate=False)}
            - {n for n, _ in model.named_parameters()})


def n_params(model_id: str, component: str | None = None) -> int:
    """Parameters of a true-size model's component (default: its denoiser), counted on the meta device."""
    s = spec(model_id)
    model = build_meta(s.components[component or s.denoiser])
    return sum(p.numel() for p in model.parameters())


def shrunk(model_id: str) -> Spec:
    """The same spec with small widths (structure, classes and added conditioning kept): the
    fast tests' and the benchmarks' ``--quick`` stand-in of the same code path."""
    s = spec(model_id)
    comps = {}
    for name, comp in s.components.items():
        cfg = copy.deepcopy(comp.config)
        if comp.cls == "UNet2DConditionModel":
            n = len(cfg["block_out_channels"])
            cfg.update(block_out_channels=[32, 64, 64, 64][:n], norm_num_groups=16, layers_per_block=1,
                       cross_attention_dim=48 if "addition_embed_type" in cfg else 32)
            if "addition_embed_type" in cfg:   # SDXL: text_time with 2 x 32 + ... pooled/time dims
                cfg.update(attention_head_dim=[2, 4, 4], transformer_layers_per_block=[1, 1, 2],
                           addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8)
        elif comp.cls == "AutoencoderKL":
            cfg.update(block_out_channels=[16, 16, 32, 32], norm_num_groups=16, layers_per_block=1)
        elif comp.cls.startswith("CLIPText"):
            width = 16 if name == "text_encoder" and model_id == "sdxl-inpaint" else 32
            cfg.update(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4, num_hidden_layers=2,
                       projection_dim=width, vocab_size=514)
        elif comp.cls == "T5EncoderModel":
            cfg.update(d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2, vocab_size=256)
        elif comp.cls == "FluxTransformer2DModel":
            cfg.update(attention_head_dim=16, axes_dims_rope=[4, 6, 6], num_attention_heads=2, num_layers=1,
                       num_single_layers=2, joint_attention_dim=32, pooled_projection_dim=32)
        comps[name] = Component(comp.library, comp.cls, cfg)
    return Spec(s.pipeline, s.denoiser, comps, s.tokenizers, s.scheduler, s.extra)


# ---------------------------------------------------------------------------------------------
# Chunked materialization


def _module_bytes(module: torch.nn.Module, itemsize: int, recurse: bool = True) -> int:
    return sum(p.numel() for p in module.parameters(recurse=recurse)) * itemsize


def _chunks(module: torch.nn.Module, prefix: str, limit: int, itemsize: int,
            seen: set[int]) -> Iterator[tuple[str, torch.nn.Module, bool]]:
    """(prefix, module, recurse) pieces covering every parameter once, each at most ``limit`` bytes
    where the module tree allows (a leaf larger than that is one piece)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    children = list(module.named_children())
    if not children or _module_bytes(module, itemsize) <= limit:
        for m in module.modules():
            seen.add(id(m))
        yield prefix, module, True
        return
    if any(True for _ in module.parameters(recurse=False)):
        yield prefix, module, False
    for name, child in children:
        yield from _chunks(child, f"{prefix}{name}.", limit, itemsize, seen)


def _init_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give ``module``'s own (meta) parameters storage in ``dtype`` and PyTorch's default init."""
    params = dict(module.named_parameters(recurse=False))
    if not params:
        return
    for name, p in params.items():
        module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and not isinstance(module, torch.nn.MultiheadAttention):
        reset()
        return
    for name, p in module._parameters.items():   # norms without reset_parameters (RMSNorm, T5 LayerNorm)
        if p is None:
            continue
        if name == "bias":
            torch.nn.init.zeros_(p)
        elif name == "weight" and p.dim() == 1:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)


def _materialize(module: torch.nn.Module, recurse: bool, dtype: torch.dtype) -> None:
    for m in (module.modules() if recurse else [module]):
        _init_module(m, dtype)


def _to_meta(module: torch.nn.Module, recurse: bool) -> None:
    for m in (module.modules() if recurse else [module]):
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type != "meta":
                m._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                         requires_grad=False)


def build_module(comp: Component, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """The component with every parameter materialized in ``dtype`` (random init, seeded)."""
    model = build_meta(comp)
    torch.manual_seed(seed)
    for _, m, recurse in _chunks(model, "", CHUNK_BYTES, torch.finfo(dtype).bits // 8, set()):
        _materialize(m, recurse, dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def save_streaming(comp: Component, out: Path, dtype: torch.dtype, seed: int = 0,
                   shard_bytes: int | None = None) -> int:
    """Write ``comp`` (config + safetensors shards) into ``out`` without holding more than about a
    shard in memory; returns the bytes of weights written. Same init order as ``build_module``."""
    out.mkdir(parents=True, exist_ok=True)
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    model = build_meta(comp)
    itemsize = torch.finfo(dtype).bits // 8
    stem = "diffusion_pytorch_model" if comp.library == "diffusers" else "model"
    torch.manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    files: list[str] = []
    weight_map: dict[str, int] = {}
    tied = _tied_names(model)
    total = 0
    pending = 0

    def flush() -> None:
        nonlocal pending
        name = f"{stem}-part{len(files):05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        files.append(name)
        shards[-1] = {}
        pending = 0

    for prefix, m, recurse in _chunks(model, "", CHUNK_BYTES, itemsize, set()):
        _materialize(m, recurse, dtype)
        for name, p in m.named_parameters(recurse=recurse, remove_duplicate=True):
            key = prefix + name
            if key in weight_map or key in tied:
                continue
            shards[-1][key] = p.detach().contiguous()
            weight_map[key] = len(files)
            pending += p.numel() * itemsize
            total += p.numel() * itemsize
        _to_meta(m, recurse)
        if pending >= shard_bytes:
            flush()
    if shards[-1] or not files:
        flush()
    # Name the shards as the libraries expect: one file, or -0000k-of-0000n with an index.
    if len(files) == 1:
        (out / files[0]).rename(out / f"{stem}.safetensors")
    else:
        n = len(files)
        names = [f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for old, new in zip(files, names):
            (out / old).rename(out / new)
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if comp.library == "diffusers":
        model.save_config(out)
    else:
        model.config.save_pretrained(out)
    return total


# ---------------------------------------------------------------------------------------------
# Whole pipeline folders


def _save_tokenizer(kind: str, out: Path) -> None:
    from workers.models.tiny_flux import unigram_t5_tokenizer
    from workers.models.tiny_sd import byte_level_clip_tokenizer

    tok = byte_level_clip_tokenizer() if kind == "clip" else unigram_t5_tokenizer()
    tok.save_pretrained(out)


def _save_scheduler(kind: str, out: Path) -> str:
    if kind == "flow":
        from workers.models.tiny_flux import build_flow_scheduler

        sched = build_flow_scheduler()
    else:
        from workers.models.tiny_sd import build_scheduler

        sched = build_scheduler()
    sched.save_pretrained(out)
    return type(sched).__name__


def save_config_folder(model_id: str, out: str | Path, s: Spec | None = None) -> Path:
    """Configs, tokenizers, scheduler and ``model_index.json`` without weights: what
    ``from_single_file(config=...)`` reads offline."""
    s = s or spec(model_id)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": s.pipeline, "_diffusers_version": diffusers.__version__, **s.extra}
    for name, comp in s.components.items():
        (out / name).mkdir(exist_ok=True)
        model = build_meta(comp)
        if comp.library == "diffusers":
            model.save_config(out / name)
        else:
            model.config.save_pretrained(out / name)
        index[name] = [comp.library, comp.cls]
    for name, kind in s.tokenizers.items():
        _save_tokenizer(kind, out / name)
        index[name] = ["transformers", "CLIPTokenizer" if kind == "clip" else "T5TokenizerFast"]
    index["scheduler"] = ["diffusers", _save_scheduler(s.scheduler, out / "scheduler")]
    (out / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    return out


def save_true_size(model_id: str, out: str | Path, seed: int = 0, dtype: str | torch.dtype = "bfloat16",
                   small: bool = False) -> Path:
    """Write true-size model ``model_id`` (random init) as a diffusers pipeline folder in ``dtype``
    (``small``: its ``shrunk`` widths, for the benchmarks' quick runs)."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    s = shrunk(model_id) if small else spec(model_id)
    out = Path(out)
    save_config_folder(model_id, out, s)
    total = 0
    for k, (name, comp) in enumerate(s.components.items()):
        if (out / name).exists():
            shutil.rmtree(out / name)
        nbytes = save_streaming(comp, out / name, dt, seed=seed + k)
        total += nbytes
        log.info("%s: %s %s written (%.2f GB, %s)", model_id, name, comp.cls, nbytes / 1e9, dt)
    log.info("%s written to %s (%.2f GB of weights)", model_id, out, total / 1e9)
    return out


def estimate_bytes(model_id: str, dtype: str = "bfloat16") -> int:
    """Weight bytes of the whole pipeline in ``dtype`` (meta-device count)."""
    itemsize = torch.finfo(DTYPES[dtype]).bits // 8
    return sum(n_params(model_id, c) for c in spec(model_id).components) * itemsize
