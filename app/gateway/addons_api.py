"""LoRA adapters and ControlNets of a tenant: registered with the ``admin`` scope (a CPU worker
checks each against the service's model, as ``stencil lora add`` does), listed with ``read``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, UploadFile

from app.adapters import LORA_PREFIX
from app.controls import CONTROL_FILES, CONTROLNET_PREFIX
from app.gateway.deps import Admin, GatewayDep, Reader
from app.gateway.forms import MultipartRoute
from app.gateway.jobs_api import ERRORS
from app.gateway.state import Gateway
from app.gateway.tenants import public, scoped
from app.gateway.uploads import read_part
from app.validation import object_id

router = APIRouter(prefix="/v1", tags=["add-ons"], responses=ERRORS)
uploads = APIRouter(prefix="/v1", tags=["add-ons"], responses=ERRORS, route_class=MultipartRoute)


def _public_meta(tenant: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "id": public(tenant, str(meta.get("id", "")))}


def _listed(gw: Gateway, tenant: str, prefix: str) -> list[dict[str, Any]]:
    keys = [k for k in gw.client.store.list(f"{prefix}{tenant}.") if k.endswith("/meta.json")]
    return [_public_meta(tenant, json.loads(gw.client.store.get(k))) for k in sorted(keys)]


@uploads.post("/loras", status_code=201, summary="Register a LoRA adapter (safetensors)")
def add_lora(caller: Admin, gw: GatewayDep,
             adapter: Annotated[UploadFile, File(description="any format diffusers' load_lora_weights reads")],
             id: Annotated[str, Form(description="the id your jobs name it by")]) -> dict[str, Any]:
    data = read_part(adapter, "adapter", gw.settings.max_lora_bytes, "STENCIL_MAX_LORA_BYTES")
    meta = gw.client.add_lora(data, scoped(caller.tenant, object_id("id", id)))
    return _public_meta(caller.tenant, meta)


@router.get("/loras", summary="Your LoRA adapters")
def list_loras(caller: Reader, gw: GatewayDep) -> list[dict[str, Any]]:
    return _listed(gw, caller.tenant, LORA_PREFIX)


@uploads.post("/controlnets", status_code=201, summary="Register a ControlNet (a diffusers ControlNetModel)")
def add_controlnet(caller: Admin, gw: GatewayDep,
                   config: Annotated[UploadFile, File(description="config.json")],
                   weights: Annotated[UploadFile, File(description="diffusion_pytorch_model.safetensors")],
                   id: Annotated[str, Form(description="the id your jobs name it by")]) -> dict[str, Any]:
    controlnet_id = scoped(caller.tenant, object_id("id", id))
    limit = gw.settings.max_controlnet_bytes
    with tempfile.TemporaryDirectory(prefix="stencil-controlnet-") as tmp:
        for name, part, upload in zip(CONTROL_FILES, ("config", "weights"), (config, weights)):
            (Path(tmp) / name).write_bytes(read_part(upload, part, limit, "STENCIL_MAX_CONTROLNET_BYTES"))
        meta = gw.client.add_controlnet(Path(tmp), controlnet_id)
    return _public_meta(caller.tenant, meta)


@router.get("/controlnets", summary="Your ControlNets")
def list_controlnets(caller: Reader, gw: GatewayDep) -> list[dict[str, Any]]:
    return _listed(gw, caller.tenant, CONTROLNET_PREFIX)
