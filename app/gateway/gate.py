"""What every ``/v1/`` request passes before a route sees it (pure ASGI middleware).

1. Authentication: ``Authorization: Bearer <key>``, read from Redis on every request (401 otherwise).
2. The tenant's token bucket (429 with ``Retry-After``): a burst costs one Redis script per request
   and nothing else, and no body is read for a refused request.
3. The body: ``Content-Length`` is required (411 for chunked uploads) and must be within the route's
   limit (413, before a byte is read); the body is then read into a spooled file with at most
   ``STENCIL_API_BODY_TIMEOUT_S`` between two reads (408 for a client that stalls) and handed to the
   route only once complete, so a route never waits on a slow client and a refused request stores
   nothing.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.gateway.errors import problem_response

SPOOL_IN_MEMORY = 1 << 20
REPLAY_CHUNK = 1 << 16
BODY_METHODS = ("POST", "PUT", "PATCH")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _ClientGone(Exception):
    pass


def bearer_token(header: str) -> str:
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class Gate:
    """``body_limit(path)``: the largest body a route accepts, with the setting that sets it."""

    def __init__(self, app: ASGIApp, body_limit: Callable[[str], tuple[int, str]]) -> None:
        self.app = app
        self.body_limit = body_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        gw = scope["app"].state.gw
        headers = Headers(scope=scope)
        principal = await gw.authenticate(bearer_token(headers.get("authorization", "")))
        if principal is None:
            await problem_response(401, "a valid API key is required: Authorization: Bearer <key>",
                                   headers={"WWW-Authenticate": 'Bearer realm="stencil"'})(scope, receive, send)
            return
        wait, limits = await gw.bucket.take(principal.tenant)
        if wait > 0:
            await problem_response(
                429, f"tenant {principal.tenant} is over its rate of {limits.rate_per_s:g} requests/s "
                     f"(burst {limits.burst}): retry after {wait:.2f} s",
                code="rate_limited", headers={"Retry-After": str(max(1, math.ceil(wait)))})(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["principal"], state["limits"] = principal, limits
        if scope["method"] in BODY_METHODS or "content-length" in headers or "transfer-encoding" in headers:
            try:
                receive = await self._read_body(scope, receive, headers, gw.settings.api_body_timeout_s)
            except _Refused as refusal:
                await problem_response(refusal.status, refusal.message,
                                       headers={"Connection": "close"})(scope, receive, send)
                return
            except _ClientGone:
                return
        await self.app(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive, headers: Headers, timeout_s: float) -> Receive:
        """The whole body, spooled; a ``receive`` that replays it, then waits for the disconnect."""
        if "transfer-encoding" in headers:
            raise _Refused(411, "send the body with a Content-Length (chunked uploads are not accepted)")
        text = headers.get("content-length", "0")
        if not text.isdigit():
            raise _Refused(400, f"Content-Length must be a number of bytes, got {text[:20]!r}")
        length = int(text)
        limit, setting = self.body_limit(scope["path"])
        if length > limit:
            raise _Refused(413, f"the body is {length} bytes, over this route's limit of {limit} bytes ({setting})")
        if length == 0:
            return receive
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), timeout_s)
                except asyncio.TimeoutError:
                    raise _Refused(408, f"the body stalled for {timeout_s:g} s (STENCIL_API_BODY_TIMEOUT_S)") from None
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                spool.write(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        return _replay(spool, length, receive)


def _replay(spool: Any, length: int, receive: Receive) -> Receive:
    done = False

    async def replay() -> Message:
        nonlocal done
        if done:
            return await receive()  # the client's disconnect, whenever it comes
        chunk = spool.read(REPLAY_CHUNK)
        more = spool.tell() < length and bool(chunk)
        if not more:
            done = True
            spool.close()
        return {"type": "http.request", "body": chunk, "more_body": more}

    return replay
