"""Hostile requests against the real gateway: oversized and chunked bodies, wrong content types,
malformed multipart, path-like ids, a burst of 2,000 requests from one key, slow clients. Each is
refused with a clear status, and nothing is stored (Redis keys and object-store files compared
before and after)."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from app.embedded import EmbeddedStack
from app.maskgen import make_mask
from tests.support.gateway import Gateway, auth, make_key
from tests.test_service import SIZE, template

pytestmark = pytest.mark.integration


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


MASK = png(Image.fromarray(make_mask(0.2, (SIZE, SIZE), seed=1).astype(np.uint8) * 255))


class Tenants:
    """Fresh tenants of one test, and what the service holds in their namespaces: every job, upload,
    template, result, idempotency key and catalog of a tenant is named ``<tenant>.<id>`` (jobs and
    templates of other tests, or their background warm-ups, are in other namespaces)."""

    def __init__(self, stack: EmbeddedStack) -> None:
        self.stack = stack
        self.names: list[str] = []

    def key(self, role: str, scopes: str = "submit,read,admin", **limits: float) -> str:
        name = f"{role}-{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        return make_key(self.stack, name, scopes, **limits)

    def stored(self) -> set[str]:
        """Redis keys and object-store files in the tenants' namespaces, but for the tenant record
        and its rate bucket (which every request touches)."""
        bookkeeping = {f"stencil:tenant:{n}{suffix}" for n in self.names for suffix in ("", ":bucket")}
        keys = {k.decode() for k in self.stack.redis().scan_iter("*", count=1000)} - bookkeeping
        root = Path(self.stack.settings.store_dir)
        files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
        return {k for k in keys | files if any(n in k for n in self.names)}


@pytest.fixture()
def tenants(stack: EmbeddedStack) -> Iterator[Tenants]:
    """The test's tenants; after the test, nothing may be stored in their namespaces."""
    made = Tenants(stack)
    yield made
    assert made.stored() == set(), "a refused request stored something"


@pytest.fixture()
def key(tenants: Tenants) -> str:
    return tenants.key("hostile")


def raw(gateway: Gateway, request: bytes, *, pause_after: float = 0.0, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``request`` as is on a fresh connection (then wait ``pause_after``), read until the server
    closes or ``timeout``; returns the bytes and the seconds from the last byte sent to the first
    byte of the answer."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout) as sock:
        sock.sendall(request)
        sent = time.monotonic()
        time.sleep(pause_after)
        chunks, first = [], None
        while True:
            try:
                data = sock.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not data:
                break
            first = first or time.monotonic()
            chunks.append(data)
        return b"".join(chunks), (first or time.monotonic()) - sent


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def body_of(answer: bytes) -> dict:  # type: ignore[type-arg]
    return json.loads(answer.partition(b"\r\n\r\n")[2] or b"{}")


def head(key: str, path: str, extra: str, method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nAuthorization: Bearer {key}\r\n"
            f"{extra}\r\n").encode()


def test_oversized_chunked_and_over_limit_bodies(gateway: Gateway, key: str, tenants: Tenants) -> None:
    # Over the route's body limit: 413 from the headers alone, no byte of the body read.
    answer, _ = raw(gateway, head(key, "/v1/edits", "Content-Type: multipart/form-data; boundary=x\r\n"
                                                    "Content-Length: 50000000\r\n"))
    assert status_of(answer) == 413, answer[:300]
    assert "STENCIL_API_MAX_BODY_BYTES" in body_of(answer)["error"]["message"]
    answer, _ = raw(gateway, head(key, "/v1/edits", "Content-Type: multipart/form-data; boundary=x\r\n"
                                                    "Transfer-Encoding: chunked\r\n") + b"5\r\nhello\r\n0\r\n\r\n")
    assert status_of(answer) == 411 and body_of(answer)["error"]["code"] == "length_required"
    # An image within the bytes but over the pixel limit, a non-image, a truncated image: 422 naming it.
    big = requests.post(gateway.url + "/v1/edits", headers=auth(key), timeout=30,
                        files={"template": ("t.png", png(template(1, size=600))), "mask": ("m.png", MASK)})
    assert big.status_code == 422 and big.json()["error"]["parameter"] == "template"
    assert "STENCIL_MAX_IMAGE_PIXELS" in big.json()["error"]["message"]
    whole = png(template(2))
    for data, why in ((b"GIF89a not really", "could not be decoded"),
                      (whole[: len(whole) // 2], "could not be decoded"), (b"", "is empty")):
        bad = requests.post(gateway.url + "/v1/edits", headers=auth(key), timeout=30,
                            files={"template": ("t.png", whole), "mask": ("m.png", data)})
        assert bad.status_code == 422 and why in bad.json()["error"]["message"], bad.text
        assert bad.json()["error"]["parameter"] == "mask"


def test_wrong_content_types_and_malformed_multipart(gateway: Gateway, key: str, tenants: Tenants) -> None:
    url = gateway.url + "/v1/edits"
    for ctype, body in (("application/json", b'{"prompt": "x"}'), ("application/x-www-form-urlencoded", b"prompt=x"),
                        ("text/plain", b"hello"), ("", b"hello")):
        resp = requests.post(url, headers={**auth(key), "Content-Type": ctype}, data=body, timeout=10)
        assert resp.status_code == 415, (ctype, resp.text)
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    boundary = "b0undary"
    good_start = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"mask\"; filename=\"m.png\"\r\n"
                  "Content-Type: image/png\r\n\r\n").encode() + MASK
    for ctype, body in ((f"multipart/form-data; boundary={boundary}", good_start),  # never closed
                        ("multipart/form-data", good_start + f"\r\n--{boundary}--\r\n".encode()),  # no boundary
                        (f"multipart/form-data; boundary={boundary}", b"--" + boundary.encode() + b"\r\ngarbage\r\n")):
        resp = requests.post(url, headers={**auth(key), "Content-Type": ctype}, data=body, timeout=10)
        assert resp.status_code in (400, 422), (ctype, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["code"] in ("bad_request", "invalid_parameter") and error["message"]
    # Fields of the wrong type are named.
    files = {"mask": ("m.png", MASK), "template": ("t.png", png(template(3)))}
    resp = requests.post(url, headers=auth(key), files=files, data={"steps": "many"}, timeout=10)
    assert resp.status_code == 422 and resp.json()["error"]["parameter"] == "steps"


def test_path_like_ids_name_nothing(gateway: Gateway, key: str, tenants: Tenants) -> None:
    h = auth(key)
    for path in ("/v1/jobs/..%2F..%2Fetc%2Fpasswd", "/v1/jobs/%2e%2e", "/v1/jobs/../../etc/passwd",
                 "/v1/jobs/x.00000000000000000000000000000000/result", "/v1/templates/..%2F..%2Fresults/image",
                 "/v1/templates/.hidden/image", "/v1/templates/%00/image", "/v1/catalogs/..%2Fx"):
        resp = requests.get(gateway.url + path, headers=h, timeout=10)
        assert resp.status_code == 404, (path, resp.status_code, resp.text)
    sock_answer, _ = raw(gateway, head(key, "/v1/jobs/../../../etc/passwd", "", method="GET"))
    assert status_of(sock_answer) == 404
    for field, value, path, files in (
            ("template_id", "../../etc/passwd", "/v1/edits", {"mask": ("m.png", MASK)}),
            ("template_id", "/abs", "/v1/edits", {"mask": ("m.png", MASK)}),
            ("id", "../shoe", "/v1/templates", {"image": ("t.png", png(template(4)))}),
            ("id", "a/b", "/v1/loras", {"adapter": ("a.safetensors", b"x" * 10)})):
        resp = requests.post(gateway.url + path, headers=h, files=files, data={field: value}, timeout=10)
        assert resp.status_code == 422, (path, value, resp.text)
        assert "may contain only letters, digits" in resp.json()["error"]["message"]
    loras = requests.post(gateway.url + "/v1/edits", headers=h, timeout=10,
                          files={"mask": ("m.png", MASK), "template": ("t.png", png(template(4)))},
                          data={"loras": "../x:0.5"})
    assert loras.status_code == 422 and loras.json()["error"]["parameter"] == "loras"


def test_a_burst_of_2000_requests_is_limited_and_other_tenants_are_not(stack: EmbeddedStack, gateway: Gateway,
                                                                        tenants: Tenants) -> None:
    from app.gateway.tenants import Tenants as TenantRecords

    rate, burst = 50.0, 50  # the two tenants' own limits
    noisy, quiet = (tenants.key(role, "submit,read", rate_per_s=rate, burst=burst) for role in ("noisy", "quiet"))
    codes: Counter[int] = Counter()
    retry_after: set[str] = set()
    quiet_codes: list[int] = []
    lock = threading.Lock()

    def hammer(n: int) -> None:
        with requests.Session() as s:
            s.headers.update(auth(noisy))
            for _ in range(n):
                resp = s.get(gateway.url + "/v1/jobs?limit=1", timeout=30)
                with lock:
                    codes[resp.status_code] += 1
                    if resp.status_code == 429:
                        retry_after.add(resp.headers["Retry-After"])
                        assert resp.json()["error"]["code"] == "rate_limited"

    def steady() -> None:
        with requests.Session() as s:
            s.headers.update(auth(quiet))
            for _ in range(30):  # 20/s: within its own rate
                quiet_codes.append(s.get(gateway.url + "/v1/jobs?limit=1", timeout=30).status_code)
                time.sleep(0.05)

    t0 = time.monotonic()
    with ThreadPoolExecutor(17) as pool:  # .result() re-raises a thread's failed assertion here
        for done in [pool.submit(hammer, 125) for _ in range(16)] + [pool.submit(steady)]:
            done.result()
    elapsed = time.monotonic() - t0
    assert sum(codes.values()) == 2000 and set(codes) == {200, 429}, codes
    assert burst <= codes[200] <= burst + rate * elapsed + 5, (codes, elapsed)
    assert retry_after and all(int(v) >= 1 for v in retry_after)
    assert quiet_codes == [200] * 30, Counter(quiet_codes)
    # Past its rate, a submission is refused before its body is read: no job, no upload. (A rate so
    # low that no token comes back during the test, so the submission cannot slip in.)
    TenantRecords(stack.redis(), stack.settings).set_limits(tenants.names[0], rate_per_s=0.001, burst=1)
    while requests.get(gateway.url + "/v1/jobs", headers=auth(noisy), timeout=10).status_code != 429:
        pass
    refused = requests.post(gateway.url + "/v1/edits", headers=auth(noisy), timeout=10,
                            files={"mask": ("m.png", MASK), "template": ("t.png", png(template(5)))})
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1


def test_slow_clients_get_408_and_do_not_hold_up_others(gateway: Gateway, key: str, tenants: Tenants) -> None:
    timeout = 1.5  # the test gateway's STENCIL_API_HEADER_TIMEOUT_S and STENCIL_API_BODY_TIMEOUT_S
    held: list[socket.socket] = []
    try:
        for _ in range(40):  # connections trickling headers that never end
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            sock.sendall(b"GET /v1/me HTTP/1.1\r\nHost: t\r\nX-Slow: ")
            held.append(sock)
        t0 = time.monotonic()
        assert requests.get(gateway.url + "/v1/me", headers=auth(key), timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.0, "a slow client held up a normal request"
    finally:
        for sock in held:
            sock.close()
    answer, waited = raw(gateway, b"GET /v1/me HTTP/1.1\r\nHost: t\r\nX-Slow: a")
    assert status_of(answer) == 408 and timeout - 0.2 <= waited <= timeout + 2.0, (answer[:200], waited)
    answer, waited = raw(gateway, b"")  # connects, says nothing
    assert status_of(answer) == 408 and waited <= timeout + 2.0
    partial = head(key, "/v1/edits", "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 5000\r\n")
    answer, waited = raw(gateway, partial + b"--x\r\nContent-Disposition: form-data; name=\"mask\"\r\n\r\nabc")
    assert status_of(answer) == 408, answer[:300]
    assert "STENCIL_API_BODY_TIMEOUT_S" in body_of(answer)["error"]["message"]
    assert timeout - 0.2 <= waited <= timeout + 2.0
