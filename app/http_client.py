"""The Python client over the HTTP gateway: ``StencilClient(api_url=..., api_key=...)``.

Same methods and errors as over Redis (``app/client.py``): ``InvalidParameter`` naming the parameter
(the gateway's 422), ``InvalidAdapter``, ``JobFailed`` with the record, ``KeyError`` for a job that is
not there (or another tenant's), ``TimeoutError``. Only an API key is needed: no Redis, no object
store. ``wait`` follows the job's server-sent events (one request), and a 429 is retried after its
``Retry-After`` a few times before ``RateLimited`` is raised.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import requests

from app.adapters import AdapterSet
from app.client_base import (
    ClientBase,
    ImageLike,
    InvalidAdapter,
    JobFailed,
    JobHandle,
    controlnet_folder,
    image_bytes,
)
from app.jobs import JobParams, JobRecord, JobStatus
from app.settings import Settings
from app.validation import InvalidParameter

log = logging.getLogger(__name__)

class ApiError(RuntimeError):
    """A refusal the other errors do not cover (``status``, ``code``: the gateway's error code)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code


class AuthenticationError(ApiError):
    """401 (no valid key: missing, wrong or revoked) or 403 (the key lacks a scope)."""


class RateLimited(ApiError):
    """429 after the retries: the tenant's rate or job quota; ``retry_after`` in seconds."""

    def __init__(self, status: int, code: str, message: str, retry_after: float) -> None:
        super().__init__(status, code, message)
        self.retry_after = retry_after


def _loras_text(loras: AdapterSet | list[Any] | str) -> str:
    """``id:scale;id:scale`` (the form field) from any form ``submit`` takes."""
    if isinstance(loras, str):
        return loras
    parts = []
    for item in loras:
        lora_id, scale = (item, 1.0) if isinstance(item, str) else item
        parts.append(f"{lora_id}:{scale}")
    return ";".join(parts)


class HttpStencilClient(ClientBase):
    def __init__(self, settings: Settings | None = None, *, api_url: str | None = None, api_key: str | None = None,
                 max_retries: int = 3, timeout: float = 60.0) -> None:
        self.settings = settings or Settings.from_env()
        self.api_url = (api_url or self.settings.api_url).rstrip("/")
        key = api_key or self.settings.api_key
        if not self.api_url or not key:
            raise ValueError("the HTTP client needs api_url and api_key (or STENCIL_API_URL / STENCIL_API_KEY)")
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {key}"
        self.max_retries = max_retries
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"HttpStencilClient({self.api_url})"

    # -- transport ------------------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One call; 429 retried after Retry-After; refusals raised as the client's errors."""
        kwargs.setdefault("timeout", self.timeout)
        for attempt in range(self.max_retries + 1):
            resp = self.session.request(method, self.api_url + path, **kwargs)
            if resp.status_code != 429 or attempt == self.max_retries:
                break
            time.sleep(float(resp.headers.get("Retry-After") or 1))
        if resp.status_code >= 400:
            raise self._error(resp)
        return resp

    @staticmethod
    def _error(resp: requests.Response) -> Exception:
        try:
            body = resp.json()["error"]
            code, message, parameter = body["code"], body["message"], body.get("parameter")
        except (ValueError, KeyError, TypeError):
            code, message, parameter = "error", resp.text[:300], None
        if resp.status_code == 422 and code == "invalid_adapter":
            return InvalidAdapter(message)
        if resp.status_code == 422:
            name = parameter or "request"
            return InvalidParameter(name, message.removeprefix(f"{name}: "))
        if resp.status_code in (401, 403):
            return AuthenticationError(resp.status_code, code, message)
        if resp.status_code == 429:
            return RateLimited(resp.status_code, code, message, float(resp.headers.get("Retry-After") or 1))
        return ApiError(resp.status_code, code, message)

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, *, template: str | ImageLike, mask: ImageLike, prompt: str = "", negative_prompt: str = "",
               steps: int = 20, guidance: float = 7.5, strength: float = 1.0, seed: int = 0, priority: int = 0,
               deadline: float | None = None, idempotency_key: str | None = None, width: int | None = None,
               height: int | None = None, keep_unmasked: bool = False, fidelity: str = "",
               loras: AdapterSet | list[Any] | str = (), lora_patch: str = "", controls: Iterable[Any] = (),
               webhook_url: str = "") -> JobHandle:
        """As ``StencilClient.submit`` over Redis; ``webhook_url``: a signed POST when the job ends."""
        controls = list(controls)
        values = dict(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                      strength=strength, seed=seed, priority=priority, width=width, height=height)
        data = self._form(values, loras, controls)
        data.update(deadline=deadline, keep_unmasked=keep_unmasked, fidelity=fidelity, lora_patch=lora_patch,
                    webhook_url=webhook_url)
        files = self._control_files(controls)
        files.append(("mask", ("mask.png", image_bytes(mask, mask=True), "image/png")))
        if isinstance(template, str):
            data["template_id"] = template
        else:
            files.append(("template", ("template.png", image_bytes(template, mask=False), "image/png")))
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        resp = self.request("POST", "/v1/edits", files=multipart(data, files), headers=headers)
        return JobHandle(self, resp.json()["id"], created=resp.status_code == 201)

    def warm_template(self, template_id: str, *, steps: int = 20, guidance: float = 7.5, strength: float = 1.0,
                      prompt: str = "", seed: int = 0, mask: ImageLike | None = None, width: int | None = None,
                      height: int | None = None, priority: int = 0, negative_prompt: str = "",
                      loras: AdapterSet | list[Any] | str = (), controls: Iterable[Any] = ()) -> JobHandle:
        values = dict(prompt=prompt, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                      strength=strength, seed=seed, priority=priority, width=width, height=height)
        controls = list(controls)
        files = self._control_files(controls)
        if mask is not None:
            files.append(("mask", ("mask.png", image_bytes(mask, mask=True), "image/png")))
        resp = self.request("POST", f"/v1/templates/{template_id}/warm",
                            files=multipart(self._form(values, loras, controls), files))
        return JobHandle(self, resp.json()["id"])

    @staticmethod
    def _form(values: dict[str, Any], loras: AdapterSet | list[Any] | str, controls: Iterable[Any]) -> dict[str, Any]:
        from app.controls import control_spec

        specs = [control_spec(c)[0] for c in controls]
        return {**values, "loras": _loras_text(loras),
                "controls": json.dumps([{"id": c[0], "scale": c[1], "start": c[2], "end": c[3]} for c in specs])
                if specs else ""}

    @staticmethod
    def _control_files(controls: Iterable[Any]) -> list[tuple[str, Any]]:
        from app.controls import control_spec

        return [("control_images", (f"control{i}.png", image_bytes(control_spec(c)[1], mask=False), "image/png"))
                for i, c in enumerate(controls)]

    def _record(self, job_id: str) -> JobRecord:
        try:
            view = self.request("GET", f"/v1/jobs/{job_id}").json()
        except ApiError as exc:
            if exc.status == 404:
                raise KeyError(f"job {job_id} does not exist (or expired)") from None
            raise
        return record_of(view)

    def _wait(self, job_id: str, timeout: float | None, poll: float) -> JobRecord:
        """Follow the job's events until it ends (polling if the stream breaks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self.session.get(f"{self.api_url}/v1/jobs/{job_id}/events", stream=True,
                                  timeout=(self.timeout, timeout or self.timeout)) as resp:
                if resp.status_code == 404:
                    raise KeyError(f"job {job_id} does not exist (or expired)")
                if resp.status_code == 200:
                    for line in resp.iter_lines(decode_unicode=True):
                        if line.startswith("data:"):
                            view = json.loads(line[5:])
                            if view.get("status") in {s.value for s in JobStatus if s.terminal}:
                                return record_of(view)
                        if deadline is not None and time.monotonic() > deadline:
                            break
        except requests.RequestException as exc:
            log.info("job %s: event stream ended (%s); polling", job_id, type(exc).__name__)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return super()._wait(job_id, remaining, max(poll, 0.25))

    def _result_bytes(self, job_id: str) -> bytes:
        try:
            return self.request("GET", f"/v1/jobs/{job_id}/result").content
        except ApiError as exc:
            if exc.status != 409:
                raise
        rec = self._record(job_id)
        raise JobFailed(rec) if rec.status.terminal else RuntimeError(f"job {job_id} is {rec.status.value}")

    def _cancel(self, job_id: str) -> bool:
        return bool(self.request("POST", f"/v1/jobs/{job_id}/cancel").json()["cancelled"])

    # -- templates and add-ons -----------------------------------------------------------------
    def add_template(self, image: ImageLike, template_id: str | None = None) -> str:
        files = [("image", ("template.png", image_bytes(image, mask=False), "image/png"))]
        return self.request("POST", "/v1/templates", files=multipart({"id": template_id}, files)).json()["id"]

    def add_lora(self, adapter: bytes | Path, lora_id: str, *, timeout: float = 300.0) -> dict[str, Any]:
        data = adapter.read_bytes() if isinstance(adapter, Path) else bytes(adapter)
        files = [("adapter", ("adapter.safetensors", data))]
        return self.request("POST", "/v1/loras", files=multipart({"id": lora_id}, files), timeout=timeout).json()

    def list_loras(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/loras").json()

    def add_controlnet(self, folder: Path, controlnet_id: str, *, timeout: float = 600.0) -> dict[str, Any]:
        from app.controls import CONTROL_FILES

        folder = controlnet_folder(folder)
        files = [(part, (name, (folder / name).read_bytes()))
                 for part, name in zip(("config", "weights"), CONTROL_FILES)]
        return self.request("POST", "/v1/controlnets", files=multipart({"id": controlnet_id}, files),
                            timeout=timeout).json()

    def list_controlnets(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/controlnets").json()


def multipart(data: Mapping[str, Any], files: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A multipart/form-data body (always multipart, also without files): fields as text, None (the
    service's default) left out, then the files."""
    fields = [(k, (None, str(v).lower() if isinstance(v, bool) else str(v))) for k, v in data.items() if v is not None]
    return fields + files


def record_of(view: Mapping[str, Any]) -> JobRecord:
    """A ``JobRecord`` from the gateway's job view (its ``record``: the job hash, tenant-free ids)."""
    fields = {k: str(v) for k, v in view["record"].items()}
    return JobRecord(id=view["id"], status=JobStatus(view["status"]), params=JobParams.from_fields(fields),
                     fields=fields)


__all__ = ["ApiError", "AuthenticationError", "HttpStencilClient", "RateLimited", "record_of"]
