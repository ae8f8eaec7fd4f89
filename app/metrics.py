"""Prometheus metrics: the one module that defines them, and the calls that record them.

Why one module: every process (dispatcher, CPU worker, GPU worker) imports the same definitions,
so names, labels and buckets cannot drift, and a dashboard can sum a metric across processes.
Each process serves its own ``/metrics`` with ``start_metrics_server(port)`` (``STENCIL_METRICS_PORT``,
0 = off); Prometheus adds the instance label. Queue lengths are read from Redis at scrape time by
``QueueLengthCollector``, registered by ONE process (the dispatcher), so the gauge is not
reported N times.

Label values are bounded on purpose (tiers, phases, outcomes, reason *classes*, queue names):
free text such as a failure message never becomes a label.

Celery's prefork CPU worker runs tasks in child processes: with ``PROMETHEUS_MULTIPROC_DIR`` set
(an empty folder, e.g. a tmpfs) before the worker starts, the children write their samples
there and ``start_metrics_server`` in the parent serves their aggregate.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "STENCIL_METRICS_PORT"

# Job statuses in the order a job moves through them (app.jobs.JobStatus); a phase is the time
# spent in one status, up to the next status the record has a timestamp for.
PHASE_ORDER = ("queued", "routed", "preparing", "waiting", "denoising", "finalizing")
TERMINAL_STATUSES = ("done", "failed", "cancelled", "expired")

# Failure reason -> class, first match wins. Substrings of the reasons app/ and workers/ write.
FAILURE_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cancelled", ("cancelled",)),
    ("deadline", ("deadline",)),
    ("dead_letter", ("dead-lettered",)),
    ("invalid_params", ("steps must", "strength must", "guidance must", "seed must", "width must",
                        "height must", "steps: ", "strength: ", "guidance: ", "seed: ", "width: ",
                        "height: ", "priority: ", "prompt: ", "negative_prompt: ", "template: ", "fidelity: ",
                        "deadline: ", "kind: ")),
    ("unknown_template", ("unknown template",)),
    ("missing_input", ("missing (expired", "inputs are missing", "never uploaded")),
    ("invalid_image", ("could not be decoded", "unsupported format", "too large", "over the limit", "over stencil_",
                       "is empty", "does not match image size", "mask array")),
    ("prepare_error", ("prepare failed",)),
    ("denoise_error", ("denoising failed",)),
    ("finalize_error", ("finalize failed",)),
)

CACHE_TIERS = ("device", "host", "store")
STEP_GRAPH_OUTCOMES = ("replayed", "captured", "eager", "off")

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_JOB_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
_API_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


def failure_class(reason: str | None) -> str:
    """A bounded label for a free-text failure reason."""
    text = (reason or "").lower()
    for name, needles in FAILURE_CLASSES:
        if any(n in text for n in needles):
            return name
    return "other"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def phase_durations(fields: Mapping[Any, Any]) -> dict[str, float]:
    """Seconds spent per phase from a job record's ``ts_<status>`` fields (plus ``total``).

    Statuses a job skipped (an empty mask never denoises) are absent; a phase ends at the next
    status that has a timestamp, the last one at the terminal status.
    """
    ts: dict[str, float] = {}
    for key, value in fields.items():
        key_s = _text(key)
        if key_s.startswith("ts_") and _text(value):
            try:
                ts[key_s[3:]] = float(_text(value))
            except ValueError:
                continue
    end_status = next((s for s in TERMINAL_STATUSES if s in ts), None)
    seen = [s for s in PHASE_ORDER if s in ts]
    marks = seen + ([end_status] if end_status else [])
    out: dict[str, float] = {}
    for here, nxt in zip(marks, marks[1:]):
        out[here] = max(0.0, ts[nxt] - ts[here])
    if end_status and "queued" in ts:
        out["total"] = max(0.0, ts[end_status] - ts["queued"])
    return out


class StencilMetrics:
    """All metric objects, registered on one registry (the default one in production)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.registry = registry
        self.step_seconds = Histogram(
            "stencil_engine_step_seconds", "Wall time of one batched denoising step.",
            buckets=_SECONDS_BUCKETS, registry=registry)
        self.batch_size = Histogram(
            "stencil_engine_batch_size", "Jobs sharing one denoising step.",
            buckets=_BATCH_BUCKETS, registry=registry)
        self.steps = Counter(
            "stencil_engine_steps", "Denoising steps by how the denoiser call ran: replayed from a CUDA graph, "
            "captured, eager, or off (no step graphs: the CPU).", ["graph"], registry=registry)
        self.masked_tokens = Histogram(
            "stencil_engine_masked_tokens", "Masked (computed) latent tokens per step, all jobs of the batch.",
            buckets=_TOKEN_BUCKETS, registry=registry)
        self.cache_hits = Counter(
            "stencil_cache_hits", "Activation cache lookups served by a tier.", ["tier"], registry=registry)
        self.cache_misses = Counter(
            "stencil_cache_misses", "Activation cache lookups a tier could not serve.", ["tier"],
            registry=registry)
        self.cache_bytes = Counter(
            "stencil_cache_fetched_bytes", "Bytes fetched from a cache tier.", ["tier"], registry=registry)
        self.job_phase_seconds = Histogram(
            "stencil_job_phase_seconds",
            "Seconds a finished job spent per phase (status), and in total (phase=total).",
            ["phase", "outcome"], buckets=_JOB_BUCKETS, registry=registry)
        self.jobs_ended = Counter(
            "stencil_jobs_ended", "Jobs that reached a terminal status.", ["outcome"], registry=registry)
        self.failures = Counter(
            "stencil_job_failures", "Failed jobs by reason class.", ["reason"], registry=registry)
        # SLO satisfaction: jobs that ended with an SLO deadline (their own, or the default from
        # STENCIL_SLO_FACTOR), met or missed. Across processes:
        # sum(rate(stencil_slo_jobs_total{outcome="met"}[5m])) / sum(rate(stencil_slo_jobs_total[5m]))
        self.slo_jobs = Counter(
            "stencil_slo_jobs", "Jobs that ended with an SLO deadline, by whether they met it.", ["outcome"],
            registry=registry)
        self.slo_satisfaction = Gauge(
            "stencil_slo_satisfaction", "Share of the jobs this process saw end with an SLO deadline that met it.",
            registry=registry, multiprocess_mode="liveall")
        self._slo_counts = [0, 0]  # met, missed (this process)
        # The HTTP gateway: from a request's arrival to its response's first byte (a stream: its
        # headers), by route template ("gate": refused before routing) and status code.
        self.api_request_seconds = Histogram(
            "stencil_api_request_seconds", "Gateway requests: seconds to the response's first byte.",
            ["route", "status"], buckets=_API_BUCKETS, registry=registry)

    def observe_step(self, batch_size: int, masked_tokens: int, seconds: float, graph: str = "off") -> None:
        self.steps.labels(graph=graph if graph in STEP_GRAPH_OUTCOMES else "other").inc()
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch_size)
        self.masked_tokens.observe(masked_tokens)

    def observe_cache(self, tier: str, hit: bool, nbytes: int) -> None:
        (self.cache_hits if hit else self.cache_misses).labels(tier=tier).inc()
        if nbytes > 0:
            self.cache_bytes.labels(tier=tier).inc(nbytes)

    def observe_failure(self, reason: str) -> None:
        self.failures.labels(reason=failure_class(reason)).inc()

    def observe_job_end(self, record_fields: Mapping[Any, Any]) -> None:
        status = _text(record_fields.get("status", record_fields.get(b"status", "")))
        outcome = status if status in TERMINAL_STATUSES else "unknown"
        self.jobs_ended.labels(outcome=outcome).inc()
        for phase, seconds in phase_durations(record_fields).items():
            self.job_phase_seconds.labels(phase=phase, outcome=outcome).observe(seconds)
        met = _text(record_fields.get("slo_met", record_fields.get(b"slo_met", "")))
        if met in ("0", "1"):
            self.observe_slo(met == "1")

    def observe_slo(self, met: bool) -> None:
        """A job with an SLO deadline ended: met (done by its deadline) or missed."""
        self.slo_jobs.labels(outcome="met" if met else "missed").inc()
        self._slo_counts[0 if met else 1] += 1
        self.slo_satisfaction.set(self._slo_counts[0] / sum(self._slo_counts))


class QueueLengthCollector(Collector):
    """``stencil_queue_length{queue}``: messages waiting in each Celery queue, read at scrape time.

    Celery's Redis transport keeps a queue as a list named after it plus one list per priority
    step (``<queue>\\x06\\x16<p>``); the gauge is their sum. Redis errors do not fail the scrape:
    ``stencil_queue_collector_up`` goes to 0 instead.
    """

    PRIORITY_SEP = "\x06\x16"
    PRIORITY_STEPS = (3, 6, 9)

    def __init__(self, redis_url: str, queues: Iterable[str] | Callable[[], Iterable[str]]) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._queues = queues

    def queue_names(self) -> list[str]:
        return list(self._queues() if callable(self._queues) else self._queues)

    def lengths(self) -> dict[str, int]:
        names = self.queue_names()
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.llen(name)
            for step in self.PRIORITY_STEPS:
                pipe.llen(f"{name}{self.PRIORITY_SEP}{step}")
        values = pipe.execute()
        per = 1 + len(self.PRIORITY_STEPS)
        return {name: int(sum(values[i * per:(i + 1) * per])) for i, name in enumerate(names)}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("stencil_queue_length", "Messages waiting in a Celery queue.",
                                  labels=["queue"])
        up = GaugeMetricFamily("stencil_queue_collector_up", "1 if the last queue-length read succeeded.")
        try:
            lengths = self.lengths()
        except Exception as exc:  # a scrape must never fail because Redis is briefly away
            log.warning("queue length collection failed: %s", exc)
            up.add_metric([], 0.0)
        else:
            for name, length in lengths.items():
                gauge.add_metric([name], float(length))
            up.add_metric([], 1.0)
        yield gauge
        yield up

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Static description, so registering does not hit Redis.
        yield GaugeMetricFamily("stencil_queue_length", "Messages waiting in a Celery queue.", labels=["queue"])
        yield GaugeMetricFamily("stencil_queue_collector_up", "1 if the last queue-length read succeeded.")


def default_queues(settings: Any) -> list[str]:
    """The Celery queues of a deployment: ``cpu``, ``gpu.<id>`` per routed GPU worker and, with stages
    placed on the GPU hosts, ``stage.<id>``."""
    from app.celery_app import CPU_QUEUE, gpu_queue, stage_queue

    stages = [stage_queue(w, settings.stage_placement) for w in settings.gpu_worker_ids]
    return list(dict.fromkeys([CPU_QUEUE, *(gpu_queue(w) for w in settings.gpu_worker_ids), *stages]))


def register_queue_collector(redis_url: str, queues: Iterable[str] | Callable[[], Iterable[str]],
                             registry: CollectorRegistry = REGISTRY) -> QueueLengthCollector:
    collector = QueueLengthCollector(redis_url, queues)
    registry.register(collector)
    return collector


# -- the process-wide instance and the calls the engine, dispatcher and tasks make ----------------

METRICS = StencilMetrics()


def observe_step(batch_size: int, masked_tokens: int, seconds: float, graph: str = "off") -> None:
    """One engine step: how many jobs shared it, how many tokens it computed, how long it took and
    whether its denoiser call replayed a CUDA graph (``graph``: one of ``STEP_GRAPH_OUTCOMES``)."""
    METRICS.observe_step(batch_size, masked_tokens, seconds, graph)


def observe_job_end(record_fields: Mapping[Any, Any]) -> None:
    """A job reached a terminal status: its phase latencies from the record's ``ts_<status>``."""
    METRICS.observe_job_end(record_fields)


def observe_failure(reason: str) -> None:
    """A job failed; counted by reason class (see ``failure_class``)."""
    METRICS.observe_failure(reason)


def observe_api_request(route: str, status: int, seconds: float) -> None:
    """A gateway request answered (its route template, its status, seconds to the first byte)."""
    METRICS.api_request_seconds.labels(route=route, status=str(status)).observe(seconds)


def observe_cache(tier: str, hit: bool, nbytes: int) -> None:
    """An activation-cache lookup on a tier (device, host, store) and the bytes it moved."""
    METRICS.observe_cache(tier, hit, nbytes)


_server_lock = threading.Lock()
_server: Any = None


def metrics_port_from_env() -> int:
    return int(os.environ.get(METRICS_PORT_ENV, "0") or 0)


def start_metrics_server(port: int, addr: str = "127.0.0.1",
                         registry: CollectorRegistry | None = None) -> int:
    """Serve ``/metrics`` on ``port`` from a daemon thread; 0 = disabled. Once per process.

    Returns the bound port (0 when disabled). With ``PROMETHEUS_MULTIPROC_DIR`` set the served
    registry aggregates every process writing to that folder (Celery prefork children).
    """
    global _server
    if port <= 0:
        return 0
    with _server_lock:
        if _server is not None:
            return int(_server.server_port)
        if registry is None:
            registry = REGISTRY
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                from prometheus_client import multiprocess

                registry = CollectorRegistry()
                multiprocess.MultiProcessCollector(registry)
        server, _thread = start_http_server(port, addr=addr, registry=registry)
        _server = server
        log.info("metrics on http://%s:%d/metrics", addr, server.server_port)
        return int(server.server_port)


def stop_metrics_server() -> None:
    """Stop this process's exporter (tests; a process normally keeps it until exit)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.shutdown()
            _server.server_close()
            _server = None


__all__ = [
    "METRICS", "QueueLengthCollector", "StencilMetrics", "default_queues", "failure_class",
    "metrics_port_from_env", "observe_cache", "observe_failure", "observe_job_end", "observe_step",
    "phase_durations", "register_queue_collector", "start_metrics_server", "stop_metrics_server",
]
