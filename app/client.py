"""Python client: submit edit jobs and follow them.

The client talks to the service's Redis (job records + intake stream) and reads results from the
object store, so it needs the same ``STENCIL_*`` settings as the service (or explicit arguments).

    client = StencilClient()
    job = client.submit(template=Image.open("t.png"), mask=mask_array, prompt="a red scarf", seed=7)
    job.wait(timeout=60)
    job.result().save("out.png")
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import redis

from app.adapters import DEFAULT_MAX_LORAS, AdapterSet, lora_meta_key, lora_upload_key
from app.blobs import BlobStore
from app.client_base import (
    ClientBase,
    ImageLike,
    InvalidAdapter,
    JobFailed,
    JobHandle,
    content_id,
    controlnet_folder,
    image_bytes,
)
from app.controls import DEFAULT_MAX_CONTROLS, control_blob, control_spec
from app.jobs import IDEMPOTENCY_PREFIX, JobParams, JobRecord, JobStatus, JobStore, new_job_id
from app.keys import TEMPLATE_PREFIX, UPLOAD_PREFIX, template_key
from app.settings import Settings
from app.storage import ObjectStore, open_store
from app.validation import InvalidParameter, object_id

log = logging.getLogger(__name__)


class StencilClient(ClientBase):
    """Over Redis (the service's own settings), or over HTTP with ``api_url`` and ``api_key``
    (or ``STENCIL_API_URL`` / ``STENCIL_API_KEY``): the same methods and errors either way."""

    def __new__(cls, settings: Settings | None = None, *, redis_url: str | None = None,
                store: ObjectStore | None = None, api_url: str | None = None,
                api_key: str | None = None) -> "StencilClient":
        settings = settings or Settings.from_env()
        if api_url or (redis_url is None and store is None and settings.api_url):
            from app.http_client import HttpStencilClient

            return HttpStencilClient(settings, api_url=api_url, api_key=api_key)  # type: ignore[return-value]
        return super().__new__(cls)

    def __init__(self, settings: Settings | None = None, *, redis_url: str | None = None,
                 store: ObjectStore | None = None, api_url: str | None = None,
                 api_key: str | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.redis = redis.Redis.from_url(redis_url or self.settings.redis_url)
        self.jobs = JobStore(self.redis, ttl_seconds=self.settings.job_ttl_seconds)
        self.blobs = BlobStore(self.redis, self.settings.blob_ttl_seconds)
        self.store = store or open_store(self.settings)
        self._celery: Any = None

    def add_template(self, image: ImageLike, template_id: str | None = None) -> str:
        """Store a template image for reuse by many jobs; returns its id. Without an id the
        template is content-addressed (``upload_id``): the same bytes are stored once."""
        data = image_bytes(image, mask=False)
        if template_id is None:
            return self.store_once(content_id(data, TEMPLATE_PREFIX), data)
        template_id = object_id("template id", template_id)
        self.store.put(template_key(template_id), data)
        return template_id

    def store_once(self, template_id: str, data: bytes) -> str:
        """Store template bytes under their content id unless they are there already: repeated
        uploads of one template share its id, hence its warm-up and activation cache."""
        if not self.store.exists(template_key(template_id)):
            self.store.put(template_key(template_id), data)
        return template_id

    def submit(self, *, template: str | ImageLike, mask: ImageLike, prompt: str = "",
               negative_prompt: str = "", steps: int = 20, guidance: float = 7.5, strength: float = 1.0,
               seed: int = 0, priority: int = 0, deadline: float | None = None,
               idempotency_key: str | None = None, width: int | None = None,
               height: int | None = None, keep_unmasked: bool = False, fidelity: str = "",
               loras: AdapterSet | list[Any] | str = (), lora_patch: str = "",
               controls: Iterable[Any] = ()) -> JobHandle:
        """Submit an edit. ``template`` is a stored template id (str) or an image to upload;
        uploads are content-addressed (the same bytes -> the same template id, warmed once).

        ``fidelity`` (``exact | balanced | fast``, "" = the service's default) chooses between
        exact results and faster approximate mask-aware ones (``app/fidelity.py``); the job record
        says which path ran (``cache_path``) and whether the result is ``approximate``.

        ``keep_unmasked`` pastes the template back outside the mask (exact template pixels there);
        off, the result is what ``StableDiffusionInpaintPipeline`` returns.

        ``loras``: adapters added with ``add_lora`` and their scales, e.g. ``[("papercut", 0.8),
        ("filmic", 0.5)]`` (or ``"papercut:0.8;filmic:0.5"``); the result equals diffusers'
        ``load_lora_weights`` + ``set_adapters`` at those scales. ``lora_patch``: ``exact`` (the
        adapters apply from the first step) or ``late`` (the job may start before they are loaded
        and take them within the first 30 % of its steps; the record says at which step:
        ``lora_applied_step``); "" = exact.

        ``controls``: ControlNets added with ``add_controlnet`` and their control images, e.g.
        ``[("canny", edges_png, 0.8)]`` or ``(id, image, scale, start, end)`` or mappings; the
        result equals ``StableDiffusionControlNetInpaintPipeline`` with those ControlNets,
        ``controlnet_conditioning_scale``, ``control_guidance_start`` and ``_end``.

        ``deadline`` is absolute (epoch seconds). Malformed or out-of-range parameters raise
        ``InvalidParameter`` (a ``ValueError`` naming the parameter) before anything is stored;
        what only the service can judge (image contents, an unknown template) gives a ``failed``
        job with a reason.
        """
        specs = [control_spec(c) for c in controls]
        params = JobParams(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                           strength=strength, seed=seed, priority=priority, deadline=deadline,
                           template_id=template if isinstance(template, str) else "",
                           width=width, height=height, keep_unmasked=keep_unmasked,
                           fidelity=fidelity, loras=loras, lora_patch=lora_patch,  # type: ignore[arg-type]
                           controls=tuple(c for c, _ in specs)).check(self.settings.max_steps, *self._limits())
        if idempotency_key:  # a retry of an accepted submission: nothing to upload again
            existing = self.existing_job(idempotency_key)
            if existing is not None:
                return JobHandle(self, existing, created=False)
        if not isinstance(template, str):
            data = image_bytes(template, mask=False)
            params.template_id = self.store_once(content_id(data, UPLOAD_PREFIX), data)
        blobs = {"mask": image_bytes(mask, mask=True)}
        blobs.update({control_blob(i): image_bytes(image, mask=False) for i, (_c, image) in enumerate(specs)})
        return self.enqueue(params, blobs, idempotency_key=idempotency_key)

    def existing_job(self, idempotency_key: str) -> str | None:
        """The id of the live job an idempotency key names, if any."""
        existing = self.redis.get(IDEMPOTENCY_PREFIX + idempotency_key)
        if existing is not None and self.jobs.get(existing.decode()) is not None:
            return existing.decode()
        return None

    def enqueue(self, params: JobParams, blobs: Mapping[str, bytes], *, idempotency_key: str | None = None,
                job_id: str | None = None, extra: Mapping[str, str] | None = None) -> JobHandle:
        """Store a job's uploads (``blobs``: mask, control images), then its record and intake entry:
        the dispatcher never sees a job without its inputs. ``params`` are checked already; the
        HTTP gateway names the job (``job_id``) and adds fields (``extra``: its tenant)."""
        job_id = job_id or new_job_id()
        self.blobs.put_many(job_id, blobs)
        job_id_final, created = self.jobs.create(params, idempotency_key=idempotency_key, job_id=job_id,
                                                 extra=dict(extra or {}))
        if not created:
            self.blobs.delete_job(job_id)
        return JobHandle(self, job_id_final, created)

    def warm_template(self, template_id: str, *, steps: int = 20, guidance: float = 7.5, strength: float = 1.0,
                      prompt: str = "", seed: int = 0, mask: ImageLike | None = None,
                      width: int | None = None, height: int | None = None, priority: int = 0,
                      negative_prompt: str = "", loras: AdapterSet | list[Any] | str = (),
                      controls: Iterable[Any] = ()) -> JobHandle:
        """Run a template's warm-up: a full inference that records its activations.

        Edits of the template with the same steps, strength, guidance layout (CFG or not) and size
        then compute only their masked tokens, approximately (``app/fidelity.py``). With ``mask`` it
        is a region warm-up, keyed by that mask, prompt, negative prompt, seed and guidance: edits
        with exactly those take the exact path (equal to the stock pipeline within 1/255).
        With ``loras`` or ``controls`` the recording is keyed by those too: edits with the same
        adapters and controls use it (a cache recorded without them only approximates them).
        """
        specs = [control_spec(c) for c in controls]
        params = JobParams(kind="warm", template_id=template_id, prompt=prompt, negative_prompt=negative_prompt,
                           steps=steps, guidance=guidance, strength=strength, seed=seed, priority=priority,
                           width=width, height=height, loras=loras,  # type: ignore[arg-type]
                           controls=tuple(c for c, _ in specs)).check(self.settings.max_steps, *self._limits())
        blobs = {control_blob(i): image_bytes(image, mask=False) for i, (_c, image) in enumerate(specs)}
        if mask is not None:
            blobs["mask"] = image_bytes(mask, mask=True)
        return self.enqueue(params, blobs)

    def _limits(self) -> tuple[int, int]:
        return DEFAULT_MAX_LORAS, DEFAULT_MAX_CONTROLS

    def add_controlnet(self, folder: Path, controlnet_id: str, *, timeout: float = 600.0) -> dict[str, Any]:
        """Add a ControlNet (a diffusers ``ControlNetModel`` folder: ``config.json`` and
        ``diffusion_pytorch_model.safetensors``) under ``controlnet_id``; returns its description.
        A CPU worker checks that it fits the service's model; refusals raise ``InvalidAdapter``."""
        import json
        import uuid

        from app.celery_app import CPU_QUEUE, make_celery
        from app.controls import CONTROL_FILES, controlnet_meta_key, controlnet_upload_key

        controlnet_id = object_id("controlnet id", controlnet_id)
        folder = controlnet_folder(folder)
        digest = hashlib.sha256()
        for name in CONTROL_FILES:
            with open(folder / name, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
        if self.store.exists(controlnet_meta_key(controlnet_id)):
            meta = json.loads(self.store.get(controlnet_meta_key(controlnet_id)))
            if meta.get("source_sha256") == digest.hexdigest():
                return meta
            raise InvalidParameter("controlnet id", f"{controlnet_id!r} already names another ControlNet "
                                                    "(ids are immutable)")
        size = sum((folder / n).stat().st_size for n in CONTROL_FILES)
        if size > self.settings.max_controlnet_bytes:
            raise InvalidAdapter(f"ControlNet is {size} bytes, over STENCIL_MAX_CONTROLNET_BYTES = "
                                 f"{self.settings.max_controlnet_bytes}")
        token = uuid.uuid4().hex
        for name in CONTROL_FILES:
            self.store.put(controlnet_upload_key(token, name), (folder / name).read_bytes())
        if self._celery is None:
            self._celery = make_celery(self.settings)
        try:
            out = self._celery.send_task("stencil.add_controlnet", args=(token, controlnet_id, digest.hexdigest()),
                                         queue=CPU_QUEUE).get(timeout=timeout)
        finally:
            for name in CONTROL_FILES:
                self.store.delete(controlnet_upload_key(token, name))
        if out.get("error"):
            raise InvalidAdapter(f"ControlNet {controlnet_id!r} refused: {out['error']}")
        return out

    def list_controlnets(self) -> list[dict[str, Any]]:
        """Every stored ControlNet's description."""
        import json

        from app.controls import CONTROLNET_PREFIX

        return [json.loads(self.store.get(k)) for k in sorted(self.store.list(CONTROLNET_PREFIX))
                if k.endswith("/meta.json")]

    def add_lora(self, adapter: bytes | Path, lora_id: str, *, timeout: float = 300.0) -> dict[str, Any]:
        """Add a LoRA adapter (a safetensors file in any format diffusers' ``load_lora_weights``
        reads) under ``lora_id``; returns its description. A CPU worker validates it against the
        service's model and stores it in canonical form; refusals raise ``InvalidAdapter`` with
        the reason. Ids are immutable: adding the same bytes again returns the stored adapter,
        other bytes under a used id are refused."""
        import json
        import uuid

        from app.celery_app import CPU_QUEUE, make_celery

        lora_id = object_id("lora id", lora_id)
        data = adapter.read_bytes() if isinstance(adapter, Path) else bytes(adapter)
        digest = hashlib.sha256(data).hexdigest()
        if self.store.exists(lora_meta_key(lora_id)):
            meta = json.loads(self.store.get(lora_meta_key(lora_id)))
            if meta.get("source_sha256") == digest:
                return meta
            raise InvalidParameter("lora id", f"{lora_id!r} already names another adapter (ids are immutable)")
        if len(data) > self.settings.max_lora_bytes:
            raise InvalidAdapter(f"adapter is {len(data)} bytes, over STENCIL_MAX_LORA_BYTES = "
                                 f"{self.settings.max_lora_bytes}")
        token = uuid.uuid4().hex
        self.store.put(lora_upload_key(token), data)
        if self._celery is None:
            self._celery = make_celery(self.settings)
        try:
            out = self._celery.send_task("stencil.add_lora", args=(token, lora_id, digest),
                                         queue=CPU_QUEUE).get(timeout=timeout)
        finally:
            self.store.delete(lora_upload_key(token))
        if out.get("error"):
            source = f" ({adapter.name})" if isinstance(adapter, Path) else ""
            raise InvalidAdapter(f"adapter {lora_id!r}{source} refused: {out['error']}")
        return out

    def list_loras(self) -> list[dict[str, Any]]:
        """Every stored adapter's description (id, components, ranks, bytes, source format)."""
        import json

        from app.adapters import LORA_PREFIX

        out = []
        for key in sorted(self.store.list(LORA_PREFIX)):
            if key.endswith("/meta.json"):
                out.append(json.loads(self.store.get(key)))
        return out

    # -- what a JobHandle asks of its client (app/http_client.py answers over HTTP) ---------------
    def _record(self, job_id: str) -> JobRecord:
        rec = self.jobs.get(job_id)
        if rec is None:
            raise KeyError(f"job {job_id} does not exist (or expired)")
        return rec

    def _result_bytes(self, job_id: str) -> bytes:
        rec = self._record(job_id)
        if rec.status != JobStatus.DONE or not rec.result_key:
            raise JobFailed(rec) if rec.status.terminal else RuntimeError(f"job {job_id} is {rec.status.value}")
        return self.store.get(rec.result_key)

    def _cancel(self, job_id: str) -> bool:
        return self.jobs.cancel(job_id)


__all__ = ["ImageLike", "InvalidAdapter", "InvalidParameter", "JobFailed", "JobHandle", "StencilClient",
           "content_id"]
