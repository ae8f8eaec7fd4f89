"""The HTTP gateway (``stencil api``): clients that are not Python and do not hold the Redis password.

An ASGI app (FastAPI on uvicorn) that writes into the same Redis intake as the Python client
(``StencilClient.enqueue``), so the dispatcher and the workers see the jobs they always saw. Only
the gateway and operators hold Redis credentials; a client holds an API key bound to one tenant
and scopes (``submit``, ``read``, ``admin``).

- ``apikeys``: keys stored hashed, verified per request (revocation is immediate);
- ``tenants``: a tenant's namespace (job ids, templates, add-ons and results are ``<tenant>.<id>``),
  its limits and webhook secret, the index of its jobs;
- ``limits``: the per-tenant token bucket and concurrent-job quota (429 with Retry-After);
- ``gate``: authentication, rate limit and request-body limits before a route sees a byte;
- ``protocol``: uvicorn's HTTP/1.1 protocol with a deadline on a request's headers (slow clients);
- ``observe``: every request timed into ``stencil_api_request_seconds``;
- ``state``, ``deps``, ``errors``: the process's connections, the routes' dependencies (caller,
  scopes), the one error shape;
- ``intake``, ``views``, ``uploads``, ``forms``: submissions, public records, checked uploads, the
  multipart forms;
- ``jobs_api``, ``templates_api``, ``addons_api``, ``catalogs_api``, ``account_api``: the routes;
- ``catalogs``: catalogs fed into the tenant's quota as jobs end; ``app``: the application;
  ``server``: ``stencil api``; ``openapi``: the checked-in schema (``docs/openapi.json``);
  ``admin_cli``: ``stencil api-key ...`` and ``stencil tenant ...``; ``static/``: the web page.
"""
