"""Job records in Redis: the single source of truth for what is done.

A job is a hash ``stencil:job:{id}``. Status changes go through one Lua script so that a job in a
terminal state (done, failed, cancelled, expired) never moves again, whichever process (client,
dispatcher, Celery task, engine) races to update it. Tasks consult the record to stay idempotent
under at-least-once delivery.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from app.adapters import (
    DEFAULT_MAX_LORAS,
    LORA_PATCH_POLICIES,
    AdapterSet,
    adapter_set,
    dump_adapter_set,
    load_adapter_set,
)
from app.blobs import BLOB_PREFIX
from app.controls import DEFAULT_MAX_CONTROLS, Control, check_controls, dump_controls, load_controls
from app.fidelity import POLICIES, check_policy
from app.validation import MAX_GUIDANCE, MAX_PRIORITY, MAX_SEED, InvalidParameter, integer, number, object_id, text

JOB_PREFIX = "stencil:job:"
IDEMPOTENCY_PREFIX = "stencil:idem:"
LIVE_KEY = "stencil:jobs:live"  # sorted set of non-terminal job ids (the sweeper's work list)


class JobStatus(str, enum.Enum):
    QUEUED = "queued"
    ROUTED = "routed"
    PREPARING = "preparing"
    WAITING = "waiting"
    DENOISING = "denoising"
    FINALIZING = "finalizing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})

# Fields a client sets at submission (everything else is written by the service).
PARAM_FIELDS = (
    "kind", "template_id", "prompt", "negative_prompt", "steps", "guidance", "strength", "seed",
    "priority", "deadline", "width", "height", "keep_unmasked", "fidelity", "loras", "lora_patch",
    "controls",
)

# Atomic submission. KEYS[1] = idempotency key ("" = none), KEYS[2] = the new job's hash,
# KEYS[3] = intake stream, KEYS[4] = the live-job set (scored by submission time). ARGV: job id,
# job key prefix, ttl, now, then field/value pairs. With a key
# already naming a job whose record exists, returns that job's id and writes nothing; otherwise
# (no key, a new key, or a key left pointing at a record that was never written or has expired)
# writes key, record and stream entry together and returns the new id.
_CREATE_LUA = """
if KEYS[1] ~= '' then
  local existing = redis.call('GET', KEYS[1])
  if existing and redis.call('EXISTS', ARGV[2] .. existing) == 1 then return existing end
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[3]))
end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
redis.call('XADD', KEYS[3], '*', 'job_id', ARGV[1])
redis.call('ZADD', KEYS[4], tonumber(ARGV[4]), ARGV[1])
return ARGV[1]
"""

# KEYS[1] = job hash, KEYS[2] = the live-job set. ARGV: new status, now, ttl, expected current
# statuses (",a,b," or ""), job id, then field/value pairs. Returns 1 if applied, 0 if the job is
# terminal, missing or not in an expected status. A terminal job leaves the live set. A job with an
# ``slo_deadline`` gets ``slo_met`` when it ends (1: done by then; 0: later, failed or expired; a
# cancelled job gets none: users' cancellations are not the service's misses), in the same step.
_TRANSITION_LUA = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return 0 end
if cur == 'done' or cur == 'failed' or cur == 'cancelled' or cur == 'expired' then return 0 end
if ARGV[4] ~= '' and not string.find(ARGV[4], ',' .. cur .. ',', 1, true) then return 0 end
local new = ARGV[1]
redis.call('HSET', KEYS[1], 'status', new, 'ts_' .. new, ARGV[2])
for i = 6, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
if new == 'done' or new == 'failed' or new == 'cancelled' or new == 'expired' then
  local slo = redis.call('HGET', KEYS[1], 'slo_deadline')
  if slo and slo ~= '' and new ~= 'cancelled' then
    local met = '0'
    if new == 'done' and tonumber(ARGV[2]) <= tonumber(slo) then met = '1' end
    redis.call('HSET', KEYS[1], 'slo_met', met)
  end
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
  redis.call('ZREM', KEYS[2], ARGV[5])
  if new ~= 'done' then
    for i = 3, #KEYS do
      redis.call('DEL', KEYS[i])
    end
  end
end
return 1
"""


@dataclass
class JobParams:
    """What the user asked for. Validated server-side (see ``validate``)."""

    prompt: str = ""
    negative_prompt: str = ""
    steps: int = 20
    guidance: float = 7.5
    strength: float = 1.0
    seed: int = 0
    priority: int = 0
    deadline: float | None = None  # absolute epoch seconds
    template_id: str = ""  # stored template; empty = uploaded image blob
    width: int | None = None
    height: int | None = None
    kind: str = "edit"  # edit | warm (a template warm-up that records activations)
    # Paste the template back outside the mask after decoding (diffusers' ``apply_overlay``): the
    # VAE round trip and the model never touch unmasked pixels. Off = the stock pipeline's output.
    keep_unmasked: bool = False
    # exact | balanced | fast (``app/fidelity.py``); "" = the service's STENCIL_FIDELITY.
    fidelity: str = ""
    # LoRA adapters and their scales, ``((id, scale), ...)`` (``app/adapters.py``), and when they are
    # applied: exact (from the first step) or late (once loaded, within a fraction of the steps);
    # "" = exact.
    loras: AdapterSet = ()
    lora_patch: str = ""
    # ControlNets: ``((controlnet id, conditioning scale, start, end), ...)`` (``app/controls.py``);
    # the images are the job's ``control<i>`` blobs.
    controls: tuple[Control, ...] = ()

    def to_fields(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name in PARAM_FIELDS:
            value = getattr(self, name)
            out[name] = "" if value is None else str(value)
        out["loras"] = dump_adapter_set(tuple(self.loras))
        out["controls"] = dump_controls(tuple(self.controls))
        return out

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> "JobParams":
        def opt_int(v: str | None) -> int | None:
            return int(v) if v not in (None, "") else None

        deadline = fields.get("deadline") or ""
        return cls(
            prompt=fields.get("prompt", ""),
            negative_prompt=fields.get("negative_prompt", ""),
            steps=int(fields.get("steps") or 0),
            guidance=float(fields.get("guidance") or 0.0),
            strength=float(fields.get("strength") or 0.0),
            seed=int(fields.get("seed") or 0),
            priority=int(fields.get("priority") or 0),
            deadline=float(deadline) if deadline else None,
            template_id=fields.get("template_id", ""),
            width=opt_int(fields.get("width")),
            height=opt_int(fields.get("height")),
            kind=fields.get("kind") or "edit",
            keep_unmasked=(fields.get("keep_unmasked") or "").lower() in ("1", "true", "yes"),
            fidelity=fields.get("fidelity") or "",
            loras=load_adapter_set(fields.get("loras") or ""),
            lora_patch=fields.get("lora_patch") or "",
            controls=load_controls(fields.get("controls") or ""),
        )

    def validate(self, max_steps: int, max_loras: int = DEFAULT_MAX_LORAS,
                 max_controls: int = DEFAULT_MAX_CONTROLS) -> str | None:
        """The reason the parameters are unusable, or None."""
        try:
            self.check(max_steps, max_loras, max_controls)
        except ValueError as exc:
            return str(exc)
        return None

    def check(self, max_steps: int, max_loras: int = DEFAULT_MAX_LORAS,
              max_controls: int = DEFAULT_MAX_CONTROLS) -> "JobParams":
        """These parameters typed and normalised (``app/validation.py``); raises
        ``InvalidParameter`` naming the first unusable one."""
        if self.kind not in ("edit", "warm"):
            raise InvalidParameter("kind", f"must be edit or warm, got {self.kind!r}")
        if self.kind == "warm" and not self.template_id:
            raise InvalidParameter("template", "a warm-up needs a stored template id")
        try:
            fidelity = check_policy(self.fidelity)
        except ValueError:
            raise InvalidParameter("fidelity", f"must be one of {', '.join(POLICIES)} (or empty)") from None
        if self.lora_patch not in ("", *LORA_PATCH_POLICIES):
            raise InvalidParameter("lora_patch", f"must be one of {', '.join(LORA_PATCH_POLICIES)} (or empty)")
        size = {}
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None:
                size[name] = integer(name, value, 8, 8192)
                if size[name] % 8:
                    raise InvalidParameter(name, f"must be a multiple of 8, got {value}")
        return dataclasses.replace(
            self,
            template_id=object_id("template", self.template_id) if self.template_id else "",
            steps=integer("steps", self.steps, 1, max_steps),
            strength=number("strength", self.strength, 0.0, 1.0, lo_open=True),
            guidance=number("guidance", self.guidance, 0.0, MAX_GUIDANCE),
            seed=integer("seed", self.seed, 0, MAX_SEED),
            priority=integer("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY),
            prompt=text("prompt", self.prompt), negative_prompt=text("negative_prompt", self.negative_prompt),
            deadline=None if self.deadline is None else number("deadline", self.deadline, 0.0, 1e11),
            keep_unmasked=bool(self.keep_unmasked), fidelity=fidelity,
            loras=adapter_set(self.loras, max_loras), controls=check_controls(self.controls, max_controls), **size)


@dataclass
class JobRecord:
    """A decoded view of the job hash."""

    id: str
    status: JobStatus
    params: JobParams
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def progress(self) -> tuple[int, int]:
        return int(self.fields.get("progress_step") or 0), int(self.fields.get("progress_total") or 0)

    @property
    def error(self) -> str | None:
        return self.fields.get("error") or None

    @property
    def result_key(self) -> str | None:
        return self.fields.get("result_key") or None

    @property
    def worker(self) -> str | None:
        return self.fields.get("worker") or None

    def ts(self, status: JobStatus | str) -> float | None:
        value = self.fields.get(f"ts_{JobStatus(status).value}")
        return float(value) if value else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.fields)
        out["id"] = self.id
        return out


def new_job_id() -> str:
    return uuid.uuid4().hex


# A template's own warm-up (triggered by its first edit without a cache) runs with this prompt and
# seed; an edit's cache is keyed by them (workers/cpu_tasks.py).
WARM_PROMPT = ""
WARM_SEED = 0
# The Redis stream new jobs are announced on, and the consumer group of the dispatchers reading it.
INTAKE_STREAM = "stencil:jobs"
INTAKE_GROUP = "dispatchers"


class JobStore:
    """Create, read and transition job records."""

    def __init__(self, client: redis.Redis, *, ttl_seconds: int, intake_stream: str = INTAKE_STREAM) -> None:
        self.r = client
        self.ttl = ttl_seconds
        self.intake_stream = intake_stream
        self._transition = self.r.register_script(_TRANSITION_LUA)
        self._create = self.r.register_script(_CREATE_LUA)

    @staticmethod
    def key(job_id: str) -> str:
        return JOB_PREFIX + job_id

    def create(self, params: JobParams, *, idempotency_key: str | None = None,
               extra: dict[str, str] | None = None, job_id: str | None = None) -> tuple[str, bool]:
        """Create a queued job and announce it on the intake stream.

        Returns ``(job_id, created)``; with an idempotency key already used, the earlier job's id
        and ``False``. The record is written before the stream entry, so the dispatcher always
        finds it.
        """
        job_id = job_id or new_job_id()
        now = time.time()
        mapping = params.to_fields()
        mapping.update(extra or {})
        mapping.update({
            "id": job_id,
            "status": JobStatus.QUEUED.value,
            "ts_queued": repr(now),
            "idempotency_key": idempotency_key or "",
            "progress_step": "0",
            "progress_total": str(params.steps),
        })
        idem = IDEMPOTENCY_PREFIX + idempotency_key if idempotency_key else ""
        args: list[str] = [job_id, JOB_PREFIX, str(self.ttl), repr(now)]
        for name, value in mapping.items():
            args += [name, value]
        got = self._create(keys=[idem, self.key(job_id), self.intake_stream, LIVE_KEY], args=args)
        got = got.decode() if isinstance(got, bytes) else str(got)
        return got, got == job_id

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.r.hgetall(self.key(job_id))
        if not raw:
            return None
        fields = {_s(k): _s(v) for k, v in raw.items()}
        return JobRecord(id=job_id, status=JobStatus(fields["status"]),
                         params=JobParams.from_fields(fields), fields=fields)

    def status(self, job_id: str) -> JobStatus | None:
        value = self.r.hget(self.key(job_id), "status")
        return JobStatus(_s(value)) if value is not None else None

    def statuses(self, job_ids: list[str]) -> dict[str, JobStatus | None]:
        """Many statuses in one round trip (the engine checks its batch every step)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.key(job_id), "status")
        return {j: (JobStatus(_s(v)) if v is not None else None)
                for j, v in zip(job_ids, pipe.execute())}

    def transition(self, job_id: str, status: JobStatus, *, expect: tuple[JobStatus, ...] = (),
                   **fields: object) -> bool:
        """Move a non-terminal job to ``status`` (stamping ``ts_<status>``).

        With ``expect``, only from one of those statuses (so a late writer cannot move a job
        backwards). Returns False when nothing changed.
        """
        expected = "," + ",".join(s.value for s in expect) + "," if expect else ""
        argv: list[str] = [status.value, repr(time.time()), str(self.ttl), expected, job_id]
        for name, value in fields.items():
            argv += [name, "" if value is None else str(value)]
        # Uploads of a job that ends without a result are dropped in the same script as the status
        # change (nobody will read them again; whoever sees the status never sees them kept).
        drops = self._payload_keys(job_id) if status in (JobStatus.FAILED, JobStatus.CANCELLED,
                                                         JobStatus.EXPIRED) else []
        applied = bool(self._transition(keys=[self.key(job_id), LIVE_KEY, *drops], args=argv))
        if applied and status.terminal:
            from app import metrics

            metrics.observe_job_end(self.r.hgetall(self.key(job_id)))
            if status == JobStatus.FAILED:
                metrics.observe_failure(str(fields.get("error") or ""))
        return applied

    def fail(self, job_id: str, reason: str) -> bool:
        """Fail a job with a reason a user may read (``clean_reason``: no paths, no object reprs)."""
        return self.transition(job_id, JobStatus.FAILED, error=clean_reason(reason))

    def _payload_keys(self, job_id: str) -> list[str]:
        """The job's uploads (written at submission, before any status change that drops them)."""
        return [k.decode() if isinstance(k, bytes) else k
                for k in self.r.scan_iter(match=f"{BLOB_PREFIX}{job_id}:*", count=100)]

    def update(self, job_id: str, **fields: object) -> None:
        """Write informational fields (no status change)."""
        self.r.hset(self.key(job_id), mapping={k: "" if v is None else str(v) for k, v in fields.items()})

    def set_progress_many(self, progress: dict[str, tuple[int, int]]) -> None:
        pipe = self.r.pipeline(transaction=False)
        now = repr(time.time())
        for job_id, (step, total) in progress.items():
            pipe.hset(self.key(job_id), mapping={"progress_step": step, "progress_total": total, "ts_progress": now})
        pipe.execute()

    def cancel(self, job_id: str) -> bool:
        """Request cancellation; a queued job stops at once, a denoising one at its next step."""
        return self.transition(job_id, JobStatus.CANCELLED, error="cancelled by user")


_OBJECT_REPR = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")
_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*")
MAX_REASON_CHARS = 300


def clean_reason(reason: str) -> str:
    """A failure reason fit for users: object reprs and absolute paths (server internals)
    replaced, length bounded. Workers log the full error; the record gets this."""
    out = _OBJECT_REPR.sub("<object>", reason)
    out = _ABS_PATH.sub("<path>", out)
    return out if len(out) <= MAX_REASON_CHARS else out[:MAX_REASON_CHARS - 3] + "..."


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
