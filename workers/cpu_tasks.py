"""Stage Celery tasks: everything outside the denoising loop (disaggregated from the GPU engine).

They run in the CPU worker pool (queue ``cpu``) or, with ``STENCIL_STAGE_PLACEMENT=gpu_host``, in the
stage pool on the job's GPU host (queue ``stage.<id>``); their modules sit on STENCIL_STAGE_DEVICE.

``prepare``: fetch and decode the template and mask (Pillow, with limits), resize, text and VAE
encode, write the job's tensors (safetensors bytes) to Redis. ``finalize``: VAE decode, PNG
encode, store the result in the object store, mark the job done.

Both are idempotent under redelivery: the job record and the presence of their outputs decide
what is already done. Bad input fails the job with a reason and stops the chain (``Ignore``);
the worker keeps running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery.exceptions import Ignore
from celery.signals import worker_process_init, worker_ready
from PIL import Image

from app.adapters import AdapterSet, adapter_digest
from app.celery_app import app
from app.controls import control_blob, controls_digest
from app.fidelity import TEMPORAL_REUSE, expected_ssim, policy_schedule
from app.jobs import WARM_PROMPT, WARM_SEED, JobParams, JobStatus
from app.keys import is_upload, result_key, template_key
from app.storage import ObjectNotFound, StoreUnavailable
from app.validation import InvalidParameter, object_id
from workers import context as ctx
from workers.adapter_tasks import adapter_problem, text_encoder_adapters
from workers.controlnets.inputs import controls_problem, image_digest, prepare_control_images
from workers.engine.cache_codec import lossless_codec
from workers.images import InvalidInput, decode_image, encode_png, target_size, to_mask, to_rgb
from workers.tensors import pack, unpack

log = logging.getLogger(__name__)

# Smaller images are refused: a UNet's coarsest level needs a few tokens.
MIN_SIDE = 64

TRANSIENT = (redis.ConnectionError, redis.TimeoutError, StoreUnavailable)


@contextmanager
def failing_job(job_id: str, stage: str) -> Iterator[None]:
    """Turn an error of ``stage`` into a failed job with a reason and stop the chain.

    Transient infrastructure errors propagate instead, so Celery retries the task.
    """
    try:
        yield
    except InvalidInput as exc:
        log.info("job %s: invalid input: %s", job_id, exc)
        ctx.jobs().fail(job_id, str(exc))
        raise Ignore() from exc
    except TRANSIENT:
        raise
    except Exception as exc:
        log.exception("job %s: %s failed", job_id, stage)
        ctx.jobs().fail(job_id, f"{stage} failed: {type(exc).__name__}: {exc}")
        raise Ignore() from exc


@worker_process_init.connect
def _limit_torch_threads(**_: Any) -> None:
    """Pool processes: apply STENCIL_TORCH_THREADS (thread pools do not survive fork)."""
    threads = ctx.settings().torch_threads
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


@worker_ready.connect
def _load_stage_modules(**_: Any) -> None:
    """A GPU host's stage pool loads its modules onto the device before its first job."""
    if ctx.role() == "stage":
        ctx.stage_pipeline()


def _load_template(job_id: str, template_id: str) -> bytes:
    s = ctx.settings()
    if template_id:
        try:
            template_id = object_id("template", template_id)
        except InvalidParameter as exc:
            raise InvalidInput(str(exc)) from exc
        try:
            return ctx.object_store().get(template_key(template_id))
        except (ObjectNotFound, ValueError) as exc:
            raise InvalidInput(f"unknown template {template_id!r}") from exc
    data = ctx.blobs().get(job_id, "image")
    if data is None:
        raise InvalidInput("the uploaded template image is missing (expired or never uploaded)")
    if len(data) > s.max_upload_bytes:
        raise InvalidInput(f"template image is {len(data)} bytes, over STENCIL_MAX_UPLOAD_BYTES = {s.max_upload_bytes}")
    return data


def _decode_inputs(job_id: str, template_id: str, *, warm: bool) -> tuple[Image.Image, Image.Image]:
    """The template (upright RGB) and the mask (the template's size; none for a warm-up: empty)."""
    s = ctx.settings()
    try:
        image = to_rgb(decode_image(_load_template(job_id, template_id), what="template image",
                                    max_pixels=s.max_image_pixels, max_bytes=s.max_upload_bytes))
    except InvalidInput:
        if is_upload(template_id):  # bytes nobody can use: do not keep them stored
            ctx.object_store().delete(template_key(template_id))
        raise
    mask_bytes = ctx.blobs().get(job_id, "mask")
    if mask_bytes is None and warm:
        return image, Image.new("L", image.size, 0)  # a warm-up sees the whole template
    if mask_bytes is None:
        raise InvalidInput("the mask is missing (expired or never uploaded)")
    mask = to_mask(decode_image(mask_bytes, what="mask", max_pixels=s.max_image_pixels,
                                max_bytes=s.max_upload_bytes))
    if mask.size != image.size:
        raise InvalidInput(f"mask size {mask.size[0]}x{mask.size[1]} does not match image size "
                           f"{image.size[0]}x{image.size[1]}")
    return image, mask


def job_size(image_size: tuple[int, int], params: JobParams, multiple: int) -> tuple[int, int]:
    """The size a job is processed at: its explicit width and height, or the image's, scaled down to
    STENCIL_MAX_SIDE and rounded down to the model's latent factor (VAE downscale; x2 for Flux's
    2x2 token packing). Sizes the model cannot take fail the job with the reason."""
    s = ctx.settings()
    if params.width and params.height:
        for name, value in (("width", params.width), ("height", params.height)):
            if value % multiple:
                raise InvalidInput(f"{name} {value} is not a multiple of {multiple} (this model's latent factor)")
            if not MIN_SIDE <= value <= s.max_side:
                raise InvalidInput(f"{name} {value} is outside this service's sizes: {MIN_SIDE} to "
                                   f"{s.max_side} px (STENCIL_MAX_SIDE)")
        return params.width, params.height
    if min(image_size) < MIN_SIDE:
        raise InvalidInput(f"image is {image_size[0]}x{image_size[1]}, under this service's minimum side of "
                           f"{MIN_SIDE} px")
    return target_size(*image_size, multiple, s.max_side)


def _decode_controls(job_id: str, count: int, size: tuple[int, int]) -> tuple[list[Image.Image], list[str]]:
    """The job's control images (RGB, the template's size) and the digests of their bytes."""
    s = ctx.settings()
    images, digests = [], []
    for i in range(count):
        data = ctx.blobs().get(job_id, control_blob(i))
        if data is None:
            raise InvalidInput(f"control image {i} is missing (expired or never uploaded)")
        image = to_rgb(decode_image(data, what=f"control image {i}", max_pixels=s.max_image_pixels,
                                    max_bytes=s.max_upload_bytes))
        if image.size != size:
            raise InvalidInput(f"control image {i} size {image.size[0]}x{image.size[1]} does not match image size "
                               f"{size[0]}x{size[1]}")
        images.append(image)
        digests.append(image_digest(data))
    return images, digests


@app.task(name="stencil.prepare", bind=True, autoretry_for=TRANSIENT, retry_backoff=True, max_retries=5)
def prepare(self: Any, job_id: str) -> dict[str, Any]:
    from workers.models.loader import stage_device
    from workers.sd_inputs import prepare_job_tensors

    jobs = ctx.jobs()
    rec = jobs.get(job_id)
    if rec is None or rec.status.terminal:
        log.info("prepare %s: job is %s, nothing to do", job_id, rec.status.value if rec else "gone")
        raise Ignore()
    existing = ctx.blobs().get(job_id, "inputs")
    if existing is not None:  # redelivered after a crash: reuse the prepared inputs
        _, meta = unpack(existing)
        return {"job_id": job_id, **{k: meta[k] for k in ("empty", "num_steps", "mask_ratio")}}
    jobs.transition(job_id, JobStatus.PREPARING, expect=(JobStatus.QUEUED, JobStatus.ROUTED),
                    prepare_worker=self.request.hostname or "")
    with failing_job(job_id, "prepare"):
        params = rec.params
        warm = params.kind == "warm"
        image, mask = _decode_inputs(job_id, params.template_id, warm=warm)
        problem = (adapter_problem(params.loras, ctx.model_id())
                   or controls_problem(params.controls, ctx.model_id(), ctx.model_family()))
        if problem:
            raise InvalidInput(problem)
        controls, control_digests = _decode_controls(job_id, len(params.controls), image.size)
        pipe = ctx.stage_pipeline()
        width, height = job_size(image.size, params, pipe.vae_scale_factor * (2 if ctx.model_family() == "flux" else 1))
        with text_encoder_adapters(pipe, params.loras):
            if ctx.model_family() == "flux":
                from workers.flux_inputs import prepare_flux_job_tensors

                prepared = prepare_flux_job_tensors(pipe, ctx.scheduler_config(), image, mask, params, height,
                                                    width)
            else:
                prepared = prepare_job_tensors(pipe, ctx.scheduler_config(), image, mask, params, height, width)
                prepared.tensors.update(prepare_control_images(pipe, controls, height, width,
                                                               bool(prepared.meta["do_cfg"])))
    empty = prepared.mask_ratio == 0.0 and params.kind == "edit"
    meta = dict(prepared.meta, empty=empty, mask_ratio=prepared.mask_ratio,
                loras=[[i, s] for i, s in params.loras], lora_patch=params.lora_patch or "exact",
                controls=[list(c) for c in params.controls],
                addons=addons_digest(params.loras, params.controls, control_digests))
    cache_fields = _cache_plan(job_id, params, meta, prepared) if not empty else {}
    tensors = dict(prepared.tensors)
    if empty or params.keep_unmasked:
        tensors["processed_image"] = prepared.processed_image
    ctx.blobs().put(job_id, "inputs", pack(tensors, meta))
    jobs.transition(job_id, JobStatus.WAITING, mask_ratio=f"{prepared.mask_ratio:.6f}",
                    width=width, height=height, progress_total=meta["num_steps"],
                    prepare_device=str(stage_device(pipe)), **cache_fields)
    return {"job_id": job_id, "empty": empty, "num_steps": meta["num_steps"],
            "mask_ratio": prepared.mask_ratio}


def addons_digest(loras: AdapterSet, controls: tuple, control_digests: list[str]) -> str:
    """A short name of a job's add-ons (adapters, ControlNets and their images); "" for none."""
    parts = [p for p in (adapter_digest(loras), controls_digest(controls, control_digests)) if p]
    return "-".join(parts)


def template_cache_key(params: JobParams, meta: dict[str, Any], noise_seed: int | None = None,
                       region: str = "", addons: str | None = None):  # type: ignore[no-untyped-def]
    """The key a template's activations are stored under (DESIGN.md: cache validity). A template's
    warm-up (no mask) is keyed by its noise seed and its add-ons (``addons``, default the job's
    ``meta["addons"]``: adapters and ControlNets change every token's activations); a region
    warm-up (recorded with a mask) by ``region``, the digest of everything that makes an edit
    exact (``region_digest``). A template warm-up that stores only ``STENCIL_CACHE_STEPS`` steps
    says so (``/steps-<n>``): caches of different stored steps are different caches."""
    from workers.maskaware.activation_store import TemplateCacheKey

    seed = params.seed if noise_seed is None else noise_seed
    extra = meta.get("addons", "") if addons is None else addons
    suffix = f"exact-{region}" if region else f"noise-{seed}" + (f"/with-{extra}" if extra else "")
    stored = ctx.settings().cache_steps_for(ctx.model_family())
    if not region and 0 < stored < params.steps:  # a template warm-up stores that many steps
        suffix += f"/steps-{stored}"
    return TemplateCacheKey(
        model_id=ctx.model_id(), template_id=params.template_id, height=int(meta["height"]),
        width=int(meta["width"]), scheduler=str(ctx.scheduler_config()["_class_name"]), steps=params.steps,
        strength=float(params.strength), guidance="cfg2" if meta["do_cfg"] else "single",
        layout=f"{_cache_layout()}/{suffix}")


def region_digest(pixel_mask: Any, params: JobParams, addons: str = "") -> str:
    """What a recording must share with an edit for the edit to be exact: the mask as the model
    sees it, prompt, negative prompt, seed, guidance scale and add-ons (steps, strength and size
    are in the key already)."""
    import torch

    h = hashlib.sha256()
    h.update(pixel_mask.to(torch.uint8).contiguous().numpy().tobytes())
    h.update(json.dumps([list(pixel_mask.shape), params.prompt, params.negative_prompt, params.seed,
                         float(params.guidance), *([addons] if addons else [])]).encode())
    return h.hexdigest()[:24]


def _cache_layout() -> str:
    """What a cache holds; caches of different layouts are never interchangeable. A cache recorded
    in half precision (``STENCIL_DTYPE``) is keyed by that compute dtype: an exact cache is exact
    only for edits computed in the dtype it was recorded in (float32 keys are unchanged)."""
    if ctx.model_family() == "flux":
        layout = "flux-kv-roped"  # MaskAwareFlux.cache_layout of the service's controller
    else:
        layout = "kv+y"  # MaskAwareUNet's kv_source "cache": K/V and block outputs
    from workers.maskaware.activation_store import recorded_layout

    return recorded_layout(layout, ctx.settings().dtype)


def _cache_plan(job_id: str, params: JobParams, meta: dict[str, Any], prepared: Any) -> dict[str, str]:
    """Decide full / record / masked compute for the job (``app/fidelity.py``); sets ``meta`` and
    returns the record fields that say which path was taken and whether it is approximate.

    An edit uses an exact cache (a region warm-up recorded with its mask, prompt, seed and
    guidance) when one exists; otherwise, unless its policy is ``exact``, the template's warm-up
    with the policy's refresh steps; otherwise full compute (never a failure for that reason),
    triggering the template's warm-up if configured.
    """
    s = ctx.settings()
    policy = params.fidelity or s.fidelity
    ratio = prepared.mask_ratio
    full = {"cache_mode": "full", "fidelity": policy, "approximate": "0"}
    if not params.template_id or not s.mask_aware:
        meta["cache_mode"] = "full"
        return full
    pixel_mask = prepared.tensors["pixel_mask"]
    if params.kind == "warm":
        region = region_digest(pixel_mask, params, meta.get("addons", "")) if ratio > 0 else ""
        key = template_cache_key(params, meta, region=region)
        meta.update(cache_mode="record", cache_key=key.to_dict())
        # Storage codec of the recording (the GPU worker's CacheRecorder.codec_for: exact-region
        # caches are lossless whatever STENCIL_CACHE_DTYPE says).
        codec = lossless_codec(key.layout) if region else s.cache_dtype
        return {"cache_mode": "record", "cache_digest": key.digest(), "region": region, "cache_codec": codec}
    if ratio >= 1.0:
        meta["cache_mode"] = "full"
        return {**full, "cache_note": "full mask"}
    exact = template_cache_key(params, meta, region=region_digest(pixel_mask, params, meta.get("addons", "")))
    base = template_cache_key(params, meta, WARM_SEED)
    # Add-ons change every token's activations, yet the refresh steps' offset correction absorbs
    # that: from the template's cache recorded without them, edits with a LoRA or a ControlNet are
    # as faithful as from one recorded with them (docs/bench/addon_fidelity.md: SSIM 0.995 vs 0.995,
    # ControlNet 0.988 vs 0.988). A cache recorded with the job's add-ons is used when a user warmed
    # one; none is warmed automatically per add-on set (a long tail of sets would each need one).
    plain = template_cache_key(params, meta, WARM_SEED, addons="") if meta.get("addons") else None
    try:
        if ctx.activations().has(exact):
            return _use_cache(job_id, meta, exact, [], {"fidelity": policy, "cache_path": "exact", "approximate": "0"})
        if policy != "exact":
            for key, note in ((base, ""), (plain, "template cache recorded without the job's add-ons")):
                if key is None or not ctx.activations().has(key):
                    continue
                schedule = policy_schedule(policy, int(meta["num_steps"]))
                fields = {"fidelity": policy, "cache_path": "template", "approximate": "1",
                          "refresh_plan": ",".join(map(str, schedule))}
                if note:
                    fields["cache_note"] = note
                expected = expected_ssim(ctx.model_id(), policy, params.guidance)
                if expected is not None:
                    fields["expected_ssim"] = f"{expected:.3f}"
                meta["temporal_reuse"] = policy in TEMPORAL_REUSE
                return _use_cache(job_id, meta, key, schedule, fields)
    except TRANSIENT as exc:
        log.warning("job %s: activation store unreachable (%s); full compute", job_id, exc)
        meta["cache_mode"] = "full"
        return {**full, "cache_note": "activation store unreachable"}
    meta["cache_mode"] = "full"
    if policy == "exact":
        return {**full, "cache_note": "no exact cache for this edit"}
    _trigger_warm(job_id, params, meta, (plain or base).digest())  # the template's own (without add-ons: see above)
    return {**full, "cache_note": "template not warmed"}


def _use_cache(job_id: str, meta: dict[str, Any], key: Any, refresh: list[int],
               fields: dict[str, str]) -> dict[str, str]:
    meta.update(cache_mode="masked", cache_key=key.to_dict(), refresh_steps=refresh)
    manifest = ctx.activations().cached_manifest(key)
    fields = {**fields, "cache_codec": str(manifest.get("codec", "float32"))}  # as the cache was stored
    if manifest.get("units") is not None:
        fields["cache_units_stored"] = str(len(manifest["units"]))  # type: ignore[arg-type]
    if manifest.get("stored_steps") is not None:  # STENCIL_CACHE_STEPS: each serves its segment
        fields["cache_steps_stored"] = str(len(manifest["stored_steps"]))  # type: ignore[arg-type]
    _send_prefetch(job_id, key.to_dict(), min(int(meta["num_steps"]), ctx.settings().prefetch_steps))
    return {"cache_mode": "masked", "cache_digest": key.digest(), **fields}


def _send_prefetch(job_id: str, key: dict[str, Any], steps: int) -> None:
    """Tell the job's GPU worker to fetch the template cache while the job waits for it."""
    worker = ctx.jobs().get(job_id)
    queue = worker.worker if worker is not None else None
    if not queue:
        return
    try:
        app.send_task("stencil.prefetch", args=(key, steps), queue=queue)
    except Exception as exc:  # prefetch is an optimisation; the engine fetches on demand anyway
        log.warning("job %s: prefetch request failed: %s", job_id, exc)


def _trigger_warm(job_id: str, params: JobParams, meta: dict[str, Any], digest: str) -> None:
    """Submit the template's warm-up for this cache key (recorded without the job's add-ons).
    Uploads are warmed when their bytes come back in a second job, not for a one-off edit: the jobs
    that used them are counted, so a job's prepare run again (redelivered, re-driven) is not."""
    s = ctx.settings()
    r = ctx.redis_client()
    if is_upload(params.template_id):
        seen = f"stencil:seen-jobs:{digest}"
        pipe = r.pipeline()
        pipe.sadd(seen, job_id)
        pipe.expire(seen, s.job_ttl_seconds)
        pipe.scard(seen)
        if pipe.execute()[-1] < 2:
            return
    if not r.set(f"stencil:warming:{digest}", "1", nx=True, ex=3600):
        return  # a warm-up for this key is already under way (or recently was)
    warm = JobParams(kind="warm", template_id=params.template_id, prompt=WARM_PROMPT, seed=WARM_SEED,
                     steps=params.steps, strength=params.strength, guidance=params.guidance, priority=-10,
                     width=int(meta["width"]), height=int(meta["height"]))
    warm_id, _ = ctx.jobs().create(warm)
    log.info("template %s has no cache for this key: warm-up job %s submitted", params.template_id, warm_id)


def _overlay_template(pipe: Any, job_id: str, image: Any) -> Any:
    """The decoded edit inside the mask, the template's exact pixels outside (the mask the model saw)."""
    from PIL import Image

    from workers.sd_inputs import image_from_processed

    inputs, _ = unpack(ctx.blobs().get(job_id, "inputs") or b"")
    if "processed_image" not in inputs or "pixel_mask" not in inputs:
        raise RuntimeError("keep_unmasked needs the prepared template and mask, which are missing")
    template = image_from_processed(pipe, inputs["processed_image"])
    mask = Image.fromarray(inputs["pixel_mask"].numpy().astype("uint8") * 255, mode="L")
    return pipe.image_processor.apply_overlay(mask, template, image)


@app.task(name="stencil.finalize", bind=True, autoretry_for=TRANSIENT, retry_backoff=True, max_retries=5)
def finalize(self: Any, prep: dict[str, Any]) -> dict[str, Any]:
    from workers.models.loader import stage_device
    from workers.sd_inputs import decode_latents, image_from_processed

    job_id = prep["job_id"]
    jobs = ctx.jobs()
    rec = jobs.get(job_id)
    if rec is None or rec.status.terminal:
        log.info("finalize %s: job is %s, nothing to do", job_id, rec.status.value if rec else "gone")
        return {"job_id": job_id, "status": rec.status.value if rec else "gone"}
    jobs.transition(job_id, JobStatus.FINALIZING, finalize_worker=self.request.hostname or "")
    with failing_job(job_id, "finalize"):
        pipe = ctx.stage_pipeline()
        if prep.get("empty"):
            tensors, _ = unpack(ctx.blobs().get(job_id, "inputs") or b"")
            image = image_from_processed(pipe, tensors["processed_image"])
        else:
            blob = ctx.blobs().get(job_id, "latents")
            if blob is None:
                raise RuntimeError("denoised latents are missing")
            tensors, _ = unpack(blob)
            if ctx.model_family() == "flux":
                from workers.flux_inputs import decode_flux_latents

                image = decode_flux_latents(pipe, tensors["latents"], int(rec.fields["height"]),
                                            int(rec.fields["width"]))
            else:
                image = decode_latents(pipe, tensors["latents"])
            if rec.params.keep_unmasked:
                image = _overlay_template(pipe, job_id, image)
        key = result_key(job_id)
        ctx.object_store().put(key, encode_png(image))
    if jobs.transition(job_id, JobStatus.DONE, result_key=key, ts_end=repr(time.time()),
                       finalize_device=str(stage_device(pipe))):
        ctx.blobs().delete_job(job_id)
    return {"job_id": job_id, "status": "done", "result_key": key}
