"""Each gateway request timed into ``stencil_api_request_seconds`` (``app/metrics.py``): from its
arrival to its response's first byte, by route template and status. Outermost, so refusals by the
gate (route ``gate``) are counted too; a stream counts until its headers, not its whole life."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics import observe_api_request


class Observe:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                name = getattr(route, "path", None) or ("gate" if scope["path"].startswith("/v1/") else "other")
                observe_api_request(name, message["status"], time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, timed_send)
