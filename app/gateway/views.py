"""A job as its tenant sees it: the record with the tenant's own prefix taken off every id, and
nothing of the deployment's internals (the tenant field, Celery worker host names)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from app.gateway.tenants import public

HIDDEN_FIELDS = ("tenant", "prepare_worker", "finalize_worker")


class Progress(BaseModel):
    step: int
    total: int


class JobView(BaseModel):
    """A job: its status, progress, failure reason, and the whole record (``record``: every field the
    Python client's ``JobRecord.fields`` holds, ids without the tenant prefix)."""

    id: str
    kind: str = "edit"
    status: str
    progress: Progress
    error: str | None = None
    template_id: str = ""
    submitted_at: float | None = None
    result_url: str | None = Field(None, description="the result image, once done")
    record: dict[str, str] = Field(default_factory=dict)


def _ids_in_json(tenant: str, value: str) -> str:
    """Adapter and ControlNet lists (JSON ``[[id, ...], ...]``) with public ids."""
    if not value:
        return value
    items = json.loads(value)
    return json.dumps([[public(tenant, str(item[0])), *item[1:]] for item in items], separators=(",", ":"))


def public_record(tenant: str, fields: Mapping[str, str]) -> dict[str, str]:
    out = {k: v for k, v in fields.items() if k not in HIDDEN_FIELDS}
    if out.get("template_id"):
        out["template_id"] = public(tenant, out["template_id"])
    for name in ("loras", "controls"):
        if out.get(name):
            out[name] = _ids_in_json(tenant, out[name])
    if out.get("idempotency_key", "").startswith(f"{tenant}:"):
        out["idempotency_key"] = out["idempotency_key"][len(tenant) + 1:]
    return out


def job_view(tenant: str, job_id: str, fields: Mapping[str, str]) -> dict[str, Any]:
    record = public_record(tenant, fields)
    status = record.get("status", "queued")
    progress = {"step": int(record.get("progress_step") or 0), "total": int(record.get("progress_total") or 0)}
    return {"id": job_id, "kind": record.get("kind") or "edit", "status": status, "progress": progress,
            "error": record.get("error") or None, "template_id": record.get("template_id", ""),
            "submitted_at": float(record["ts_queued"]) if record.get("ts_queued") else None,
            "result_url": f"/v1/jobs/{job_id}/result" if status == "done" else None, "record": record}


def decode(raw: Mapping[Any, Any]) -> dict[str, str]:
    """A Redis hash as text."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}
