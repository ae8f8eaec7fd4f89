"""The stock-diffusers baseline: what most deployments run today, for side-by-side benchmarks.

A plain worker loop per device: take up to ``max_batch`` queued jobs, call
``StableDiffusionInpaintPipeline`` once for the whole batch (static batching: the batch runs to
completion before the next one starts; full compute; decoding, encoding and the VAE inside the
same loop), store the results, mark the jobs done. Jobs are routed round-robin by
``StockRouter`` into one Redis list per worker. It uses the same job records and blobs as
Stencil, so the same client and load generator measure both.

The pipeline is the one the model folder names (SD or SDXL inpainting), on ``STENCIL_DEVICE`` in
``STENCIL_DTYPE``; with ``STENCIL_COMPILE`` set its UNet runs through ``torch.compile`` as a user
compiles it (``pipe.unet = torch.compile(pipe.unet, mode=...)``; eager again if compilation fails).
"""

from __future__ import annotations

import io
import itertools
import logging
import threading
import time

import redis
import torch
from PIL import Image

from app.blobs import BlobStore
from app.jobs import INTAKE_STREAM, JobStatus, JobStore
from app.keys import result_key, template_key
from app.settings import Settings
from app.storage import open_store

log = logging.getLogger(__name__)

STOCK_QUEUE = "stencil:stock:{}"
STOCK_PIPELINES = ("StableDiffusionInpaintPipeline", "StableDiffusionXLInpaintPipeline")


class StockRouter:
    """Round-robin from the intake stream into per-worker lists (the baseline's dispatcher)."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.r = redis.Redis.from_url(settings.redis_url)
        self.jobs = JobStore(self.r, ttl_seconds=settings.job_ttl_seconds)
        self.cycle = itertools.cycle(settings.gpu_worker_ids)

    def run(self, stop: threading.Event) -> None:
        group = "stock-router"
        try:
            self.r.xgroup_create(INTAKE_STREAM, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        while not stop.is_set():
            self.r.set("stencil:dispatcher:heartbeat", repr(time.time()), ex=30)
            resp = self.r.xreadgroup(group, "router", {INTAKE_STREAM: ">"}, count=64, block=500)
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    job_id = fields[b"job_id"].decode()
                    worker = next(self.cycle)
                    self.r.rpush(STOCK_QUEUE.format(worker), job_id)
                    self.jobs.transition(job_id, JobStatus.ROUTED, expect=(JobStatus.QUEUED,),
                                         worker=f"stock.{worker}")
                    self.r.xack(INTAKE_STREAM, group, entry_id)


class StockWorker:
    def __init__(self, settings: Settings, worker_id: str) -> None:
        import diffusers

        from workers.compiled import check_mode
        from workers.models.loader import ensure_model_dir, pipeline_class_name, resolve_device, torch_dtype

        self.s = settings
        self.worker_id = worker_id
        self.r = redis.Redis.from_url(settings.redis_url)
        self.jobs = JobStore(self.r, ttl_seconds=settings.job_ttl_seconds)
        self.blobs = BlobStore(self.r, settings.blob_ttl_seconds)
        self.store = open_store(settings)
        model_dir = ensure_model_dir(settings)
        name = pipeline_class_name(model_dir)
        if name not in STOCK_PIPELINES:
            raise ValueError(f"the stock baseline runs {' and '.join(STOCK_PIPELINES)}; {model_dir} is a {name}")
        # On STENCIL_DEVICE, as a user runs the stock pipeline on the card (the comparison's baseline).
        self.pipe = getattr(diffusers, name).from_pretrained(
            model_dir, dtype=torch_dtype(settings.dtype)).to(resolve_device(settings.device))
        self.pipe.set_progress_bar_config(disable=True)
        self.eager_unet = self.pipe.unet
        self.compile = check_mode(settings.compile)
        if self.compile != "off":
            self.pipe.unet = torch.compile(self.eager_unet, mode=None if self.compile == "default" else self.compile)
        self.busy_seconds = 0.0
        self.batches = 0

    def _take_batch(self) -> list[str]:
        first = self.r.blpop([STOCK_QUEUE.format(self.worker_id)], timeout=1)
        if first is None:
            return []
        ids = [first[1].decode()]
        while len(ids) < self.s.max_batch:
            more = self.r.lpop(STOCK_QUEUE.format(self.worker_id))
            if more is None:
                break
            ids.append(more.decode())
        return ids

    def _template(self, job_id: str, template_id: str) -> bytes:
        """The job's template: a stored (or content-addressed uploaded) template, else its own blob."""
        if template_id:
            return self.store.get(template_key(template_id))
        return self.blobs.get(job_id, "image") or b""

    def _run_batch(self, ids: list[str]) -> None:
        recs = [self.jobs.get(j) for j in ids]
        live = [(j, r) for j, r in zip(ids, recs) if r is not None and not r.status.terminal]
        if not live:
            return
        images, masks, gens = [], [], []
        for job_id, rec in live:
            images.append(Image.open(io.BytesIO(self._template(job_id, rec.params.template_id))).convert("RGB"))
            masks.append(Image.open(io.BytesIO(self.blobs.get(job_id, "mask") or b"")).convert("L"))
            gens.append(torch.Generator("cpu").manual_seed(rec.params.seed))
            self.jobs.transition(job_id, JobStatus.DENOISING, worker=f"stock.{self.worker_id}")
        p0 = live[0][1].params
        width, height = images[0].size
        start = time.perf_counter()
        call = dict(prompt=[r.params.prompt for _, r in live], image=images, mask_image=masks,
                    num_inference_steps=p0.steps, guidance_scale=p0.guidance, strength=p0.strength,
                    height=height - height % 8, width=width - width % 8)
        seeds = [r.params.seed for _, r in live]
        try:
            out = self.pipe(**call, generator=gens).images
        except Exception as exc:
            if self.pipe.unet is self.eager_unet:
                raise
            log.warning("torch.compile of the stock UNet failed (%s: %s); eager from now on", type(exc).__name__,
                        str(exc).splitlines()[0][:300] if str(exc) else "")
            self.pipe.unet = self.eager_unet
            out = self.pipe(**call, generator=[torch.Generator("cpu").manual_seed(s) for s in seeds]).images
        self.busy_seconds += time.perf_counter() - start
        self.batches += 1
        for (job_id, _rec), img in zip(live, out):
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            self.store.put(result_key(job_id), buf.getvalue())
            self.jobs.transition(job_id, JobStatus.DONE, result_key=result_key(job_id))
        self.r.hset(f"stencil:worker:{self.worker_id}", mapping={
            "busy_seconds": repr(self.busy_seconds), "batches": self.batches, "updated": repr(time.time()),
            "running": "[]", "waiting": "[]", "last_step_seconds": "0"})

    def run(self, stop: threading.Event) -> None:
        self.r.hset(f"stencil:worker:{self.worker_id}", mapping={"busy_seconds": "0", "updated": repr(time.time())})
        log.info("stock worker %s ready (max batch %d)", self.worker_id, self.s.max_batch)
        while not stop.is_set():
            ids = self._take_batch()
            if not ids:
                continue
            try:
                self._run_batch(ids)
            except Exception as exc:  # the baseline still must not lose other batches
                log.exception("stock batch failed")
                for job_id in ids:
                    self.jobs.fail(job_id, f"stock pipeline failed: {exc}")
