"""Route dependencies: the gateway, the caller (authenticated by the gate) and its scopes.

The bearer scheme is declared here so that the OpenAPI schema documents it; the key itself was
checked by the gate (``app/gateway/gate.py``) before the route's body was read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.gateway.apikeys import Principal
from app.gateway.errors import ApiProblem
from app.gateway.state import Gateway
from app.gateway.tenants import Limits

bearer = HTTPBearer(auto_error=False, scheme_name="ApiKey",
                    description="An API key (`stencil api-key create`): `Authorization: Bearer stk_...`")


@dataclass(frozen=True)
class Caller:
    principal: Principal
    limits: Limits

    @property
    def tenant(self) -> str:
        return self.principal.tenant


# The dependencies are coroutines although they never wait: FastAPI runs a plain function dependency
# in its thread pool, a hop that cost about 0.4 ms of CPU per dependency and request here.

async def gateway(request: Request) -> Gateway:
    return request.app.state.gw


async def _caller(request: Request, _: HTTPAuthorizationCredentials | None = Security(bearer)) -> Caller:
    principal = getattr(request.state, "principal", None)
    if principal is None:  # only /v1/ routes pass the gate
        raise ApiProblem(401, "a valid API key is required: Authorization: Bearer <key>")
    return Caller(principal, request.state.limits)


def requires(scope: str) -> Callable[..., Awaitable[Caller]]:
    async def check(caller: Caller = Depends(_caller)) -> Caller:
        if scope not in caller.principal.scopes:
            raise ApiProblem(403, f"this key lacks the {scope!r} scope")
        return caller

    return check


GatewayDep = Annotated[Gateway, Depends(gateway)]
AnyKey = Annotated[Caller, Depends(_caller)]
Submitter = Annotated[Caller, Depends(requires("submit"))]
Reader = Annotated[Caller, Depends(requires("read"))]
Admin = Annotated[Caller, Depends(requires("admin"))]
