"""Catalog routes: submit a manifest with its files, follow it (JSON or server-sent events)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, File, Query, Response, UploadFile
from fastapi.responses import StreamingResponse

from app.gateway import catalogs
from app.gateway.deps import Caller, GatewayDep, Reader, Submitter
from app.gateway.errors import not_found
from app.gateway.forms import MultipartRoute
from app.gateway.jobs_api import ERRORS, event_stream, follow
from app.gateway.state import Gateway
from app.gateway.tenants import owns

router = APIRouter(prefix="/v1", tags=["catalogs"], responses=ERRORS)
uploads = APIRouter(prefix="/v1", tags=["catalogs"], responses=ERRORS, route_class=MultipartRoute)

MANIFEST_HELP = ("JSONL (or CSV) rows: id, template (an uploaded file's name or a stored template id), mask (an "
                 "uploaded file's name), prompt, negative_prompt, steps, guidance, strength, seed, priority, fidelity, "
                 "loras, controls")


def _owned(gw: Gateway, caller: Caller, catalog_id: str) -> None:
    if not owns(caller.tenant, catalog_id) or catalogs.tenant_of(gw, catalog_id) != caller.tenant:
        raise not_found(f"catalog {catalog_id[:80]!r}")


@uploads.post("/catalogs", status_code=201, summary="Submit a catalog (a manifest and its files)")
def submit_catalog(response: Response, caller: Submitter, gw: GatewayDep,
                   manifest: Annotated[UploadFile, File(description=MANIFEST_HELP)],
                   files: Annotated[list[UploadFile], File(description="the templates and masks the rows name")] = []
                   ) -> dict[str, Any]:
    """Every row is checked before anything is stored (a bad row refuses the catalog, naming it); the
    rows are then submitted as your quota allows, each once."""
    catalog_id = catalogs.create(gw, caller.tenant, catalogs.prepare(gw, caller.tenant, manifest, files))
    catalogs.feed(gw, catalog_id)
    response.headers["Location"] = f"/v1/catalogs/{catalog_id}"
    return catalogs.summary(gw, catalog_id) or {}


@router.get("/catalogs/{catalog_id}", summary="A catalog's progress (with items=true: every row's job)")
def get_catalog(catalog_id: str, caller: Reader, gw: GatewayDep,
                items: Annotated[bool, Query()] = False) -> dict[str, Any]:
    _owned(gw, caller, catalog_id)
    out = catalogs.summary(gw, catalog_id, items=items)
    if out is None:
        raise not_found(f"catalog {catalog_id!r}")
    return out


@router.get("/catalogs/{catalog_id}/events", summary="Follow a catalog (server-sent events)",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`update` events (data: GET /v1/catalogs/{id}) until it is complete"}})
async def catalog_events(catalog_id: str, caller: Reader, gw: GatewayDep) -> StreamingResponse:
    await asyncio.to_thread(_owned, gw, caller, catalog_id)

    async def read() -> tuple[Any, bool]:
        out = await asyncio.to_thread(catalogs.summary, gw, catalog_id)
        return out, bool(out and out["complete"])

    return event_stream(follow(gw, caller, read))
