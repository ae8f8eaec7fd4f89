"""All configuration, read from environment variables (prefix ``STENCIL_``) with sane defaults.

One module owns every knob so that processes started by the CLI, by docker-compose or by the
tests agree on names and defaults. ``Settings.from_env()`` is cheap; call it at process start.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path


def _env(name: str, default: str) -> str:
    return os.environ.get(f"STENCIL_{name}", default)


def default_home() -> Path:
    """Where embedded state lives (local object store, saved embedded model)."""
    return Path(_env("HOME", str(Path.cwd() / ".stencil")))


# Precisions STENCIL_DTYPE accepts (names of torch dtypes; ``workers.models.loader.torch_dtype``).
DTYPES = ("float32", "float16", "bfloat16")
# STENCIL_MIXED_SIZE_CALLS (``workers.engine.sd_runner.mixed_size_calls``).
MIXED_SIZE_CALLS = ("auto", "lockstep", "sequential")
# STENCIL_SIZE_SWITCH (``workers.engine.scheduler.size_switch_for``).
SIZE_SWITCHES = ("auto", "mix", "drain")
# STENCIL_SLO_ORDER (``workers.engine.scheduler.slo_order_for``).
SLO_ORDERS = ("auto", "slack", "arrival", "deadline")
# STENCIL_SLO_YIELD (``workers.engine.scheduler.slo_yield_for``).
SLO_YIELDS = ("auto", "alone", "batch")


def parse_slo_margin(value: object) -> float | None:
    """STENCIL_SLO_MARGIN: None for auto (``workers.engine.scheduler.slo_margin_for``), else the share."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        margin = float(text)
    except ValueError:
        margin = -1.0
    if not margin >= 0.0:  # also rejects nan
        raise ValueError(f"SLO margin must be auto or a number >= 0, got {value!r}")
    return margin


# STENCIL_CACHE_STEPS=auto per model family: the fewest stored steps whose edits stay within SSIM
# 0.005 of every-step caches for every measured model, schedule and policy of the family, else every
# step (docs/bench/cache_steps.md; a test ties this table to docs/bench/cache_steps.json).
AUTO_CACHE_STEPS = {"sd": 2, "flux": 0}


@dataclass(frozen=True)
class Settings:
    """Process configuration. Every field maps to ``STENCIL_<FIELD_NAME_UPPER>``."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Celery broker/backend default to redis_url.
    broker_url: str = ""
    result_backend: str = ""
    home: Path = field(default_factory=default_home)

    # Object store: "local" (folder) or "s3".
    store_backend: str = "local"
    store_dir: Path = Path()
    s3_endpoint_url: str = ""
    s3_bucket: str = "stencil"
    s3_region: str = "us-east-1"
    s3_access_key: str = ""
    s3_secret_key: str = ""

    # Template activation caches: "" = the object store above; "s3" or "local" = a store of its
    # own (e.g. a large S3 bucket for activations, results elsewhere).
    activations_backend: str = ""
    activations_bucket: str = ""
    activations_dir: Path = Path()

    # Model: a diffusers StableDiffusionInpaintPipeline folder; empty = the embedded model
    # ``model_id``: "tiny-sd-inpaint-trained" (default; trained on scikit-image's images, ships in
    # workers/models/trained/), or the random-init "tiny-sd-inpaint" / "tiny-flux-fill" (noise
    # outputs; for unit tests and speed benchmarks), or a random-init true-size architecture
    # (workers/models/true_size.py: sd15-inpaint, sdxl-inpaint, flux-fill, flux-fill-subset).
    model_dir: str = ""
    # A single-file ``.safetensors`` checkpoint (original SD/SDXL layout, or a Flux transformer file),
    # loaded with diffusers' from_single_file and converted once to a folder under the home; its
    # configs come from ``model_dir`` (a folder) or from ``model_id``. Pickle-based files are refused.
    # ``model_dir`` naming a .safetensors file means the same.
    model_file: str = ""
    model_id: str = "tiny-sd-inpaint-trained"
    device: str = "cpu"
    # torch intra-op threads per worker process (0 = torch's default). On a small machine that
    # runs several workers, 1 avoids oversubscription (10-20x slowdowns measured on 2 cores).
    torch_threads: int = 0
    scheduler: str = "ddim"  # ddim | euler
    # Precision of weights and compute in every process (CPU tasks and GPU engine): float32 |
    # float16 | bfloat16. Each dtype reproduces the stock diffusers pipeline loaded with the same
    # ``torch_dtype`` (tests: 1/255 in float32, 2/255 in bfloat16). float32 on CPU (the exactness
    # reference; half precision on CPU is for memory, bfloat16 is the one CPUs run natively); on
    # CUDA set float16 or bfloat16 (the recommended setting: half the weight and cache bytes, tensor cores).
    dtype: str = "float32"
    # Batch invariance: each job's rows of every token-wise matmul (nn.Linear) multiplied on their
    # own, so a job's result does not depend on what it was batched with (workers/adapters/layout.py:
    # GEMM kernels sum a row differently with the number of rows and its place in them; in half
    # precision that last bit reached 7/255 after 5 Flux steps). auto = on in float16/bfloat16 on
    # the CPU, off in float32 (where it never reaches a pixel) and on CUDA (one GEMM per job per
    # layer cost 19% of the jobs/s end to end on an H200; batched bf16 results stay within the
    # 2/255 of the GPU tests) | on | off. Cost: BENCHMARKS.md, batch invariance.
    batch_invariant: str = "auto"

    # Stages outside the denoising loop (text encoders, VAE encode and decode: the prepare and
    # finalize tasks). stage_placement: cpu = the shared ``cpu`` queue, served by the CPU worker pool |
    # gpu_host = the queue ``stage.<id>`` of the GPU host the job was routed to, served by a
    # ``stencil stage-worker --worker-id <id>`` on that host (docker-compose.yml's GPU profile).
    # stage_device: the torch device the stage modules run on in the worker that serves them (cuda on a
    # GPU host: docs/bench/placement.md; a device this host lacks stops the worker with the reason).
    stage_placement: str = "cpu"
    stage_device: str = "cpu"

    # Engine.
    worker_id: str = "0"
    max_batch: int = 8
    # continuous (jobs of any size join free slots every step; mixed sizes are batched exactly) |
    # static (admit only when the batch drained) | bucketed (one image size per batch): baselines.
    batching: str = "continuous"
    # Continuous batching under a queue: a free slot goes first to the earliest waiting job of a size
    # already in the batch (each size in a step is a denoiser call of its own); a job passed over
    # this many steps goes first regardless, and its size-mates follow it (the batch changes size as
    # a group). 0 = strict FCFS. BENCHMARKS.md, mixed sizes.
    size_affinity_steps: int = 50
    # How such a batch changes size under a queue: mix (the new size joins free slots beside the old:
    # two calls a step until the old jobs finish) | drain (the batch takes no newcomers until its jobs
    # finished, as a bucket: one call a step) | auto (mix on CUDA, where an empty slot is the dearer;
    # drain elsewhere, where a batch costs the sum of its jobs; BENCHMARKS.md, mixed sizes).
    size_switch: str = "auto"
    # The order SLO-aware admission offers a crowded queue's free slots in, among jobs that can still
    # make their deadline (late ones go last either way): slack (least slack first) | arrival (the
    # plain admission order: size affinity, then FCFS) | deadline (size affinity, then earliest
    # deadline first) | auto (deadline on CUDA, where under overload it kept the most deadlines in the
    # GPU-shaped simulator; slack elsewhere, where it kept slightly more; BENCHMARKS.md, mixed sizes).
    slo_order: str = "auto"
    # When a running job with the service's default (soft) deadline gives its slot back to a waiting
    # on-time job: alone (once its deadline is out of reach even alone) | batch (once the running
    # batch's predicted finish misses it) | auto (batch on CUDA, where under overload it kept more
    # deadlines in the GPU-shaped simulator; alone elsewhere). It keeps its progress and rejoins later.
    slo_yield: str = "auto"
    # SLO admission's predicted finish times are stretched by this share before they are compared
    # with deadlines (a margin for step-time noise): a number >= 0, or auto (0.01 on CUDA, where 0 /
    # 0.01 / 0.02 / 0.03 were tried in the GPU-shaped simulator; 0 elsewhere: on the real CPU run a 1%
    # margin's effect was within the run's noise; BENCHMARKS.md, mixed sizes).
    slo_margin: str = "auto"
    # How a step with several image sizes makes its UNet calls (one per size; workers/engine/sd_runner.py):
    # lockstep (threads meeting at every transformer block to pack all sizes' tokens: fewer, larger
    # kernels) | sequential (one size after the other on the engine's thread) | auto (lockstep on
    # CUDA, sequential elsewhere: on this CPU a two-size step of 8 jobs cost 4-5 ms less sequential,
    # a four-size step 1 ms more; docs/bench/mixing_cost.md).
    mixed_size_calls: str = "auto"
    engine_idle_sleep: float = 0.005

    # Compiled denoising steps (workers/compiled.py): torch.compile (dynamic shapes) of the full
    # denoiser forward and of the mask-aware packed per-block computations, eager where compilation
    # fails. off | default | reduce-overhead | max-autotune. Off by default: on this CPU the compiled
    # steps of the (320, 640) UNet were 1.01x (full) and 1.02x (mask-aware) the eager ones, for 60-85 s
    # of compilation per worker start (docs/bench/compiled.md); on a GPU host try default or max-autotune.
    compile: str = "off"
    # Denoising steps replayed as CUDA graphs (workers/engine/graphs.py): a step signature (each
    # job's mode, rows and token counts) is captured the second time it is seen and replayed from
    # then on; a capture that fails runs eagerly. auto = on with CUDA | off.
    cuda_graphs: str = "auto"

    # Mask-aware inference and the template activation cache.
    mask_aware: bool = True
    maskaware_kv_source: str = "cache"  # cache (K/V + block outputs) | recompute (outputs only)
    mask_dilation: int = 0  # dilate token masks by this many tokens (fewer seams, more compute)
    # UNet coarse levels' token masks: recompute a coarse token when at least this share of its
    # pixels is masked; 0 = OR-pooling (any masked pixel; the latent level always keeps OR)
    # (workers/maskaware/tokens.py). 0.25 is the largest measured threshold whose SSIM loss against
    # OR-pooling, whole image and in the mask, stays <= 0.005 for fast and balanced on every trace
    # of the trained SDXL-layout model (0.5: 0.011 in the mask), docs/bench/fidelity_pooling_sdxl_layout.md;
    # speed at true sizes: BENCHMARKS.md (true-size models).
    mask_pool_threshold: float = 0.25
    # Host-RAM tier budget per GPU worker; 0 = auto (workers/engine/host_budget.py): fraction
    # host_cache_fraction of physical memory per GPU worker of the host minus the model's weights,
    # capped by available memory minus 1 GiB; logged at start.
    host_cache_bytes: int = 0
    host_cache_fraction: float = 0.5
    # Storage codec of template caches (workers/engine/cache_codec.py), independent of the compute
    # dtype: float32 | float16 | bfloat16 | int8 (K/V 8-bit with per-channel scales, block outputs
    # 16-bit). Exact-region warm-ups are always stored losslessly (float32). Default: the most
    # compact codec whose SSIM loss vs float32 caches is <= 0.005 (docs/bench/cache_bytes.md).
    cache_dtype: str = "int8"
    # Steps of its schedule a template warm-up stores (workers/engine/template_cache.py): the middle
    # step of each of n equal segments serves the whole segment; 0 = every step; "auto" = the
    # measured default of the model family (AUTO_CACHE_STEPS). Exact-region caches store every step.
    cache_steps: str = "auto"
    prefetch_steps: int = 8  # steps of a job's template cache fetched ahead (from routing on)
    # Concurrent background fetches per GPU worker: S3 reads are latency-bound, so several
    # requests in flight (boto3's pool allows 10) are what keeps prefetch ahead of the queue.
    prefetch_threads: int = 4
    # Per-unit load/compute plan for steps not wholly resident (workers/engine/runner_base.py):
    # plan | all (wait for every unit: pipelining) | resident (never wait) | step (per-step rule)
    cache_plan: str = "plan"
    cache_plan_max_wait_s: float = 5.0  # a planned load not there by then: compute fully
    auto_warm: bool = True  # an edit of a template without cache triggers its warm-up
    warm_prompt: str = ""
    warm_seed: int = 0
    # Fidelity policy of edits that do not name one (app/fidelity.py): exact | balanced | fast.
    # The fastest policy that meets the fidelity targets (whole-image SSIM >= 0.95 and in-mask
    # SSIM >= two seeds' agreement, guidance 1-7.5, trained SD and Flux models, BENCHMARKS.md):
    # fast (SSIM >= 0.977, 89 % of the mask-aware saving kept). balanced: >= 0.988, 84 %.
    fidelity: str = "fast"

    # LoRA adapters (app/adapters.py, workers/adapters/): host-RAM LRU of adapters per GPU worker,
    # the largest adapter file accepted, adapters per job, and when a job's adapters apply:
    # exact (from its first step) | late (once loaded, within lora_late_max_fraction of its steps).
    lora_cache_bytes: int = 2 * 1024**3
    lora_fetch_threads: int = 2
    max_lora_bytes: int = 1024**3
    max_loras_per_job: int = 4
    lora_patch: str = "exact"
    lora_late_max_fraction: float = 0.3
    # Spare copies of the adapted weights that merged sets live in (switching = a pointer swap,
    # merged in the background); 0 = merge in place (less memory, merges on the critical path).
    lora_merge_buffers: int = 2

    # ControlNets (app/controls.py, workers/controlnets/): resident ControlNets per GPU worker (bytes
    # of weights on the device), the largest ControlNet accepted, controls per job, and whether a
    # step computes its ControlNets concurrently with the UNet's down path ("thread") or before it.
    controlnet_cache_bytes: int = 6 * 1024**3
    max_controlnet_bytes: int = 8 * 1024**3
    max_controls_per_job: int = 4
    controlnet_parallel: str = "thread"

    # Input limits.
    max_image_pixels: int = 4096 * 4096
    max_upload_bytes: int = 32 * 1024 * 1024
    max_steps: int = 200
    max_side: int = 1024  # longer image side is scaled down to this before processing
    min_side: int = 64  # smaller images are refused (a UNet's coarsest level needs a few tokens)

    # Jobs.
    job_ttl_seconds: int = 7 * 24 * 3600
    blob_ttl_seconds: int = 24 * 3600
    intake_stream: str = "stencil:jobs"
    intake_group: str = "dispatchers"
    intake_claim_idle_ms: int = 60_000
    intake_max_deliveries: int = 5

    # Dispatcher: comma-separated GPU worker ids it routes to.
    gpu_workers: str = "0"
    # mask_aware (default): with the fitted cost model, else the one shipped for the configured model
    # (ops/sim/costmodels: same id or architecture, same device type), else least_requests (logged) |
    # round_robin | least_requests | least_masked_tokens
    routing_policy: str = "mask_aware"
    cost_model: str = ""  # fitted cost-model JSON (ops/bench/profile.py); empty = look up by model id
    # SLO-aware scheduling (workers/engine/scheduler.py): the engine orders waiting jobs by slack or
    # arrival (STENCIL_SLO_ORDER), refuses admissions that would make a running job miss its deadline,
    # lets jobs late for their default deadline yield to on-time ones and expires jobs whose (user)
    # deadline is out of reach, with the cost model's step-time predictor. auto (default) | on | off.
    # auto = on wherever the resolution-aware batch predictor is fitted (``stencil profile --sizes``),
    # because that is where it helps (BENCHMARKS.md, mixed sizes): at loads up to 0.7 it meets as many deadlines as
    # continuous batching with size affinity or more, at equal throughput; above saturation it meets
    # +69% to 18x more in every run (real and both simulators), +13% to +60% at the first load where
    # the latter meets 80% or fewer (real runs and both simulators; where it lands just under 80%, +30%
    # is out of reach), for 0-1% less throughput below saturation and 7-38% less under sustained
    # overload; a burst where every job is late (a catalog) batches like FCFS while new on-time jobs
    # go first. Off without it: a single-size linear model mispredicts mixed-size batches. on = with
    # any fitted model; off = never (highest peak throughput under overload).
    slo_admission: str = "auto"
    # SLO admission's step-time predictor is corrected online by the engine's measured steps: x an
    # EWMA (this weight per step; 0 = the fit as is) of measured / predicted (app/calibration.py).
    step_time_calibration: float = 0.05
    # Default deadline of a job without one: submission + slo_factor x its standalone time (alone on an
    # idle worker, predicted, plus slo_overhead_seconds for prepare and finalize); recorded as
    # ``slo_deadline`` with ``slo_met`` at the end, counted by ``stencil_slo_jobs{outcome}``.
    # Soft: it orders SLO-aware admission, it never expires a job. 0 = no default deadlines.
    slo_factor: float = 5.0
    view_refresh_ms: float = 50.0
    worker_stale_seconds: float = 120.0
    inflight_ttl_seconds: float = 600.0
    slo_overhead_seconds: float = 0.0
    dispatch_decode_mask: bool = True
    default_mask_ratio: float = 1.0
    cache_tier: str = "local"
    routing_externality: float = 0.0
    # Size affinity in routing (app/routing.py): a job goes to a worker that is idle or already runs
    # its image size when one has at most this many more jobs than the least loaded worker. Each size
    # in a step is one more denoiser call paying the GPU's small-batch floor; 0 = off.
    routing_size_slack: float = 8.0

    # Prometheus metrics HTTP port of this process (0 = off). Processes on one host need their own.
    metrics_port: int = 0
    # Where /metrics listens: loopback unless configured (containers set 0.0.0.0 on their own
    # network, with the port not published to the host).
    metrics_address: str = "127.0.0.1"

    # Recovery (app/sweeper.py): a live job no process has touched for this long, and whose
    # denoising lease no engine holds, has its chain re-sent (at most max_redrives times, then it
    # fails with the reason). Recovery does not wait for the broker's visibility timeout.
    stall_timeout_s: float = 45.0
    max_redrives: int = 3
    sweep_interval_s: float = 5.0

    # Celery broker: must exceed the longest job (DESIGN.md section 4).
    visibility_timeout: int = 3600
    lease_seconds: float = 30.0

    # HTTP gateway (`stencil api`, app/gateway/): the address it listens on (loopback unless
    # configured; compose listens on 0.0.0.0 inside its network and publishes the port on the host's
    # STENCIL_BIND_ADDRESS) and its port.
    bind_address: str = "127.0.0.1"
    api_port: int = 8080
    # Per tenant (a tenant's own limits, `stencil tenant limits`, win): requests per second refilled
    # into a token bucket of api_burst requests (429 + Retry-After past it), and jobs not yet ended.
    api_rate_per_s: float = 20.0
    api_burst: int = 40
    api_max_jobs_per_tenant: int = 32
    # Request bodies: edits, templates and catalogs up to this many bytes (add-on uploads:
    # STENCIL_MAX_LORA_BYTES / STENCIL_MAX_CONTROLNET_BYTES; every image within STENCIL_MAX_UPLOAD_BYTES
    # and STENCIL_MAX_IMAGE_PIXELS); a request's headers must arrive within api_header_timeout_s and its
    # body may pause at most api_body_timeout_s between two reads (slow clients get 408).
    api_max_body_bytes: int = 64 * 1024 * 1024
    api_header_timeout_s: float = 10.0
    api_body_timeout_s: float = 30.0
    # The Python client over HTTP: `StencilClient()` talks to this gateway with this key when set.
    api_url: str = ""
    api_key: str = ""
    # Webhooks (`stencil webhook-sender`): attempts per event (backoff 1 s doubling up to 1 h), the
    # timeout of one POST, and whether receivers on loopback, private or link-local addresses are
    # allowed (off: a tenant's URL could otherwise reach the deployment's own services).
    webhook_max_attempts: int = 8
    webhook_timeout_s: float = 10.0
    webhook_allow_private: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"STENCIL_DTYPE must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.batch_invariant.strip().lower() not in ("auto", "on", "off"):
            raise ValueError(f"STENCIL_BATCH_INVARIANT must be auto, on or off, got {self.batch_invariant!r}")
        if self.cuda_graphs.strip().lower() not in ("auto", "off"):
            raise ValueError(f"STENCIL_CUDA_GRAPHS must be auto or off, got {self.cuda_graphs!r}")
        if self.mixed_size_calls not in MIXED_SIZE_CALLS:
            raise ValueError(f"STENCIL_MIXED_SIZE_CALLS must be one of {', '.join(MIXED_SIZE_CALLS)}, "
                             f"got {self.mixed_size_calls!r}")
        if self.size_switch not in SIZE_SWITCHES:
            raise ValueError(f"STENCIL_SIZE_SWITCH must be one of {', '.join(SIZE_SWITCHES)}, "
                             f"got {self.size_switch!r}")
        if self.slo_order not in SLO_ORDERS:
            raise ValueError(f"STENCIL_SLO_ORDER must be one of {', '.join(SLO_ORDERS)}, got {self.slo_order!r}")
        if self.slo_yield not in SLO_YIELDS:
            raise ValueError(f"STENCIL_SLO_YIELD must be one of {', '.join(SLO_YIELDS)}, got {self.slo_yield!r}")
        try:
            parse_slo_margin(self.slo_margin)
        except ValueError as exc:
            raise ValueError(f"STENCIL_SLO_MARGIN: {exc}") from None
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
        return self.result_backend or self.redis_url

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


__all__ = ["AUTO_CACHE_STEPS", "DTYPES", "Settings", "default_home"]
