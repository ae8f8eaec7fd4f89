"""Loading models from diffusers folders; the embedded default is saved to one on first use.

Every process loads with ``from_pretrained`` from a local folder, so the embedded default and a
real checkpoint take the same code path, and all processes of a stack share identical weights.
CPU workers load only what they run (VAE, text encoder, tokenizer); GPU workers only the
denoiser and the scheduler config.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ensure_model_dir(settings: Settings) -> Path:
    """The model folder to load: the configured one, or the embedded default (saved once)."""
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
    if settings.model_id not in EMBEDDED_MODELS:
        raise FileNotFoundError(f"no model folder configured and no embedded model named "
                                f"{settings.model_id!r} (known: {sorted(EMBEDDED_MODELS)})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "model_index.json").is_file():
            tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-model-"))
            try:
                save_embedded(settings.model_id, tmp)
                if path.exists():
                    shutil.rmtree(path)
                os.replace(tmp, path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("embedded model %s written to %s", settings.model_id, path)
    return path


def _save_tiny_sd(out: Path, seed: int = 0) -> None:
    from workers.models.tiny_sd import save_pipeline

    save_pipeline(out, seed=seed)


def _save_tiny_flux(out: Path, seed: int = 0) -> None:
    from workers.models.tiny_flux import save_flux_fill_pipeline

    save_flux_fill_pipeline(out, seed=seed)


# The trained default ships in the repository (ops/train/sd.py wrote it): a few MB of
# safetensors in save_pretrained layout, copied into the home like the built ones are saved.
TRAINED_DIR = Path(__file__).resolve().parent / "trained"


def _copy_trained(name: str, trainer: str) -> Callable[[Path, int], None]:
    def copy(out: Path, seed: int = 0) -> None:
        src = TRAINED_DIR / name
        if not (src / "model_index.json").is_file():
            raise FileNotFoundError(f"trained model folder {src} is missing (train it: python -m {trainer})")
        shutil.copytree(src, out, dirs_exist_ok=True)

    return copy


# Embedded models by id. The random-init ones stay for unit tests and speed benchmarks (their
# outputs are noise); the trained one is the default so that the demo and fidelity show real edits.
EMBEDDED_MODELS: dict[str, Callable[[Path, int], None]] = {
    "tiny-sd-inpaint-trained": _copy_trained("tiny-sd-inpaint-trained", "ops.train.sd"),
    "tiny-flux-fill-trained": _copy_trained("tiny-flux-fill-trained", "ops.train.flux"),
    "tiny-sd-inpaint": _save_tiny_sd,
    "tiny-flux-fill": _save_tiny_flux,
}


def save_embedded(model_id: str, out: str | Path, seed: int = 0) -> Path:
    """Write embedded model ``model_id`` as a diffusers folder (``seed``: random-init models only)."""
    if model_id not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded model named {model_id!r} (known: {sorted(EMBEDDED_MODELS)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    EMBEDDED_MODELS[model_id](out, seed)
    log.info("embedded model %s written to %s", model_id, out)
    return out


FAMILIES = {"StableDiffusionInpaintPipeline": "sd", "StableDiffusionXLInpaintPipeline": "sd",
            "FluxFillPipeline": "flux"}


def model_family(model_dir: Path) -> str:
    """``sd`` or ``flux``, from the folder's ``model_index.json``."""
    import json

    name = json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"]
    if name not in FAMILIES:
        raise ValueError(f"unsupported pipeline {name} (supported: {sorted(FAMILIES)})")
    return FAMILIES[name]


def denoiser_subfolder(model_dir: Path) -> str:
    return "transformer" if model_family(model_dir) == "flux" else "unet"


def model_identity(model_dir: Path) -> str:
    """A stable id of the denoiser's weights, for template cache keys (caches never cross models)."""
    import hashlib

    h = hashlib.sha256()
    unet_dir = Path(model_dir) / denoiser_subfolder(model_dir)
    h.update((unet_dir / "config.json").read_bytes())
    for weights in sorted(unet_dir.glob("*.safetensors")):
        stat = weights.stat()
        h.update(f"{weights.name}:{stat.st_size}".encode())
        with open(weights, "rb") as fh:
            h.update(fh.read(1 << 20))
    return f"{Path(model_dir).name}-{h.hexdigest()[:16]}"


class DeviceUnavailable(RuntimeError):
    """A configured device this host does not have (e.g. ``cuda`` on a CPU-only host)."""


def resolve_device(name: str, setting: str = "STENCIL_DEVICE") -> torch.device:
    """The torch device named by a setting, checked to exist here: a process configured for a GPU it
    does not see stops with the reason instead of failing every job later."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceUnavailable(f"{setting}={name!r} is not a torch device name ({exc})") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"{setting}={name!r} but CUDA is not available on this host (torch "
                                    f"{torch.__version__}, {torch.cuda.device_count()} GPUs visible)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"{setting}={name!r} but only {torch.cuda.device_count()} GPUs are visible")
    elif device.type not in ("cpu", "mps", "xpu"):
        raise DeviceUnavailable(f"{setting}={name!r}: stages run on cpu, cuda[:N], mps or xpu")
    elif device.type != "cpu" and not getattr(torch, device.type).is_available():
        raise DeviceUnavailable(f"{setting}={name!r} but {device.type} is not available on this host")
    return device


def load_cpu_pipeline(model_dir: Path, device: str = "cpu"):  # type: ignore[no-untyped-def]
    """The pipeline without its denoiser (text encoders, VAE, tokenizers, processors) for the stage
    tasks, its modules on ``device`` (``STENCIL_STAGE_DEVICE``: the host CPU or the GPU host's device)."""
    target = resolve_device(device, "STENCIL_STAGE_DEVICE")
    if model_family(model_dir) == "flux":
        from diffusers import FluxFillPipeline

        pipe = FluxFillPipeline.from_pretrained(model_dir, transformer=None, torch_dtype=torch.float32)
    else:
        pipe = StableDiffusionInpaintPipeline.from_pretrained(
            model_dir, unet=None, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False, torch_dtype=torch.float32,
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(target)


def stage_device(pipe: Any) -> torch.device:
    """The device a stage pipeline's modules are on (its VAE's): inputs are moved there."""
    return pipe.vae.device


def load_unet(model_dir: Path, device: str) -> UNet2DConditionModel:
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", torch_dtype=torch.float32)
    return unet.to(device).eval()


def load_flux_transformer(model_dir: Path, device: str):  # type: ignore[no-untyped-def]
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer", torch_dtype=torch.float32)
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
