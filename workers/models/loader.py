"""Loading models from diffusers folders; the embedded default is saved to one on first use.

Every process loads with ``from_pretrained`` from a local folder, so the embedded default and a
real checkpoint take the same code path, and all processes of a stack share identical weights.
CPU workers load only what they run (VAE, text encoder, tokenizer); GPU workers only the
denoiser and the scheduler config.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import diffusers
import torch
from diffusers import StableDiffusionInpaintPipeline, UNet2DConditionModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from app.settings import Settings
from workers.devices import DeviceUnavailable, resolve_device  # noqa: F401 (imported from here too)

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}


def ensure_model_dir(settings: Settings) -> Path:
    """The model folder to load: the configured one, a single-file checkpoint converted once, or the
    embedded default (saved once)."""
    named_file = Path(settings.model_dir).suffix.lower() in PICKLE_SUFFIXES | {".safetensors"}
    single = settings.model_file or (settings.model_dir if named_file else "")
    if single and not Path(single).is_dir():
        return single_file_model_dir(settings, Path(single))
    if settings.model_dir:
        path = Path(settings.model_dir)
        if not (path / "model_index.json").is_file():
            raise FileNotFoundError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
        return path
    shipped = TRAINED_DIR / settings.model_id
    if (shipped / "model_index.json").is_file():  # read in place: never a stale copy after retraining
        return shipped
    path = settings.home / "models" / settings.model_id
    if (path / "model_index.json").is_file():
        return path
    from workers.models.true_size import TRUE_SIZE_MODELS

    if settings.model_id not in EMBEDDED_MODELS and settings.model_id not in TRUE_SIZE_MODELS:
        raise FileNotFoundError(f"no model folder configured and no embedded model named "
                                f"{settings.model_id!r} (known: {sorted(EMBEDDED_MODELS)})")
    if _write_folder_once(path, lambda tmp: save_embedded(settings.model_id, tmp)):
        log.info("embedded model %s written to %s", settings.model_id, path)
    return path


def _write_folder_once(path: Path, write: Callable[[Path], object]) -> bool:
    """Write a model folder once across processes: under a file lock, into a temporary folder
    renamed into place, so no process ever loads a half-written folder. True if this call wrote it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "model_index.json").is_file():
            return False
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-model-"))
        try:
            write(tmp)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def single_file_model_dir(settings: Settings, checkpoint: Path) -> Path:
    """A ``.safetensors`` single-file checkpoint as a diffusers folder, converted once per file.

    Loaded with diffusers' ``from_single_file`` (offline: the configs come from ``config=``, the
    folder of ``STENCIL_MODEL_DIR`` when that names a folder, else of the configured model id: an
    embedded model or a true-size id's config-only folder). SD / SDXL checkpoints hold the whole
    pipeline; a Flux checkpoint holds the transformer, the other components come from the config
    folder. The result is saved with ``save_pretrained`` under the home, keyed by the file's
    header (its tensor names, shapes, offsets) and size, so every process of a stack loads the same
    folder with ``from_pretrained`` as usual. A file that is not safetensors is refused, saying what
    it is (``workers/weights_format.py``): pickle-based checkpoints can run code when loaded.
    """
    import hashlib

    from workers.weights_format import check_weights

    convert = "convert it to a .safetensors single-file checkpoint first (safetensors.torch.save_file)"
    if not checkpoint.is_file():
        if checkpoint.suffix.lower() != ".safetensors":
            raise ValueError(f"refusing model file {checkpoint}: only .safetensors single-file checkpoints are "
                             f"loaded (pickle-based .ckpt/.pt/.pth/.bin files can run code when loaded); {convert}")
        raise FileNotFoundError(f"model file {checkpoint} does not exist")
    check_weights(checkpoint, name=f"refusing model file {checkpoint}: it", instead=convert)
    if checkpoint.suffix.lower() != ".safetensors":  # diffusers picks its reader by the suffix
        raise ValueError(f"refusing model file {checkpoint}: it is safetensors but named {checkpoint.suffix!r}, "
                         f"and diffusers reads a single file by its suffix: rename it to .safetensors")
    config = _single_file_config_dir(settings)
    with open(checkpoint, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        h = hashlib.sha256(fh.read(min(header_len, 1 << 26)))
    h.update(f"{checkpoint.stat().st_size}:{config.resolve()}".encode())
    path = settings.home / "models" / f"{checkpoint.stem}-{h.hexdigest()[:16]}"
    if (path / "model_index.json").is_file():
        return path
    if _write_folder_once(path, lambda tmp: _convert_single_file(checkpoint, config, tmp)):
        log.info("single-file checkpoint %s converted to %s (configs from %s)", checkpoint, path, config)
    return path


def _single_file_config_dir(settings: Settings) -> Path:
    if settings.model_dir and Path(settings.model_dir).is_dir():
        return Path(settings.model_dir)
    from workers.models.true_size import TRUE_SIZE_MODELS, save_config_folder

    if settings.model_id in TRUE_SIZE_MODELS:   # configs only: the weights come from the file
        path = settings.home / "models" / f"{settings.model_id}-config"
        if not (path / "model_index.json").is_file():
            save_config_folder(settings.model_id, path)
        return path
    return ensure_model_dir(dataclasses.replace(settings, model_file="", model_dir=""))


def _convert_single_file(checkpoint: Path, config: Path, out: Path) -> None:
    import json

    name = json.loads((config / "model_index.json").read_text())["_class_name"]
    if name not in FAMILIES:
        raise ValueError(f"unsupported pipeline {name} in {config} (supported: {sorted(FAMILIES)})")
    if FAMILIES[name] == "flux":   # Flux single files hold the transformer only
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel.from_single_file(str(checkpoint), config=str(config), subfolder="transformer",
                                                        torch_dtype=torch.float32, local_files_only=True)
        shutil.copytree(config, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("transformer"))
        model.save_pretrained(out / "transformer", safe_serialization=True)
        return
    sd15 = name == "StableDiffusionInpaintPipeline"
    extra = {"safety_checker": None, "requires_safety_checker": False} if sd15 else {}
    pipe = getattr(diffusers, name).from_single_file(str(checkpoint), config=str(config), torch_dtype=torch.float32,
                                                     local_files_only=True, **extra)
    pipe.save_pretrained(out, safe_serialization=True)


def _save_tiny_sd(out: Path, seed: int = 0) -> None:
    from workers.models.tiny_sd import save_pipeline

    save_pipeline(out, seed=seed)


def _save_tiny_flux(out: Path, seed: int = 0) -> None:
    from workers.models.tiny_flux import save_flux_fill_pipeline

    save_flux_fill_pipeline(out, seed=seed)


def _save_tiny_sdxl(out: Path, seed: int = 0) -> None:
    from workers.models.tiny_sdxl import save_sdxl_pipeline

    save_sdxl_pipeline(out, seed=seed)


# The trained default ships in the repository (ops/train/sd.py wrote it): a few MB of
# safetensors in save_pretrained layout, copied into the home like the built ones are saved.
# Benchmark-only trained models ship without weights (ops/train/on_demand.py trains them in place).
TRAINED_DIR = Path(__file__).resolve().parent / "trained"


def _copy_trained(name: str, trainer: str) -> Callable[[Path, int], None]:
    def copy(out: Path, seed: int = 0) -> None:
        src = TRAINED_DIR / name
        if not (src / "model_index.json").is_file():
            from ops.train.on_demand import RECIPES, command

            how = command(name) if name in RECIPES else f"python -m {trainer}"
            raise FileNotFoundError(f"trained model folder {src} has no model: train it from the repository "
                                    f"root with `{how}` (benchmarks that use it train it on first use)")
        shutil.copytree(src, out, dirs_exist_ok=True)

    return copy


# Embedded models by id. The random-init ones stay for unit tests and speed benchmarks (their
# outputs are noise); the trained one is the default so that the demo and fidelity show real edits.
EMBEDDED_MODELS: dict[str, Callable[[Path, int], None]] = {
    "tiny-sd-inpaint-trained": _copy_trained("tiny-sd-inpaint-trained", "ops.train.sd"),
    "tiny-flux-fill-trained": _copy_trained("tiny-flux-fill-trained", "ops.train.flux"),
    # SDXL's transformer layout (none at the finest level, the deepest at the coarsest) in SD classes:
    # measures coarse-level mask pooling's fidelity (BENCHMARKS.md, true-size models). Not shipped:
    # trained on first use by the benchmarks (ops/train/on_demand.py).
    "tiny-sd-sdxl-layout-trained": _copy_trained("tiny-sd-sdxl-layout-trained", "ops.train.sd"),
    "tiny-sd-inpaint": _save_tiny_sd,
    "tiny-flux-fill": _save_tiny_flux,
    "tiny-sdxl-inpaint": _save_tiny_sdxl,
}


def save_embedded(model_id: str, out: str | Path, seed: int = 0, dtype: str | None = None) -> Path:
    """Write embedded model ``model_id`` as a diffusers folder (``seed``: random-init models only;
    ``dtype``: true-size models' weights, default bfloat16; the tiny models are float32 only)."""
    from workers.models.true_size import TRUE_SIZE_MODELS, save_true_size

    out = Path(out)
    if model_id in TRUE_SIZE_MODELS:
        save_true_size(model_id, out, seed=seed, dtype=dtype or "bfloat16")
        log.info("true-size model %s written to %s", model_id, out)
        return out
    if model_id not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded model named {model_id!r} "
                         f"(known: {sorted(EMBEDDED_MODELS) + sorted(TRUE_SIZE_MODELS)})")
    if dtype not in (None, "float32"):
        raise ValueError(f"{model_id} is saved in float32 only (got dtype {dtype})")
    out.mkdir(parents=True, exist_ok=True)
    EMBEDDED_MODELS[model_id](out, seed)
    log.info("embedded model %s written to %s", model_id, out)
    return out


FAMILIES = {"StableDiffusionInpaintPipeline": "sd", "StableDiffusionXLInpaintPipeline": "sd",
            "FluxFillPipeline": "flux"}


def model_family(model_dir: Path) -> str:
    """``sd`` or ``flux``, from the folder's ``model_index.json``."""
    name = pipeline_class_name(model_dir)
    if name not in FAMILIES:
        raise ValueError(f"unsupported pipeline {name} (supported: {sorted(FAMILIES)})")
    return FAMILIES[name]


def denoiser_subfolder(model_dir: Path) -> str:
    return "transformer" if model_family(model_dir) == "flux" else "unet"


def model_identity(model_dir: Path) -> str:
    """A stable id of the denoiser's weights, for template cache keys and add-on descriptions (caches
    and add-ons never cross models). From the folder's contents only, never its name or place: the
    hosts of one deployment keep their copies of a model where they like and must agree on its id
    (a LoRA added through one host's CPU pool is used by another host's GPU worker)."""
    import hashlib

    h = hashlib.sha256()
    unet_dir = Path(model_dir) / denoiser_subfolder(model_dir)
    h.update((unet_dir / "config.json").read_bytes())
    for weights in sorted(unet_dir.glob("*.safetensors")):
        stat = weights.stat()
        h.update(f"{weights.name}:{stat.st_size}".encode())
        with open(weights, "rb") as fh:
            h.update(fh.read(1 << 20))
    return f"{pipeline_class_name(model_dir)}-{h.hexdigest()[:16]}"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``STENCIL_DTYPE`` name (float32 | float16 | bfloat16)."""
    from app.settings import DTYPES

    if name not in DTYPES:
        raise ValueError(f"STENCIL_DTYPE must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def pipeline_class_name(model_dir: Path) -> str:
    import json

    return str(json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"])


def load_cpu_pipeline(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    """The pipeline without its denoiser (text encoders, VAE, tokenizers, processors) for the stage
    tasks, its modules on ``device`` (``STENCIL_STAGE_DEVICE``: the host CPU or the GPU host's device).

    Loaded in ``dtype`` (``STENCIL_DTYPE``) like the stock pipeline with ``torch_dtype=dtype``: prompt
    embeddings, noise and VAE latents come out in that dtype (SDXL's VAE still encodes in float32
    where its config says ``force_upcast``, inside the pipeline's own ``_encode_vae_image``)."""
    target = resolve_device(device, "STENCIL_STAGE_DEVICE")
    if model_family(model_dir) == "flux":
        from diffusers import FluxFillPipeline

        pipe = FluxFillPipeline.from_pretrained(model_dir, transformer=None, dtype=dtype)
    elif pipeline_class_name(model_dir) == "StableDiffusionXLInpaintPipeline":
        from diffusers import StableDiffusionXLInpaintPipeline

        pipe = StableDiffusionXLInpaintPipeline.from_pretrained(model_dir, unet=None, dtype=dtype,
                                                                add_watermarker=False)
    else:
        pipe = StableDiffusionInpaintPipeline.from_pretrained(
            model_dir, unet=None, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False, dtype=dtype,
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(target)


def stage_device(pipe: Any) -> torch.device:
    """The device a stage pipeline's modules are on (its VAE's): inputs are moved there."""
    return pipe.vae.device


def load_unet(model_dir: Path, device: str, dtype: torch.dtype = torch.float32) -> UNet2DConditionModel:
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", dtype=dtype)
    return unet.to(device).eval()


def load_flux_transformer(model_dir: Path, device: str, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer", dtype=dtype)
    return model.to(device).eval()


def vae_scale_factor(model_dir: Path) -> int:
    import json

    cfg = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
    return 2 ** (len(cfg["block_out_channels"]) - 1)


def scheduler_config(model_dir: Path) -> dict[str, Any]:
    cls = diffusers.DDIMScheduler  # any SchedulerMixin can read a scheduler config
    return dict(cls.load_config(model_dir, subfolder="scheduler"))


def make_scheduler(config: dict[str, Any]) -> SchedulerMixin:
    """A fresh scheduler instance (one per job: schedulers keep per-run state)."""
    cls = getattr(diffusers, config["_class_name"])
    return cls.from_config(config)
