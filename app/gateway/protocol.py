"""uvicorn's HTTP/1.1 protocol with a deadline on each request's headers.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but not the time a request's
headers take to arrive: its keep-alive timer is reset by every byte, so a client that trickles a
header byte at a time holds a connection for ever (Slowloris). Here a request's headers must be
complete within ``STENCIL_API_HEADER_TIMEOUT_S`` of its first byte (of the connection, for the
first request), else the client gets ``408 Request Timeout`` and the connection is closed. The
body's own pace is the gate's business (``app/gateway/gate.py``).

The base is uvicorn's httptools protocol (a C parser; h11's where httptools is missing), run on
uvloop where installed: profiled here on the asyncio loop with h11, a third of the gateway's CPU
per request was the event loop and an eighth h11's parsing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as BaseProtocol
except ImportError:  # httptools is not installed: the pure-Python parser
    from uvicorn.protocols.http.h11_impl import H11Protocol as BaseProtocol  # type: ignore[assignment]

log = logging.getLogger(__name__)


class HeaderDeadlineProtocol(BaseProtocol):
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._between_requests():
            self._arm()  # the first byte of the next request on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or not self._between_requests():
            return
        log.info("closing a connection whose request headers took over %.1f s", self.header_timeout_s)
        # The parser has no request to answer yet (the headers never completed): the response is written raw.
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT))
        self.transport.close()


_TIMEOUT_TEXT = b"request headers not received in time (STENCIL_API_HEADER_TIMEOUT_S)\n"


def protocol_with(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
