"""``stencil api``: the gateway on uvicorn (HTTP/1.1 with a deadline on request headers)."""

from __future__ import annotations

import logging

from app.gateway.app import create_app
from app.gateway.protocol import protocol_with
from app.secrets import check_secrets
from app.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings, *, host: str = "", port: int | None = None, access_log: bool = False) -> int:
    """Serve until SIGTERM / SIGINT. ``host`` defaults to STENCIL_BIND_ADDRESS (loopback)."""
    import uvicorn

    from app.metrics import start_metrics_server

    check_secrets()
    start_metrics_server(settings.metrics_port, settings.metrics_address)
    host = host or settings.bind_address
    port = settings.api_port if port is None else port
    protocol = protocol_with(settings.api_header_timeout_s)
    config = uvicorn.Config(create_app(settings), host=host, port=port, http=protocol, loop="auto", lifespan="on",
                            timeout_keep_alive=5, server_header=False, proxy_headers=False, access_log=access_log,
                            log_config=None)
    log.info("Stencil API on http://%s:%d (keys: stencil api-key create)", host, port)
    uvicorn.Server(config).run()
    return 0
