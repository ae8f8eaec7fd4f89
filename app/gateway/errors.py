"""One error shape for every refusal: ``{"error": {"code", "message", "parameter"?}}`` with the
status that says what happened (400 malformed, 401 no valid key, 403 scope, 404 not yours or not
there, 408/411/413/415 the request itself, 409 state, 422 a parameter, 429 limits)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.client_base import InvalidAdapter
from app.storage.base import StoreUnavailable
from app.validation import InvalidParameter

log = logging.getLogger(__name__)

CODES = {400: "bad_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         408: "request_timeout", 409: "conflict", 411: "length_required", 413: "too_large",
         415: "unsupported_media_type", 422: "invalid_parameter", 429: "rate_limited", 503: "unavailable"}


class ErrorBody(BaseModel):
    code: str
    message: str
    parameter: str | None = None


class ErrorResponse(BaseModel):
    """Every refusal."""

    error: ErrorBody


class ApiProblem(Exception):
    """A refusal a route raises: status, code, a message for the caller (no server internals)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, parameter: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code or CODES.get(status, "error")
        self.message = message
        self.parameter = parameter
        self.headers = dict(headers or {})


def not_found(what: str) -> ApiProblem:
    """The same answer whether the object is another tenant's or does not exist."""
    return ApiProblem(404, f"{what} not found")


def problem_response(status: int, message: str, *, code: str | None = None, parameter: str | None = None,
                     headers: Mapping[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code or CODES.get(status, "error"), "message": message}
    if parameter:
        body["parameter"] = parameter
    return JSONResponse({"error": body}, status_code=status, headers=dict(headers or {}))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header", "form")]
    name = loc[-1] if loc else None
    text = str(first.get("msg", "invalid request"))
    return (f"{name}: {text}" if name else text), name


def install(app: FastAPI) -> None:
    """Exception handlers that render every refusal in the one shape."""

    @app.exception_handler(ApiProblem)
    async def _problem(_: Request, exc: ApiProblem) -> JSONResponse:
        return problem_response(exc.status, exc.message, code=exc.code, parameter=exc.parameter, headers=exc.headers)

    @app.exception_handler(InvalidParameter)
    async def _parameter(_: Request, exc: InvalidParameter) -> JSONResponse:
        return problem_response(422, str(exc), parameter=exc.name)

    @app.exception_handler(InvalidAdapter)
    async def _adapter(_: Request, exc: InvalidAdapter) -> JSONResponse:
        return problem_response(422, str(exc), code="invalid_adapter")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, name = _validation_message(exc)
        return problem_response(422, message, parameter=name)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else CODES.get(exc.status_code, "error")
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body could not be parsed (malformed multipart/form-data)"
        return problem_response(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(StoreUnavailable)
    async def _store(_: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("object store unavailable: %s", exc)
        return problem_response(503, "the object store is unavailable; retry later", headers={"Retry-After": "5"})
