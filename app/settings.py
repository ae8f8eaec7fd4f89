"""All configuration, read from environment variables (prefix ``STENCIL_``) with sane defaults.

One module owns every setting so that processes started by the CLI, by docker-compose or by the
tests agree on names and defaults. A setting exists only where a deployment has a reason to change
it; what an ablation varies is a parameter of the benchmark that varies it (ops/bench/). Each field
carries its subject and a one-line meaning: ``stencil config --markdown`` writes
docs/configuration.md from them, and a test keeps the page and this module in step.
``Settings.from_env()`` is cheap; call it at process start.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.fidelity import POLICIES


def _env(name: str, default: str) -> str:
    return os.environ.get(f"STENCIL_{name}", default)


def default_home() -> Path:
    """Where embedded state lives (local object store, saved embedded model)."""
    return Path(_env("HOME", str(Path.cwd() / ".stencil")))


# Precisions STENCIL_DTYPE accepts (names of torch dtypes; ``workers.models.loader.torch_dtype``).
DTYPES = ("float32", "float16", "bfloat16")

# STENCIL_CACHE_STEPS=auto per model family: the fewest stored steps whose edits stay within SSIM
# 0.005 of every-step caches for every measured model, schedule and policy of the family, else every
# step (docs/bench/cache_steps.md; a test ties this table to docs/bench/cache_steps.json).
AUTO_CACHE_STEPS = {"sd": 2, "flux": 0}

# The subjects of docs/configuration.md, in its order.
GROUPS = ("Connections and storage", "Model and precision", "Engine", "Mask-aware inference and caches",
          "Add-ons", "Input limits and retention", "Routing and SLOs", "Recovery", "HTTP gateway and client",
          "Webhooks", "Metrics and logs")


def setting(default: Any, group: str, meaning: str, *, choices: tuple[str, ...] = (), secret: bool = False,
            factory: Any = None) -> Any:
    """A settings field with what the configuration reference says of it."""
    if group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}")
    meta = {"group": group, "meaning": meaning, "choices": choices, "secret": secret}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


_IO = "Connections and storage"
_MODEL = "Model and precision"
_ENGINE = "Engine"
_CACHES = "Mask-aware inference and caches"
_ADDONS = "Add-ons"
_LIMITS = "Input limits and retention"
_ROUTING = "Routing and SLOs"
_RECOVERY = "Recovery"
_API = "HTTP gateway and client"
_HOOKS = "Webhooks"
_OBS = "Metrics and logs"


@dataclass(frozen=True)
class Settings:
    """Process configuration. Every field maps to ``STENCIL_<FIELD_NAME_UPPER>``."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", _IO,
                             "Redis: job records, intake stream, worker state; Celery's result backend", secret=True)
    broker_url: str = setting("", _IO, "Celery broker; empty = STENCIL_REDIS_URL", secret=True)
    home: Path = setting(None, _IO, "where embedded state lives (local store, saved models, fitted cost models); "
                         "default ./.stencil", factory=default_home)
    store_backend: str = setting("local", _IO, "object store of templates, results and caches",
                                 choices=("local", "s3"))
    store_dir: Path = setting(Path(), _IO, "folder of the local object store; default STENCIL_HOME/store")
    s3_endpoint_url: str = setting("", _IO, "S3 endpoint (MinIO, ...); empty = AWS itself", secret=True)
    s3_bucket: str = setting("stencil", _IO, "S3 bucket of the object store")
    s3_region: str = setting("us-east-1", _IO, "S3 region")
    s3_access_key: str = setting("", _IO, "S3 access key (required with s3; placeholders refused)", secret=True)
    s3_secret_key: str = setting("", _IO, "S3 secret key (required with s3; placeholders refused)", secret=True)
    # Template activation caches may live in a store of their own (e.g. a large S3 bucket).
    activations_backend: str = setting("", _IO, "store of template activation caches; empty = the object store",
                                       choices=("", "local", "s3"))
    activations_bucket: str = setting("", _IO, "S3 bucket of activation caches; empty = STENCIL_S3_BUCKET")
    activations_dir: Path = setting(Path(), _IO, "folder of local activation caches; default STENCIL_STORE_DIR")

    # Model. Empty model_dir = the embedded model model_id: tiny-sd-inpaint-trained (trained on
    # scikit-image's images, ships in workers/models/trained/), random-init tiny-sd-inpaint /
    # tiny-flux-fill (noise outputs; tests and speed benchmarks) or a random-init true-size
    # architecture (workers/models/true_size.py). docs/models.md.
    model_dir: str = setting("", _MODEL, "a diffusers inpainting pipeline folder (or a .safetensors file); "
                             "empty = the embedded STENCIL_MODEL_ID")
    model_file: str = setting("", _MODEL, "a single-file .safetensors checkpoint (SD/SDXL, or a Flux transformer), "
                              "converted once; configs from STENCIL_MODEL_DIR or STENCIL_MODEL_ID; pickles refused")
    model_id: str = setting("tiny-sd-inpaint-trained", _MODEL, "the embedded model used when STENCIL_MODEL_DIR is empty")
    device: str = setting("cpu", _MODEL, "torch device of the GPU worker's engine (cpu, cuda, cuda:1, ...)")
    # On a small machine that runs several workers, 1 avoids oversubscription (10-20x slowdowns on 2 cores).
    torch_threads: int = setting(0, _MODEL, "torch intra-op threads per worker process; 0 = torch's default")
    scheduler: str = setting("ddim", _MODEL, "noise scheduler of SD-family models", choices=("ddim", "euler"))
    # Each dtype reproduces the stock diffusers pipeline loaded with the same torch_dtype (tests: 1/255
    # in float32, 2/255 in bfloat16). On CUDA set float16 or bfloat16: half the weight and cache bytes.
    dtype: str = setting("float32", _MODEL, "precision of weights and compute in every process", choices=DTYPES)
    # GEMM kernels sum a row differently with the number of rows; in half precision that last bit
    # reached 7/255 after 5 Flux steps. On CUDA one GEMM per job per layer cost 19% of the jobs/s.
    batch_invariant: str = setting("auto", _MODEL, "multiply each job's rows on their own, so a result does not "
                                   "depend on its batch-mates (auto: see the table below)", choices=("auto", "on", "off"))
    stage_placement: str = setting("cpu", _MODEL, "where text encoders and VAE run: the shared cpu queue, or the "
                                   "stage pool of the GPU host a job was routed to", choices=("cpu", "gpu_host"))
    stage_device: str = setting("cpu", _MODEL, "torch device of the stage modules in the worker that serves them")

    worker_id: str = setting("0", _ENGINE, "this GPU worker's id (its queue: gpu.ID); set by --worker-id")
    max_batch: int = setting(8, _ENGINE, "jobs denoised together by one engine")
    # static and bucketed are the baselines of the batching benchmarks.
    batching: str = setting("continuous", _ENGINE, "continuous: jobs of any size join free slots every step; "
                            "static: admit when the batch drained; bucketed: one image size per batch",
                            choices=("continuous", "static", "bucketed"))
    # On this CPU compiled steps were 1.01-1.02x eager, for 60-85 s of compilation (docs/bench/compiled.md).
    compile: str = setting("off", _ENGINE, "torch.compile of the denoising steps (eager where it fails)",
                           choices=("off", "default", "reduce-overhead", "max-autotune"))
    cuda_graphs: str = setting("auto", _ENGINE, "replay denoising steps as CUDA graphs (auto: on with CUDA)",
                               choices=("auto", "off"))

    mask_aware: bool = setting(True, _CACHES, "recompute only masked tokens from a template's activation cache")
    host_cache_bytes: int = setting(0, _CACHES, "host-RAM tier of template caches per GPU worker; 0 = auto (half "
                                    "the memory per GPU worker minus the weights, logged at start)")
    # Exact-region warm-ups are always stored losslessly (float32).
    cache_dtype: str = setting("int8", _CACHES, "storage codec of template caches (int8: the most compact within "
                               "SSIM 0.005 of float32, docs/bench/cache_bytes.md)",
                               choices=("float32", "float16", "bfloat16", "int8"))
    cache_steps: str = setting("auto", _CACHES, "steps a template warm-up stores (each serves its segment); "
                               "0 = every step; auto = the model family's measured default")
    prefetch_steps: int = setting(8, _CACHES, "steps of a job's template cache fetched ahead, from routing on")
    fidelity: str = setting("fast", _CACHES, "fidelity policy of edits that name none (docs/fidelity.md)",
                            choices=POLICIES)

    lora_cache_bytes: int = setting(2 * 1024**3, _ADDONS, "host-RAM LRU of LoRA adapters per GPU worker")
    max_lora_bytes: int = setting(1024**3, _ADDONS, "largest LoRA file accepted")
    controlnet_cache_bytes: int = setting(6 * 1024**3, _ADDONS, "device bytes of resident ControlNets per GPU worker")
    max_controlnet_bytes: int = setting(8 * 1024**3, _ADDONS, "largest ControlNet accepted")

    max_image_pixels: int = setting(4096 * 4096, _LIMITS, "largest decoded image accepted (pixels)")
    max_upload_bytes: int = setting(32 * 1024 * 1024, _LIMITS, "largest image upload accepted (bytes)")
    max_steps: int = setting(200, _LIMITS, "most denoising steps a job may ask for")
    max_side: int = setting(1024, _LIMITS, "an image's longer side is scaled down to this before processing")
    job_ttl_seconds: int = setting(7 * 24 * 3600, _LIMITS, "how long a job record is kept")
    blob_ttl_seconds: int = setting(24 * 3600, _LIMITS, "how long a job's uploaded images are kept")

    gpu_workers: str = setting("0", _ROUTING, "comma-separated GPU worker ids the dispatcher routes to")
    # mask_aware without a fitted or shipped cost model (ops/sim/costmodels) falls back to least_requests (logged).
    routing_policy: str = setting("mask_aware", _ROUTING, "how the dispatcher picks a GPU worker (mask_aware without a fitted or shipped cost model: least_requests, logged)",
                                  choices=("mask_aware", "round_robin", "least_requests", "least_masked_tokens"))
    cost_model: str = setting("", _ROUTING, "fitted cost-model JSON (stencil profile); empty = look up by model id")
    # Gains and costs measured: docs/sizes-and-slos.md.
    slo_admission: str = setting("auto", _ROUTING, "SLO-aware admission in the engine (auto: on where the "
                                 "resolution-aware predictor is fitted)", choices=("auto", "on", "off"))
    slo_factor: float = setting(5.0, _ROUTING, "default (soft) deadline = submission + this x the job's standalone "
                                "time; 0 = none")

    # A live job nobody touched for stall_timeout_s and whose denoising lease no engine holds has its
    # chain re-sent (at most 3 times, then it fails with the reason), without waiting for the broker.
    stall_timeout_s: float = setting(45.0, _RECOVERY, "a live job untouched this long is re-sent")
    sweep_interval_s: float = setting(5.0, _RECOVERY, "how often the dispatcher looks for stalled jobs")
    lease_seconds: float = setting(30.0, _RECOVERY, "lifetime of a denoising job's lease, renewed while it runs")
    # How soon a host that died (its workers stopped publishing) loses its jobs to the others
    # (docs/multi-host.md): lower where hosts come and go, above any pause a live worker may take.
    worker_stale_seconds: float = setting(120.0, _RECOVERY, "a GPU worker silent this long is presumed gone: "
                                          "routing skips it and the sweeper re-sends its jobs")
    visibility_timeout: int = setting(3600, _RECOVERY, "Celery broker visibility timeout; must exceed the longest job")

    bind_address: str = setting("127.0.0.1", _API, "address `stencil api` listens on (loopback unless configured)")
    api_port: int = setting(8080, _API, "port of `stencil api`")
    # A tenant's own limits (`stencil tenant limits`) win over these three.
    api_rate_per_s: float = setting(20.0, _API, "requests per second per tenant (token bucket; 429 past it)")
    api_burst: int = setting(40, _API, "token bucket size per tenant")
    api_max_jobs_per_tenant: int = setting(32, _API, "jobs not yet ended per tenant")
    # Add-on uploads: STENCIL_MAX_LORA_BYTES / STENCIL_MAX_CONTROLNET_BYTES.
    api_max_body_bytes: int = setting(64 * 1024 * 1024, _API, "largest request body (edits, templates, catalogs)")
    api_header_timeout_s: float = setting(10.0, _API, "a request's headers must arrive within this (408)")
    api_body_timeout_s: float = setting(30.0, _API, "longest pause between two reads of a body (408)")
    api_url: str = setting("", _API, "the Python client talks to this gateway when set", secret=True)
    api_key: str = setting("", _API, "the Python client's API key", secret=True)

    # Off: a tenant's URL could otherwise reach the deployment's own services.
    webhook_allow_private: bool = setting(False, _HOOKS, "allow webhook receivers on loopback, private or "
                                          "link-local addresses")

    metrics_port: int = setting(0, _OBS, "Prometheus /metrics port of this process; 0 = off")
    metrics_address: str = setting("127.0.0.1", _OBS, "where /metrics listens (loopback unless configured)")
    log_level: str = setting("INFO", _OBS, "log level of the `stencil` processes (DEBUG, INFO, WARNING, ERROR)")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"STENCIL_DTYPE must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.batch_invariant.strip().lower() not in ("auto", "on", "off"):
            raise ValueError(f"STENCIL_BATCH_INVARIANT must be auto, on or off, got {self.batch_invariant!r}")
        if self.cuda_graphs.strip().lower() not in ("auto", "off"):
            raise ValueError(f"STENCIL_CUDA_GRAPHS must be auto or off, got {self.cuda_graphs!r}")
        steps = str(self.cache_steps).strip().lower()
        if steps != "auto" and not steps.isdigit():
            raise ValueError(f"STENCIL_CACHE_STEPS must be auto or a step count >= 0 (0 = every step), "
                             f"got {self.cache_steps!r}")
        if self.store_dir == Path():
            object.__setattr__(self, "store_dir", self.home / "store")
        if self.activations_dir == Path():
            object.__setattr__(self, "activations_dir", self.store_dir)

    def cuda_graphs_for(self, device: str) -> bool:
        """Whether engines on ``device`` replay their steps as CUDA graphs."""
        return self.cuda_graphs.strip().lower() == "auto" and device.strip().lower().startswith("cuda")

    def batch_invariant_for(self, dtype: str, device: str = "cpu") -> bool:
        """Whether engines of models in ``dtype`` (a STENCIL_DTYPE name) on ``device`` multiply job by job."""
        mode = self.batch_invariant.strip().lower()
        return mode == "on" or (mode == "auto" and dtype in ("float16", "bfloat16")
                                and not device.strip().lower().startswith("cuda"))

    def cache_steps_for(self, family: str) -> int:
        """Steps a template warm-up of a ``family`` model (``sd`` | ``flux``) stores; 0 = every step."""
        steps = str(self.cache_steps).strip().lower()
        return AUTO_CACHE_STEPS.get(family, 0) if steps == "auto" else int(steps)

    @property
    def celery_broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def celery_backend(self) -> str:
        return self.redis_url

    @property
    def gpu_worker_ids(self) -> list[str]:
        return [w.strip() for w in self.gpu_workers.split(",") if w.strip()]

    @classmethod
    def from_env(cls, **overrides: object) -> "Settings":
        """Build settings from ``STENCIL_*`` variables; keyword overrides win."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            key = f"STENCIL_{f.name.upper()}"
            if key not in os.environ:
                continue
            raw = os.environ[key]
            default = f.default if f.default is not dataclasses.MISSING else None
            if isinstance(default, bool):
                values[f.name] = raw.strip().lower() in {"1", "true", "yes", "on"}
            elif isinstance(default, int):
                values[f.name] = int(raw)
            elif isinstance(default, float):
                values[f.name] = float(raw)
            elif f.name in {"home", "store_dir", "activations_dir"}:
                values[f.name] = Path(raw)
            else:
                values[f.name] = raw
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings in a child process."""
        env: dict[str, str] = {}
        for f in dataclasses.fields(self):
            env[f"STENCIL_{f.name.upper()}"] = str(getattr(self, f.name))
        return env


__all__ = ["AUTO_CACHE_STEPS", "DTYPES", "GROUPS", "Settings", "default_home"]
