"""Edits and jobs: submit, list, read, follow (server-sent events), fetch the result, cancel.

A job id outside the caller's namespace, malformed or expired is the same 404: a tenant cannot
tell another tenant's job from one that does not exist.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Header, Query, Request, Response, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.gateway import intake
from app.gateway.deps import Caller, GatewayDep, Reader, Submitter
from app.gateway.errors import ApiProblem, ErrorResponse, not_found
from app.gateway.forms import FormDep, MultipartRoute
from app.gateway.state import Gateway
from app.gateway.tenants import owns
from app.gateway.uploads import read_image
from app.gateway.views import JobView, decode, job_view
from app.jobs import JOB_PREFIX, TERMINAL
from app.storage.base import ObjectNotFound

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 408, 411, 413, 415, 422, 429)}
EVENT_POLL_S = 0.2
EVENT_HEARTBEAT_S = 15.0
EVENT_KEY_CHECK_S = 1.0

router = APIRouter(prefix="/v1", tags=["jobs"], responses=ERRORS)
uploads = APIRouter(prefix="/v1", tags=["jobs"], responses=ERRORS, route_class=MultipartRoute)


class JobList(BaseModel):
    jobs: list[JobView]
    next_before: float | None = None


class Cancelled(BaseModel):
    cancelled: bool
    job: JobView


def job_key(caller: Caller, job_id: str) -> str:
    """The record key of a job id in the caller's namespace, or 404 (malformed, another tenant's)."""
    if not owns(caller.tenant, job_id):
        raise not_found(f"job {job_id[:80]!r}")
    return JOB_PREFIX + job_id


def owned(caller: Caller, job_id: str, fields: dict[str, str]) -> dict[str, str]:
    """The record if it exists and is the caller's, else 404."""
    if not fields or fields.get("tenant") != caller.tenant:
        raise not_found(f"job {job_id!r}")
    return fields


def read_job(gw: Gateway, caller: Caller, job_id: str) -> dict[str, str]:
    """The caller's job's record, or 404."""
    return owned(caller, job_id, decode(gw.redis.hgetall(job_key(caller, job_id))))


def submitted(gw: Gateway, caller: Caller, response: Response, job_id: str, created: bool,
              fields: dict[str, str] | None) -> dict[str, Any]:
    """The answer to a submission: 201 and the new job, or 200 and the job an Idempotency-Key named."""
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    return job_view(caller.tenant, job_id, fields or read_job(gw, caller, job_id))


@uploads.post("/edits", status_code=201, response_model=JobView, summary="Submit an edit",
              responses={200: {"description": "The job an Idempotency-Key already named", "model": JobView}})
def submit_edit(response: Response, caller: Submitter, gw: GatewayDep,
                mask: Annotated[UploadFile, File(description="the mask (white = edit), the template's size")],
                form: FormDep,
                template: Annotated[UploadFile | None, File(description="the template image (or template_id)")] = None,
                template_id: Annotated[str, Form(description="a stored template (or upload template)")] = "",
                deadline: Annotated[float | None, Form(description="absolute, epoch seconds")] = None,
                keep_unmasked: Annotated[bool, Form()] = False,
                fidelity: Annotated[str, Form(description="exact | balanced | fast; empty = the service's")] = "",
                lora_patch: Annotated[str, Form(description="exact | late; empty = the service's")] = "",
                webhook_url: Annotated[str, Form(description="POSTed (signed) when the job ends")] = "",
                idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> dict[str, Any]:
    """Upload a template with its mask (or name a stored template) and queue the edit. Parameters are
    checked before anything is stored; an `Idempotency-Key` already used returns its job (200)."""
    if (template is None) == (not template_id):
        raise ApiProblem(422, "send exactly one of template (an image) or template_id", parameter="template")
    settings = gw.settings
    params = form.params(caller.tenant, settings, template_id=template_id, deadline=deadline,
                         keep_unmasked=keep_unmasked, fidelity=fidelity, lora_patch=lora_patch)
    idem = intake.idempotency_key(caller.tenant, idempotency_key)
    template_data = read_image(template, "template", settings) if template is not None else None
    if template_data is None:
        intake.require_template(gw, params.template_id, template_id)
    blobs = {"mask": read_image(mask, "mask", settings), **form.control_blobs(settings)}
    job_id, created, fields = intake.submit(gw, caller.tenant, caller.limits.max_jobs, params, blobs,
                                            template_data=template_data, idempotency=idem, webhook_url=webhook_url)
    return submitted(gw, caller, response, job_id, created, fields)


@router.get("/jobs", response_model=JobList, summary="List your jobs, newest first")
def list_jobs(caller: Reader, gw: GatewayDep,
              status: Annotated[str | None, Query(description="only jobs in this status")] = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 50,
              before: Annotated[float | None, Query(description="next_before of the previous page")] = None
              ) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    cursor, exhausted = before, False
    while len(out) < limit and not exhausted:
        page = gw.tenants.job_ids(caller.tenant, limit, cursor)
        exhausted = len(page) < limit
        pipe = gw.redis.pipeline(transaction=False)
        for job_id, _ in page:
            pipe.hgetall(JOB_PREFIX + job_id)
        for (job_id, score), raw in zip(page, pipe.execute()):
            cursor = score
            fields = decode(raw)
            if fields and status in (None, fields.get("status")):
                out.append(job_view(caller.tenant, job_id, fields))
                if len(out) == limit:
                    break
    return {"jobs": out, "next_before": cursor if len(out) == limit else None}


@router.get("/jobs/{job_id}", response_model=JobView, summary="A job: status, progress, record")
async def get_job(job_id: str, caller: Reader, gw: GatewayDep) -> dict[str, Any]:
    # A coroutine on the async connection: the most frequent request takes no thread-pool hop.
    fields = decode(await gw.aredis.hgetall(job_key(caller, job_id)))
    return job_view(caller.tenant, job_id, owned(caller, job_id, fields))


@router.get("/jobs/{job_id}/result", summary="The result image (PNG)",
            responses={200: {"content": {"image/png": {}}, "description": "the edited image"},
                       409: {"model": ErrorResponse, "description": "the job has not ended well (yet)"}})
def get_result(job_id: str, caller: Reader, gw: GatewayDep) -> Response:
    fields = read_job(gw, caller, job_id)
    status = fields.get("status")
    if status != "done" or not fields.get("result_key"):
        reason = f": {fields['error']}" if fields.get("error") else ""
        code = "not_done" if status not in ("failed", "cancelled", "expired") else f"job_{status}"
        raise ApiProblem(409, f"job {job_id} is {status}{reason}", code=code)
    try:
        data = gw.client.store.get(fields["result_key"])
    except ObjectNotFound:
        raise not_found(f"the result of job {job_id!r}") from None
    return Response(data, media_type="image/png", headers={"Cache-Control": "private, max-age=86400"})


@router.post("/jobs/{job_id}/cancel", response_model=Cancelled, summary="Cancel a queued or running job")
def cancel_job(job_id: str, caller: Submitter, gw: GatewayDep) -> dict[str, Any]:
    read_job(gw, caller, job_id)
    cancelled = gw.client.jobs.cancel(job_id)
    return {"cancelled": cancelled, "job": job_view(caller.tenant, job_id, read_job(gw, caller, job_id))}


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def follow(gw: Gateway, caller: Caller, read: Callable[[], Awaitable[tuple[Any, bool]]]) -> AsyncIterator[bytes]:
    """Server-sent events of ``read()`` (a view, None once gone; whether it is final): an ``update``
    whenever the view changes until it is final, a comment every 15 s, and an ``error`` event if the
    record vanishes or the caller's key is revoked meanwhile (checked every second)."""
    last: Any = None
    beat = checked = time.monotonic()
    while True:
        if time.monotonic() - checked >= EVENT_KEY_CHECK_S:
            if not await gw.key_active(caller.principal.key_id):
                yield sse("error", {"code": "unauthenticated", "message": "the API key was revoked"})
                return
            checked = time.monotonic()
        view, final = await read()
        if view is None:
            yield sse("error", {"code": "not_found", "message": "the record expired"})
            return
        if view != last:
            last = view
            beat = time.monotonic()
            yield sse("update", view)
        if final:
            return
        if time.monotonic() - beat > EVENT_HEARTBEAT_S:
            beat = time.monotonic()
            yield b": heartbeat\n\n"
        await asyncio.sleep(EVENT_POLL_S)


def event_stream(stream: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.get("/jobs/{job_id}/events", summary="Follow a job (server-sent events)",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`update` events (data: the job, as GET /v1/jobs/{id}) until it ends"}})
async def job_events(job_id: str, request: Request, caller: Reader, gw: GatewayDep) -> StreamingResponse:
    key = job_key(caller, job_id)
    if (await gw.aredis.hget(key, "tenant") or b"").decode() != caller.tenant:
        raise not_found(f"job {job_id!r}")
    terminal = {s.value for s in TERMINAL}

    async def read() -> tuple[Any, bool]:
        fields = decode(await gw.aredis.hgetall(key))
        return (job_view(caller.tenant, job_id, fields) if fields else None), fields.get("status") in terminal

    return event_stream(follow(gw, caller, read))
