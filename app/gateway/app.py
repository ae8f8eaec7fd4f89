"""The gateway application: routes, the gate, error shapes, the web page, the catalog feeder."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from app.gateway import account_api, addons_api, catalogs, catalogs_api, errors, jobs_api, templates_api
from app.gateway.gate import Gate
from app.gateway.observe import Observe
from app.gateway.state import Gateway
from app.settings import Settings

log = logging.getLogger(__name__)

API_VERSION = "1"
STATIC = Path(__file__).resolve().parent / "static"
FEED_INTERVAL_S = 0.5
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; script-src 'self'; "
                               "style-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache",
}
DESCRIPTION = """Mask-based image edits (inpainting) as jobs: submit an edit (a template with its mask, or a
stored template id), follow it (`GET /v1/jobs/{id}` or server-sent events), fetch its result.

Every `/v1/` request carries an API key (`Authorization: Bearer stk_...`, made with `stencil api-key
create`) bound to a tenant and scopes (`submit`, `read`, `admin`). A tenant sees only its own jobs,
templates, add-ons, catalogs and results: anything else is 404. Each tenant has a request rate and a
number of jobs not yet ended (429 with `Retry-After` past either). Refusals are
`{"error": {"code", "message", "parameter"?}}`."""


def body_limit(settings: Settings) -> Callable[[str], tuple[int, str]]:
    """The largest request body of each route (add-on uploads have their own limits)."""
    own = {"/v1/loras": (settings.max_lora_bytes + (1 << 20), "STENCIL_MAX_LORA_BYTES"),
           "/v1/controlnets": (2 * settings.max_controlnet_bytes + (1 << 20), "STENCIL_MAX_CONTROLNET_BYTES")}
    default = (settings.api_max_body_bytes, "STENCIL_API_MAX_BODY_BYTES")
    return lambda path: own.get(path.rstrip("/"), default)


async def feed_catalogs(gw: Gateway) -> None:
    """Submit waiting catalog rows as their tenants' quotas allow (every gateway process does it:
    rows are claimed in Redis, so several processes never submit one twice)."""
    while True:
        try:
            for catalog_id in await asyncio.to_thread(catalogs.active, gw):
                await asyncio.to_thread(catalogs.feed, gw, catalog_id)
        except Exception as exc:  # Redis away for a moment: the next round retries
            log.warning("catalog feeder: %s", exc)
        await asyncio.sleep(FEED_INTERVAL_S)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = Gateway(settings)
        app.state.gw = gw
        feeder = asyncio.create_task(feed_catalogs(gw))
        try:
            yield
        finally:
            feeder.cancel()
            await gw.close()

    app = FastAPI(title="Stencil API", version=API_VERSION, description=DESCRIPTION, lifespan=lifespan,
                  redoc_url=None)
    errors.install(app)
    for module in (jobs_api, templates_api, addons_api, catalogs_api, account_api):
        app.include_router(module.router)
        if hasattr(module, "uploads"):
            app.include_router(module.uploads)
    app.add_middleware(Gate, body_limit=body_limit(settings))
    app.add_middleware(Observe)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> JSONResponse:
        try:
            await app.state.gw.aredis.ping()
        except Exception:
            return JSONResponse({"ok": False}, status_code=503)
        return JSONResponse({"ok": True})

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
