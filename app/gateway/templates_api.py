"""Templates: upload once (content-addressed without an id), list, read back, warm."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Response, UploadFile
from pydantic import BaseModel

from app.client_base import content_id
from app.gateway import intake
from app.gateway.deps import GatewayDep, Reader, Submitter
from app.gateway.errors import not_found
from app.gateway.forms import FormDep, MultipartRoute
from app.gateway.jobs_api import ERRORS, submitted
from app.gateway.tenants import public, scoped
from app.gateway.uploads import read_image
from app.gateway.views import JobView
from app.keys import TEMPLATE_PREFIX, template_key
from app.storage.base import ObjectNotFound
from app.validation import InvalidParameter, object_id

router = APIRouter(prefix="/v1", tags=["templates"], responses=ERRORS)
uploads = APIRouter(prefix="/v1", tags=["templates"], responses=ERRORS, route_class=MultipartRoute)

MEDIA_TYPES = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"RIFF", "image/webp"))


class TemplateRef(BaseModel):
    id: str
    created: bool


class TemplateList(BaseModel):
    templates: list[str]


@uploads.post("/templates", status_code=201, response_model=TemplateRef, summary="Store a template",
              responses={200: {"description": "these bytes were stored already (content-addressed id)",
                               "model": TemplateRef}})
def add_template(response: Response, caller: Submitter, gw: GatewayDep,
                 image: Annotated[UploadFile, File(description="PNG, JPEG or WebP")],
                 id: Annotated[str, Form(description="an id of your own; none = content-addressed")] = ""
                 ) -> dict[str, Any]:
    data = read_image(image, "image", gw.settings)
    if id:
        stored = gw.client.add_template(data, scoped(caller.tenant, object_id("id", id)))
        created = True
    else:
        stored = scoped(caller.tenant, content_id(data, TEMPLATE_PREFIX))
        created = not gw.client.store.exists(template_key(stored))
        gw.client.store_once(stored, data)
    response.status_code = 201 if created else 200
    return {"id": public(caller.tenant, stored), "created": created}


@router.get("/templates", response_model=TemplateList, summary="Your templates")
def list_templates(caller: Reader, gw: GatewayDep) -> dict[str, Any]:
    keys = gw.client.store.list(template_key(scoped(caller.tenant, "")).removesuffix("/image"))
    ids = sorted({k.split("/")[1] for k in keys if k.endswith("/image")})
    return {"templates": [public(caller.tenant, i) for i in ids]}


def stored_template(caller: Any, template_id: str) -> str:
    """The stored id of the caller's template id, or 404 (a malformed id names nothing)."""
    try:
        return scoped(caller.tenant, object_id("template id", template_id))
    except InvalidParameter:
        raise not_found(f"template {template_id[:80]!r}") from None


@router.get("/templates/{template_id}/image", summary="A template's image",
            responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}}})
def template_image(template_id: str, caller: Reader, gw: GatewayDep) -> Response:
    try:
        data = gw.client.store.get(template_key(stored_template(caller, template_id)))
    except ObjectNotFound:
        raise not_found(f"template {template_id!r}") from None
    media = next((m for magic, m in MEDIA_TYPES if data.startswith(magic)), "application/octet-stream")
    return Response(data, media_type=media, headers={"Cache-Control": "private, max-age=3600"})


@uploads.post("/templates/{template_id}/warm", status_code=201, response_model=JobView,
              summary="Warm a template (a job): later edits compute only their masked tokens")
def warm_template(template_id: str, response: Response, caller: Submitter, gw: GatewayDep,
                  form: FormDep,
                  mask: Annotated[UploadFile | None, File(description="a region warm-up: edits with this mask, "
                                                                      "prompt, negative prompt, seed are exact")] = None
                  ) -> dict[str, Any]:
    stored = stored_template(caller, template_id)
    intake.require_template(gw, stored, template_id)
    params = form.params(caller.tenant, gw.settings, kind="warm", template_id=template_id)
    blobs = form.control_blobs(gw.settings)
    if mask is not None:
        blobs["mask"] = read_image(mask, "mask", gw.settings)
    return submitted(gw, caller, response, *intake.submit(gw, caller.tenant, caller.limits.max_jobs, params, blobs))
