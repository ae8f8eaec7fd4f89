"""Catalogs over HTTP: a manifest and its files in one upload, fed into the tenant's quota.

A catalog is checked whole before anything is stored (``prepare``: every row's parameters, images
and templates; a bad row refuses the catalog with the row's reason). Its rows then wait in Redis
(``stencil:catalog:<id>``: the record, the rows, their masks and control images, their job ids) and
the gateway's feeder submits them as the tenant's quota allows, each row with an idempotency key of
its own, so a feeder that dies between submitting a row and advancing past it submits nothing twice
(and two gateways feeding the same catalog agree). A catalog's keys expire with the job TTL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import UploadFile
from redis.exceptions import LockError

from app.catalog import Manifest
from app.client_base import content_id
from app.controls import control_blob
from app.gateway import intake
from app.gateway.errors import ApiProblem
from app.gateway.state import Gateway
from app.gateway.tenants import new_owned_id, scoped
from app.gateway.uploads import check_image, read_part
from app.jobs import JOB_PREFIX, JobParams
from app.keys import TEMPLATE_PREFIX, template_key

log = logging.getLogger(__name__)

CATALOG_PREFIX = "stencil:catalog:"
ACTIVE_KEY = "stencil:catalogs:active"
FEED_LOCK_PREFIX = "stencil:catalogs:feeding:"
MAX_ROWS = 100_000
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TERMINAL = ("done", "failed", "cancelled", "expired")

# KEYS[1] = the catalog record. ARGV[1] = the row just submitted: move past it unless another feeder did.
_ADVANCE_LUA = """
if redis.call('HGET', KEYS[1], 'next') == ARGV[1] then return redis.call('HINCRBY', KEYS[1], 'next', 1) end
return -1
"""


def keys(catalog_id: str) -> dict[str, str]:
    base = CATALOG_PREFIX + catalog_id
    return {"meta": base, "rows": base + ":rows", "blobs": base + ":blobs", "jobs": base + ":jobs"}


@dataclass
class PreparedRow:
    row_id: str
    params: JobParams
    blobs: dict[str, bytes]


@dataclass
class Prepared:
    rows: list[PreparedRow] = field(default_factory=list)
    templates: dict[str, bytes] = field(default_factory=dict)  # stored id -> bytes to store


def _inside(path: Path, root: Path, what: str, row: str) -> Path:
    if not path.resolve().is_relative_to(root.resolve()):
        raise ApiProblem(422, f"row {row}: {what} must name an uploaded file or a stored template",
                         parameter="manifest")
    return path


def prepare(gw: Gateway, tenant: str, manifest: UploadFile, files: list[UploadFile]) -> Prepared:
    """Every row checked and turned into job parameters and uploads; nothing stored yet."""
    settings = gw.settings
    out = Prepared()
    with tempfile.TemporaryDirectory(prefix="stencil-catalog-") as tmp:
        root = Path(tmp)
        for upload in files:
            name = upload.filename or ""
            if not _FILE_NAME.fullmatch(name) or name.startswith("manifest."):
                raise ApiProblem(422, f"file name {name[:60]!r}: letters, digits, '.', '_', '-' only",
                                 parameter="files")
            (root / name).write_bytes(read_part(upload, name, settings.max_upload_bytes, "STENCIL_MAX_UPLOAD_BYTES"))
        suffix = ".csv" if (manifest.filename or "").lower().endswith((".csv", ".tsv")) else ".jsonl"
        path = root / f"manifest{suffix}"
        path.write_bytes(read_part(manifest, "manifest", settings.api_max_body_bytes, "STENCIL_API_MAX_BODY_BYTES"))
        for row in Manifest(path).rows():
            where = f"{row.index} ({row.row_id})"
            if row.error:
                raise ApiProblem(422, f"row {where}: {row.error}", parameter="manifest")
            if len(out.rows) >= MAX_ROWS:
                raise ApiProblem(413, f"a catalog has at most {MAX_ROWS} rows", parameter="manifest")
            out.rows.append(_prepare_row(gw, tenant, root, row, where, out.templates))
    if not out.rows:
        raise ApiProblem(422, "the manifest has no rows", parameter="manifest")
    return out


def _prepare_row(gw: Gateway, tenant: str, root: Path, row: Any, where: str,
                 templates: dict[str, bytes]) -> PreparedRow:
    settings = gw.settings
    if row.template_is_path:
        data = check_image(_inside(Path(row.template), root, "template", where).read_bytes(), f"row {where} template",
                           settings)
        template_id = scoped(tenant, content_id(data, TEMPLATE_PREFIX))
        templates[template_id] = data
    else:
        template_id = scoped(tenant, row.template)
        if template_id not in templates and not gw.client.store.exists(template_key(template_id)):
            raise ApiProblem(422, f"row {where}: template {row.template!r} not found", parameter="manifest")
    mask = _inside(row.mask, root, "mask", where).read_bytes()
    blobs = {"mask": check_image(mask, f"row {where} mask", settings)}
    params = dict(row.params)
    controls = []
    for i, (cid, image, *rest) in enumerate(params.pop("controls", [])):
        data = _inside(Path(image), root, "control image", where).read_bytes()
        blobs[control_blob(i)] = check_image(data, f"row {where} control image", settings)
        controls.append((scoped(tenant, cid), *rest))
    loras = tuple((scoped(tenant, i), s) for i, s in params.pop("loras", ()))
    try:
        checked = JobParams(**params, template_id=template_id, loras=loras, controls=tuple(controls)).check(
            settings.max_steps)
    except ValueError as exc:
        raise ApiProblem(422, f"row {where}: {exc}", parameter="manifest") from None
    return PreparedRow(row.row_id, checked, blobs)


def create(gw: Gateway, tenant: str, prepared: Prepared) -> str:
    """Store a prepared catalog and hand it to the feeder; returns its id."""
    catalog_id = new_owned_id(tenant)
    k = keys(catalog_id)
    for template_id, data in prepared.templates.items():
        gw.client.store_once(template_id, data)
    ttl = gw.settings.job_ttl_seconds
    pipe = gw.redis.pipeline()
    pipe.hset(k["meta"], mapping={"tenant": tenant, "rows": len(prepared.rows), "next": 0,
                                  "created": repr(time.time())})
    for i, row in enumerate(prepared.rows):
        spec = {"row": row.row_id, "params": row.params.to_fields(), "blobs": list(row.blobs)}
        pipe.rpush(k["rows"], json.dumps(spec))
        for name, data in row.blobs.items():
            pipe.hset(k["blobs"], f"{i}:{name}", data)
    for key in k.values():
        pipe.expire(key, ttl)
    pipe.sadd(ACTIVE_KEY, catalog_id)
    pipe.execute()
    return catalog_id


def feed(gw: Gateway, catalog_id: str) -> int:
    """Submit the catalog's next rows while its tenant's quota allows; returns how many. One feeder
    per catalog at a time (the request that created it, every gateway's background loop): a lock in
    Redis, so that what a request reports after its feed includes what another feeder submitted
    meanwhile, and two feeders never take each other's quota for the same row."""
    lock = gw.redis.lock(FEED_LOCK_PREFIX + catalog_id, timeout=120, blocking_timeout=10)
    if not lock.acquire():
        return 0  # another feeder is at it; the background loop comes back
    try:
        return _feed(gw, catalog_id)
    finally:
        with contextlib.suppress(LockError):  # held past its timeout: another feeder may have it now
            lock.release()


def _feed(gw: Gateway, catalog_id: str) -> int:
    k = keys(catalog_id)
    meta = {a.decode(): b.decode() for a, b in gw.redis.hgetall(k["meta"]).items()}
    if not meta:
        gw.redis.srem(ACTIVE_KEY, catalog_id)
        return 0
    tenant, rows = meta["tenant"], int(meta["rows"])
    limits = gw.tenants.limits(tenant)
    advance = gw.redis.register_script(_ADVANCE_LUA)
    submitted = 0
    while True:
        index = int(gw.redis.hget(k["meta"], "next") or 0)
        if index >= rows:
            gw.redis.srem(ACTIVE_KEY, catalog_id)
            return submitted
        spec = json.loads(gw.redis.lindex(k["rows"], index))
        blobs = {name: gw.redis.hget(k["blobs"], f"{index}:{name}") or b"" for name in spec["blobs"]}
        try:
            job_id, _, _ = intake.submit(gw, tenant, limits.max_jobs, JobParams.from_fields(spec["params"]), blobs,
                                         idempotency=f"{tenant}:catalog:{catalog_id}:{index}")
        except ApiProblem:  # the quota is full: the next round goes on
            return submitted
        gw.redis.hset(k["jobs"], str(index), job_id)
        if int(advance(keys=[k["meta"]], args=[index])) >= 0:
            gw.redis.hdel(k["blobs"], *[f"{index}:{name}" for name in spec["blobs"]])
            submitted += 1


def summary(gw: Gateway, catalog_id: str, items: bool = False) -> dict[str, Any] | None:
    """Counts per status (``pending``: not yet submitted), and with ``items`` every row's job."""
    k = keys(catalog_id)
    meta = {a.decode(): b.decode() for a, b in gw.redis.hgetall(k["meta"]).items()}
    if not meta:
        return None
    jobs = {int(a): b.decode() for a, b in gw.redis.hgetall(k["jobs"]).items()}
    order = sorted(jobs)
    pipe = gw.redis.pipeline(transaction=False)
    for index in order:
        pipe.hget(JOB_PREFIX + jobs[index], "status")
    statuses = {i: (s.decode() if s else "lost") for i, s in zip(order, pipe.execute())}
    rows = int(meta["rows"])
    counts = Counter(statuses.values())
    counts["pending"] = rows - len(jobs)
    ended = sum(counts[s] for s in (*TERMINAL, "lost"))
    out: dict[str, Any] = {"id": catalog_id, "rows": rows, "submitted": len(jobs),
                           "status": {s: n for s, n in sorted(counts.items()) if n},
                           "complete": ended == rows, "created": float(meta["created"])}
    if items:
        names = [json.loads(r)["row"] for r in gw.redis.lrange(k["rows"], 0, -1)]
        out["items"] = [{"index": i, "row": names[i] if i < len(names) else str(i), "job_id": jobs.get(i),
                         "status": statuses.get(i, "pending")} for i in range(rows)]
    return out


def tenant_of(gw: Gateway, catalog_id: str) -> str | None:
    value = gw.redis.hget(keys(catalog_id)["meta"], "tenant")
    return value.decode() if value is not None else None


def active(gw: Gateway) -> list[str]:
    return sorted(k.decode() for k in gw.redis.smembers(ACTIVE_KEY))


__all__ = ["ACTIVE_KEY", "active", "create", "feed", "prepare", "summary", "tenant_of"]
