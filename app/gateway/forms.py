"""Multipart forms: the content type every upload route requires (415 otherwise) and the
generation parameters edits and warm-ups share, turned into checked, tenant-scoped ``JobParams``."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, File, Form, Request, Response, UploadFile
from fastapi.routing import APIRoute

from app.adapters import DEFAULT_MAX_LORAS, adapter_set
from app.controls import control_blob, control_spec
from app.gateway.errors import problem_response
from app.gateway.tenants import scoped
from app.gateway.uploads import read_image
from app.jobs import JobParams
from app.settings import Settings
from app.validation import InvalidParameter


class MultipartRoute(APIRoute):
    """A route whose body must be ``multipart/form-data``: anything else is a 415 before parsing."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            ctype = request.headers.get("content-type", "")
            if request.headers.get("content-length", "0") != "0" and \
                    not ctype.lower().startswith("multipart/form-data"):
                return problem_response(415, f"send multipart/form-data (got {ctype[:60] or 'no Content-Type'})")
            return await handler(request)

        return route


CONTROLS_HELP = ('ControlNets as JSON, one per control image in order: '
                 '`[{"id": "canny", "scale": 0.8, "start": 0, "end": 1}]`')


class GenerationForm:
    """Form fields of an edit and a warm-up (ids are the tenant's own: no prefix)."""

    def __init__(self, values: dict[str, Any], loras: str, controls: str, control_images: list[UploadFile]) -> None:
        self.values = values
        self.loras = loras
        self.controls = controls
        self.control_images = control_images

    def params(self, tenant: str, settings: Settings, **fields: Any) -> JobParams:
        """Checked ``JobParams`` with every id in the tenant's namespace (``fields``: the route's own)."""
        loras = tuple((scoped(tenant, i), s) for i, s in adapter_set(self.loras, DEFAULT_MAX_LORAS))
        controls = tuple((scoped(tenant, c[0]), *c[1:]) for c in self._controls())
        template_id = fields.pop("template_id", "")
        return JobParams(**self.values, **fields, loras=loras, controls=controls,
                         template_id=scoped(tenant, template_id) if template_id else "").check(
            settings.max_steps)

    def _controls(self) -> list[tuple[str, float, float, float]]:
        if not self.controls.strip():
            items: list[Any] = []
        else:
            try:
                items = json.loads(self.controls)
            except json.JSONDecodeError:
                raise InvalidParameter("controls", "is not valid JSON") from None
            if not isinstance(items, list):
                raise InvalidParameter("controls", "must be a JSON list")
        if len(items) != len(self.control_images):
            raise InvalidParameter("controls", f"names {len(items)} controls but {len(self.control_images)} "
                                               "control_images were sent")
        out = []
        for item in items:
            if not isinstance(item, dict):
                raise InvalidParameter("controls", 'each control is an object: {"id": ..., "scale": ...}')
            out.append(control_spec(dict(item, image=True))[0])
        return out

    def control_blobs(self, settings: Settings) -> dict[str, bytes]:
        return {control_blob(i): read_image(f, f"control_images[{i}]", settings)
                for i, f in enumerate(self.control_images)}


async def generation_form(
        prompt: Annotated[str, Form()] = "",
        negative_prompt: Annotated[str, Form()] = "",
        steps: Annotated[int, Form()] = 20,
        guidance: Annotated[float, Form()] = 7.5,
        strength: Annotated[float, Form()] = 1.0,
        seed: Annotated[int, Form()] = 0,
        priority: Annotated[int, Form()] = 0,
        width: Annotated[int | None, Form()] = None,
        height: Annotated[int | None, Form()] = None,
        loras: Annotated[str, Form(description="LoRA adapters and scales: `id:scale;id:scale`")] = "",
        controls: Annotated[str, Form(description=CONTROLS_HELP)] = "",
        control_images: Annotated[list[UploadFile], File(description="control images, in the order of "
                                                                      "`controls`")] = []) -> GenerationForm:
    """The dependency that reads a ``GenerationForm`` (a coroutine: see ``app/gateway/deps.py``)."""
    values = dict(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance, strength=strength,
                  seed=seed, priority=priority, width=width, height=height)
    return GenerationForm(values, loras, controls, control_images)


FormDep = Annotated[GenerationForm, Depends(generation_form)]
