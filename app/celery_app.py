"""The Celery application shared by the dispatcher (producer) and all workers.

JSON only (no pickle), late acks with redelivery on worker loss, prefetch of one message per
slot, and a broker visibility timeout longer than the longest job (DESIGN.md section 4).
Queues: ``cpu`` for prepare/finalize (``stage.<id>`` instead with ``STENCIL_STAGE_PLACEMENT=gpu_host``:
the stage pool on GPU host ``<id>``), ``gpu.<id>`` for each GPU worker's denoise tasks.
"""

from __future__ import annotations

from celery import Celery

from app.settings import Settings

CPU_QUEUE = "cpu"


STAGE_PLACEMENTS = ("cpu", "gpu_host")


def gpu_queue(worker_id: str) -> str:
    return f"gpu.{worker_id}"


def stage_queue(worker_id: str, placement: str = "cpu") -> str:
    """Where a job's prepare and finalize go: the shared CPU pool, or the stage pool co-located
    with the GPU worker the job was routed to."""
    if placement not in STAGE_PLACEMENTS:
        raise ValueError(f"STENCIL_STAGE_PLACEMENT must be one of {STAGE_PLACEMENTS}, got {placement!r}")
    return CPU_QUEUE if placement == "cpu" else f"stage.{worker_id}"


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    celery = Celery(
        "stencil",
        broker=settings.celery_broker,
        backend=settings.celery_backend,
        include=["workers.cpu_tasks", "workers.gpu_tasks", "workers.adapter_tasks", "workers.controlnets.registry"],
    )
    celery.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_default_queue=CPU_QUEUE,
        task_track_started=True,
        task_send_sent_event=True,
        worker_send_task_events=True,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        # Survive a Redis restart: reconnect for as long as it takes (the default gives up after
        # 100 attempts and the consumer exits), retrying publishes too.
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        task_publish_retry=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout},
        worker_hijack_root_logger=False,
    )
    return celery


app = make_celery()
