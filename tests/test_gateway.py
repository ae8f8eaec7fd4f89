"""The HTTP gateway over real HTTP against a real stack (redis-server, Celery workers, dispatcher,
``stencil api`` on uvicorn): every endpoint, the OpenAPI schema, tenant isolation, revocation,
limits, idempotency, catalogs, add-ons, webhooks and the Python client over HTTP."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from PIL import Image

from app.embedded import EmbeddedStack
from app.maskgen import make_mask
from tests.support.gateway import ROOT, Gateway, auth, make_key
from tests.test_service import SIZE, template

pytestmark = pytest.mark.integration


def png(value: Image.Image | np.ndarray) -> bytes:
    img = Image.fromarray(value.astype(np.uint8) * 255) if isinstance(value, np.ndarray) else value
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def tenant_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def submit(gateway: Gateway, key: str, *, image: Image.Image | None = None, template_id: str = "",
           mask: np.ndarray | None = None, headers: dict[str, str] | None = None, **fields: Any) -> requests.Response:
    files: list[tuple[str, Any]] = [("mask", ("m.png", png(mask if mask is not None else make_mask(0.2, (SIZE, SIZE),
                                                                                                     seed=1))))]
    if image is not None:
        files.append(("template", ("t.png", png(image))))
    data = {k: str(v) for k, v in fields.items()}
    if template_id:
        data["template_id"] = template_id
    return requests.post(gateway.url + "/v1/edits", headers={**auth(key), **(headers or {})}, files=files, data=data,
                         timeout=30)


def events(gateway: Gateway, key: str, path: str, timeout: float = 120) -> list[tuple[str, dict[str, Any]]]:
    """Every server-sent event of ``path`` until the server ends the stream."""
    out = []
    with requests.get(gateway.url + path, headers=auth(key), stream=True, timeout=timeout) as resp:
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                out.append((event, json.loads(line[5:])))
    return out


def wait_done(gateway: Gateway, key: str, job_id: str) -> dict[str, Any]:
    updates = events(gateway, key, f"/v1/jobs/{job_id}/events")
    return updates[-1][1]


# -- the schema ---------------------------------------------------------------------------------------

def test_openapi_schema_is_valid_served_and_checked_in(gateway: Gateway, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from openapi_spec_validator import validate

    from app.gateway import openapi

    served = requests.get(gateway.url + "/openapi.json", timeout=10).json()
    validate(served)
    checked_in = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert served == checked_in, "docs/openapi.json is out of date: python -m app.gateway.openapi --write"
    expected = {"/v1/edits", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/result",
                "/v1/jobs/{job_id}/cancel", "/v1/templates", "/v1/templates/{template_id}/image",
                "/v1/templates/{template_id}/warm", "/v1/loras", "/v1/controlnets", "/v1/catalogs",
                "/v1/catalogs/{catalog_id}", "/v1/catalogs/{catalog_id}/events", "/v1/me", "/v1/webhook-secret"}
    assert set(served["paths"]) == expected
    assert served["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
    # The check itself fails on drift (a copy with one route's summary changed).
    drifted = dict(checked_in, info={**checked_in["info"], "title": "drifted"})
    stale = tmp_path / "openapi.json"
    stale.write_text(json.dumps(drifted))
    monkeypatch.setattr(openapi, "CHECKED_IN", stale)
    assert openapi.main(["--check"]) == 1
    monkeypatch.setattr(openapi, "CHECKED_IN", ROOT / "docs" / "openapi.json")
    assert openapi.main(["--check"]) == 0


# -- jobs ---------------------------------------------------------------------------------------------

def test_edit_over_http_equals_the_same_edit_through_the_redis_client(stack: EmbeddedStack, gateway: Gateway,
                                                                      client: Any) -> None:
    key = make_key(stack, tenant_name("eq"))
    image, mask = template(41), make_mask(0.25, (SIZE, SIZE), "blob", seed=4)
    params = dict(prompt="a red scarf", steps=6, guidance=7.5, seed=11)
    resp = submit(gateway, key, image=image, mask=mask, **params)
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert resp.headers["Location"] == f"/v1/jobs/{job['id']}"
    # The response shows the job as it is when answered: a CPU worker may already be preparing it.
    order = ["queued", "routed", "preparing", "waiting", "denoising", "finalizing", "done"]
    assert job["status"] in order[:-1] and job["progress"]["total"] == 6, job
    updates = events(gateway, key, f"/v1/jobs/{job['id']}/events")
    statuses = [u["status"] for _, u in updates]
    assert statuses[-1] == "done", updates[-1]
    assert order.index(statuses[0]) >= order.index(job["status"]), (job["status"], statuses)
    ranks = [order.index(s) for s in statuses]  # the stream starts wherever the job is, then follows it
    assert len(set(ranks)) >= 2 and ranks == sorted(ranks), statuses
    assert len(updates) == len({json.dumps(u, sort_keys=True) for _, u in updates})  # an event per change
    assert updates[-1][1]["progress"] == {"step": 6, "total": 6}
    result = requests.get(gateway.url + updates[-1][1]["result_url"], headers=auth(key), timeout=30)
    assert result.status_code == 200 and result.headers["content-type"] == "image/png"
    over_redis = client.submit(template=image, mask=mask, **params)
    assert over_redis.wait(120).status.value == "done"
    a = np.asarray(Image.open(io.BytesIO(result.content)), dtype=np.int16)
    b = np.asarray(over_redis.result(), dtype=np.int16)
    assert np.abs(a - b).max() <= 1, "the gateway's job differs from the Python client's"
    record = requests.get(gateway.url + f"/v1/jobs/{job['id']}", headers=auth(key), timeout=10).json()["record"]
    assert "tenant" not in record and record["template_id"].startswith("upload-")


def test_stored_template_warm_list_and_cancel(stack: EmbeddedStack, gateway: Gateway) -> None:
    key = make_key(stack, tenant_name("tpl"))
    url, h = gateway.url, auth(key)
    added = requests.post(url + "/v1/templates", headers=h, files={"image": ("t.png", png(template(42)))},
                          data={"id": "shoe"}, timeout=10)
    assert added.status_code == 201 and added.json() == {"id": "shoe", "created": True}
    anon = requests.post(url + "/v1/templates", headers=h, files={"image": ("t.png", png(template(43)))}, timeout=10)
    again = requests.post(url + "/v1/templates", headers=h, files={"image": ("t.png", png(template(43)))}, timeout=10)
    assert anon.status_code == 201 and again.status_code == 200 and anon.json()["id"] == again.json()["id"]
    listed = requests.get(url + "/v1/templates", headers=h, timeout=10).json()["templates"]
    assert sorted(listed) == sorted(["shoe", anon.json()["id"]])
    image = requests.get(url + "/v1/templates/shoe/image", headers=h, timeout=10)
    assert image.headers["content-type"] == "image/png" and image.content == png(template(42))

    warm = requests.post(url + "/v1/templates/shoe/warm", headers=h, files={"steps": (None, "4")}, timeout=10)
    assert warm.status_code == 201, warm.text
    assert warm.json()["kind"] == "warm" and wait_done(gateway, key, warm.json()["id"])["status"] == "done"
    edit = submit(gateway, key, template_id="shoe", steps=4, seed=3)
    assert edit.status_code == 201 and edit.json()["template_id"] == "shoe"
    assert wait_done(gateway, key, edit.json()["id"])["status"] == "done"

    long = submit(gateway, key, template_id="shoe", steps=200)
    job_id = long.json()["id"]
    cancel = requests.post(url + f"/v1/jobs/{job_id}/cancel", headers=h, timeout=10).json()
    assert cancel["cancelled"] and cancel["job"]["status"] == "cancelled"
    assert requests.post(url + f"/v1/jobs/{job_id}/cancel", headers=h, timeout=10).json()["cancelled"] is False
    gone = requests.get(url + f"/v1/jobs/{job_id}/result", headers=h, timeout=10)
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "job_cancelled"

    jobs = requests.get(url + "/v1/jobs", headers=h, timeout=10).json()["jobs"]
    assert [j["id"] for j in jobs] == [job_id, edit.json()["id"], warm.json()["id"]]  # newest first
    done = requests.get(url + "/v1/jobs?status=done&limit=1", headers=h, timeout=10).json()
    assert [j["id"] for j in done["jobs"]] == [edit.json()["id"]] and done["next_before"] is not None
    rest = requests.get(url + f"/v1/jobs?status=done&before={done['next_before']}", headers=h, timeout=10).json()
    assert [j["id"] for j in rest["jobs"]] == [warm.json()["id"]] and rest["next_before"] is None
    missing = submit(gateway, key, template_id="no-such-template")
    assert missing.status_code == 404 and missing.json()["error"]["parameter"] == "template_id"


def test_idempotency_keys_are_per_tenant(stack: EmbeddedStack, gateway: Gateway) -> None:
    a, b = make_key(stack, tenant_name("ida")), make_key(stack, tenant_name("idb"))
    first = submit(gateway, a, image=template(44), steps=3, headers={"Idempotency-Key": "order-17"})
    second = submit(gateway, a, image=template(45), steps=3, headers={"Idempotency-Key": "order-17"})
    other = submit(gateway, b, image=template(44), steps=3, headers={"Idempotency-Key": "order-17"})
    assert (first.status_code, second.status_code, other.status_code) == (201, 200, 201)
    assert first.json()["id"] == second.json()["id"] != other.json()["id"]
    assert first.json()["record"]["idempotency_key"] == "order-17"
    for key, job in ((a, first), (b, other)):
        assert wait_done(gateway, key, job.json()["id"])["status"] == "done"


# -- tenants, keys, limits -------------------------------------------------------------------------------

def test_a_tenant_sees_nothing_of_another(stack: EmbeddedStack, gateway: Gateway) -> None:
    a, b = make_key(stack, tenant_name("a")), make_key(stack, tenant_name("b"))
    url = gateway.url
    assert requests.post(url + "/v1/templates", headers=auth(b), files={"image": ("t.png", png(template(46)))},
                         data={"id": "secret-shoe"}, timeout=10).status_code == 201
    theirs = submit(gateway, b, template_id="secret-shoe", steps=150)
    done = submit(gateway, b, template_id="secret-shoe", steps=2)
    their_id, done_id = theirs.json()["id"], done.json()["id"]
    assert wait_done(gateway, b, done_id)["status"] == "done"
    for method, path in (("GET", f"/v1/jobs/{their_id}"), ("GET", f"/v1/jobs/{their_id}/events"),
                         ("GET", f"/v1/jobs/{done_id}/result"), ("POST", f"/v1/jobs/{their_id}/cancel"),
                         ("GET", "/v1/templates/secret-shoe/image"), ("POST", "/v1/templates/secret-shoe/warm")):
        resp = requests.request(method, url + path, headers=auth(a), timeout=10,
                                files={"steps": (None, "2")} if path.endswith("warm") else None)
        assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
        assert resp.json()["error"]["code"] == "not_found"
    # The same answer as for an id that never existed: nothing tells them apart.
    ghost = requests.get(url + f"/v1/jobs/{their_id.split('.')[0]}.{uuid.uuid4().hex}", headers=auth(b), timeout=10)
    assert ghost.status_code == 404
    assert submit(gateway, a, template_id="secret-shoe").status_code == 404
    assert requests.get(url + "/v1/jobs", headers=auth(a), timeout=10).json()["jobs"] == []
    assert requests.get(url + "/v1/templates", headers=auth(a), timeout=10).json()["templates"] == []
    # B's job was not cancelled by A's attempt, and its stored objects live in B's namespace.
    record = requests.get(url + f"/v1/jobs/{their_id}", headers=auth(b), timeout=10).json()
    assert record["status"] not in ("cancelled", "failed")
    tenant_b = their_id.split(".")[0]
    assert stack.redis().hget(f"stencil:job:{done_id}", "result_key").decode() == f"results/{done_id}.png"
    assert done_id.startswith(tenant_b + ".")
    assert (Path(stack.settings.store_dir) / "templates" / f"{tenant_b}.secret-shoe" / "image").is_file()
    requests.post(url + f"/v1/jobs/{their_id}/cancel", headers=auth(b), timeout=10)


def test_revoked_key_is_refused_at_once_and_scopes_hold(stack: EmbeddedStack, gateway: Gateway) -> None:
    tenant = tenant_name("rev")
    env = stack.env()
    created = subprocess.run([sys.executable, "-m", "app.cli", "api-key", "create", "--tenant", tenant, "--scopes",
                              "submit,read", "--name", "laptop"], env=env, capture_output=True, text=True, timeout=60)
    assert created.returncode == 0, created.stderr
    out = json.loads(created.stdout)
    key, key_id = out["key"], out["key_id"]
    assert out["webhook_secret"].startswith("whsec_")
    assert requests.get(gateway.url + "/v1/me", headers=auth(key), timeout=10).json()["tenant"] == tenant
    listed = subprocess.run([sys.executable, "-m", "app.cli", "api-key", "list", "--tenant", tenant, "--json"],
                            env=env, capture_output=True, text=True, timeout=60)
    rows = json.loads(listed.stdout)
    assert [r["key_id"] for r in rows] == [key_id] and key not in listed.stdout and "sha256" not in listed.stdout
    other_key = make_key(stack, tenant)
    limited = subprocess.run([sys.executable, "-m", "app.cli", "tenant", "limits", tenant, "--max-jobs", "5",
                              "--rate", "7.5"], env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(limited.stdout) == {"tenant": tenant, "rate_per_s": 7.5, "burst": 40, "max_jobs": 5}
    me = requests.get(gateway.url + "/v1/me", headers=auth(key), timeout=10).json()
    assert (me["rate_per_s"], me["max_jobs"], me["scopes"]) == (7.5, 5, ["read", "submit"])

    job = submit(gateway, key, image=template(47), steps=150).json()
    stream = requests.get(gateway.url + f"/v1/jobs/{job['id']}/events", headers=auth(key), stream=True, timeout=60)
    lines = stream.iter_lines(decode_unicode=True)
    assert next(lines).startswith("event: update")
    revoked = subprocess.run([sys.executable, "-m", "app.cli", "api-key", "revoke", key_id], env=env,
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    refused = requests.get(gateway.url + "/v1/me", headers=auth(key), timeout=10)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Bearer")
    tail = [line for line in lines if line]  # the open stream ends with an error event
    assert tail[-2:] == ["event: error", 'data: {"code":"unauthenticated","message":"the API key was revoked"}']
    for bad in ("", "Bearer ", "Bearer stk_000000000000_" + "x" * 43, f"Basic {key}"):
        assert requests.get(gateway.url + "/v1/jobs", headers={"Authorization": bad}, timeout=10).status_code == 401

    reader = make_key(stack, tenant, "read")
    forbidden = submit(gateway, reader, image=template(47), steps=2)
    assert forbidden.status_code == 403 and "submit" in forbidden.json()["error"]["message"]
    assert requests.post(gateway.url + "/v1/webhook-secret", headers=auth(reader), timeout=10).status_code == 403
    admin = make_key(stack, tenant, "admin")
    rotated = requests.post(gateway.url + "/v1/webhook-secret", headers=auth(admin), timeout=10).json()
    assert rotated["webhook_secret"] != out["webhook_secret"]
    assert requests.post(gateway.url + f"/v1/jobs/{job['id']}/cancel", headers=auth(other_key),
                         timeout=10).json()["cancelled"]


def test_quota_refuses_with_429_until_a_job_ends(stack: EmbeddedStack, gateway: Gateway) -> None:
    key = make_key(stack, tenant_name("quota"), max_jobs=2)
    jobs = [submit(gateway, key, image=template(48), steps=40, seed=i) for i in range(2)]
    assert [j.status_code for j in jobs] == [201, 201]
    refused = submit(gateway, key, image=template(48), steps=2)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
    assert refused.headers["Retry-After"] == "1" and "2 jobs" in refused.json()["error"]["message"]
    assert requests.get(gateway.url + "/v1/me", headers=auth(key), timeout=10).json()["jobs_in_flight"] == 2
    requests.post(gateway.url + f"/v1/jobs/{jobs[0].json()['id']}/cancel", headers=auth(key), timeout=10)
    admitted = submit(gateway, key, image=template(48), steps=2)
    assert admitted.status_code == 201, admitted.text
    for job in (jobs[1], admitted):
        assert wait_done(gateway, key, job.json()["id"])["status"] == "done"


# -- the Python client over HTTP -------------------------------------------------------------------------

def test_python_client_over_http_has_the_same_methods_and_errors(stack: EmbeddedStack, gateway: Gateway) -> None:
    from app.client import InvalidParameter, JobFailed, StencilClient
    from app.http_client import AuthenticationError, HttpStencilClient

    key = make_key(stack, tenant_name("py"))
    client = StencilClient(api_url=gateway.url, api_key=key)
    assert isinstance(client, HttpStencilClient) and not hasattr(client, "redis")
    image, mask = template(49), make_mask(0.2, (SIZE, SIZE), seed=2)
    handle = client.submit(template=image, mask=mask, prompt="a hat", steps=4, seed=5, loras=[], controls=[])
    rec = handle.wait(120)
    assert rec.status.value == "done" and rec.progress == (4, 4) and rec.params.prompt == "a hat"
    assert handle.result().size == (SIZE, SIZE)
    tid = client.add_template(image, "hat-base")
    assert tid == "hat-base"
    assert client.warm_template(tid, steps=3).wait(120).status.value == "done"
    many = client.submit_many([{"template": tid, "mask": mask, "steps": 2, "seed": s} for s in range(2)])
    assert [r.status.value for r in client.wait_all(many, timeout=120)] == ["done", "done"]
    with pytest.raises(InvalidParameter, match="steps: must be between 1 and"):
        client.submit(template=image, mask=mask, steps=0)
    with pytest.raises(KeyError):
        client.job(f"{handle.id.split('.')[0]}.{uuid.uuid4().hex}").record()
    wrong = client.submit(template=image, mask=np.ones((64, 64), bool), steps=2)  # decodes; fails in the worker
    assert wrong.wait(60).status.value == "failed"
    with pytest.raises(JobFailed, match="does not match image size"):
        wrong.result()
    slow = client.submit(template=tid, mask=mask, steps=200)
    assert slow.cancel() and not slow.cancel()
    with pytest.raises(AuthenticationError):
        StencilClient(api_url=gateway.url, api_key="stk_000000000000_" + "x" * 43).job(handle.id).record()


# -- add-ons and catalogs --------------------------------------------------------------------------------

def test_loras_and_controlnets_are_registered_per_tenant(stack: EmbeddedStack, gateway: Gateway, saved_model: Path,
                                                         tmp_path: Path) -> None:
    from tests.support.controlnets import save_controlnet
    from tests.support.loras import save_sd_lora
    from tests.support.pipes import sd_pipe

    tenant = tenant_name("addon")
    admin, user = make_key(stack, tenant, "admin,read,submit"), make_key(stack, tenant)
    other = make_key(stack, tenant_name("other"), "admin,read,submit")
    pipe = sd_pipe(saved_model)
    net = save_controlnet(pipe.unet, tmp_path / "net", seed=4)  # before the LoRA wraps the UNet's layers
    lora = save_sd_lora(pipe, tmp_path / "lora", rank=4, seed=3, std=0.1)
    files = {"adapter": ("a.safetensors", lora.read_bytes())}
    try:
        assert requests.post(gateway.url + "/v1/loras", headers=auth(user), files=files, data={"id": "ink"},
                             timeout=300).status_code == 403
        added = requests.post(gateway.url + "/v1/loras", headers=auth(admin), files=files, data={"id": "ink"},
                              timeout=300)
        assert added.status_code == 201, added.text
        assert added.json()["id"] == "ink" and added.json()["components"]["unet"]["ranks"] == [4]
        refused = requests.post(gateway.url + "/v1/loras", headers=auth(admin), data={"id": "evil"}, timeout=300,
                                files={"adapter": ("a.bin", b"\x80\x04\x95" + b"x" * 100)})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_adapter"
        cn_files = {"config": ("config.json", (net / "config.json").read_bytes()),
                    "weights": ("w.safetensors", (net / "diffusion_pytorch_model.safetensors").read_bytes())}
        cn = requests.post(gateway.url + "/v1/controlnets", headers=auth(admin), files=cn_files, data={"id": "edges"},
                           timeout=600)
        assert cn.status_code == 201 and cn.json()["id"] == "edges", cn.text
        listed = {kind: [m["id"] for m in requests.get(gateway.url + f"/v1/{kind}", headers=auth(user),
                                                       timeout=10).json()] for kind in ("loras", "controlnets")}
        assert listed == {"loras": ["ink"], "controlnets": ["edges"]}
        assert requests.get(gateway.url + "/v1/loras", headers=auth(other), timeout=10).json() == []
        # Controls name their images as file parts, one each, in order.
        mismatch = submit(gateway, user, image=template(50), steps=3, controls=json.dumps([{"id": "edges"}]))
        assert mismatch.status_code == 422 and mismatch.json()["error"]["parameter"] == "controls"
        job = submit(gateway, user, image=template(50), steps=3, loras="ink:0.8")
        assert job.status_code == 201, job.text
        assert json.loads(job.json()["record"]["loras"]) == [["ink", 0.8]]
        assert wait_done(gateway, user, job.json()["id"])["status"] == "done"
        theirs = submit(gateway, other, image=template(50), steps=2, loras="ink:0.8")  # not their adapter
        assert wait_done(gateway, other, theirs.json()["id"])["status"] == "failed"
    finally:  # the shared stack's other tests list every stored add-on
        for prefix in (f"loras/{tenant}.", f"controlnets/{tenant}."):
            stack_store(stack).delete_prefix(prefix)


def stack_store(stack: EmbeddedStack) -> Any:
    from app.storage import open_store

    return open_store(stack.settings)


def test_catalog_over_http_is_fed_within_the_quota(stack: EmbeddedStack, gateway: Gateway, tmp_path: Path) -> None:
    key = make_key(stack, tenant_name("cat"), max_jobs=1)
    url, h = gateway.url, auth(key)
    assert requests.post(url + "/v1/templates", headers=h, files={"image": ("t.png", png(template(52)))},
                         data={"id": "stored"}, timeout=10).status_code == 201
    rows = [{"id": "r0", "template": "a.png", "mask": "m0.png", "prompt": "x", "steps": 2},
            {"id": "r1", "template": "b.png", "mask": "m1.png", "steps": 3, "seed": 4},
            {"id": "r2", "template": "stored", "mask": "m0.png", "steps": 2}]
    manifest = "".join(json.dumps(r) + "\n" for r in rows).encode()
    files = [("manifest", ("catalog.jsonl", manifest)), ("files", ("a.png", png(template(53)))),
             ("files", ("b.png", png(template(54)))), ("files", ("m0.png", png(make_mask(0.2, (SIZE, SIZE), seed=5)))),
             ("files", ("m1.png", png(make_mask(0.3, (SIZE, SIZE), seed=6))))]
    created = requests.post(url + "/v1/catalogs", headers=h, files=files, timeout=30)
    assert created.status_code == 201, created.text
    catalog = created.json()
    assert catalog["rows"] == 3 and catalog["submitted"] == 1  # the quota holds one job at a time
    updates = events(gateway, key, f"/v1/catalogs/{catalog['id']}/events")
    assert updates[-1][1]["complete"] and updates[-1][1]["status"] == {"done": 3}
    assert any(u["status"].get("pending") for _, u in updates[:-1])
    items = requests.get(url + f"/v1/catalogs/{catalog['id']}?items=true", headers=h, timeout=10).json()["items"]
    assert [i["row"] for i in items] == ["r0", "r1", "r2"] and all(i["status"] == "done" for i in items)
    assert requests.get(url + f"/v1/jobs/{items[1]['job_id']}", headers=h, timeout=10).json()["record"]["seed"] == "4"
    other = make_key(stack, tenant_name("cat2"))
    assert requests.get(url + f"/v1/catalogs/{catalog['id']}", headers=auth(other), timeout=10).status_code == 404

    # A row naming a server file, or one that is not there, refuses the whole catalog; nothing is stored.
    r = stack.redis()
    before = len(r.keys("stencil:catalog:*"))
    for bad, why in (({"template": "/etc/hosts", "mask": "m0.png"}, ("must name an uploaded file",)),
                     ({"template": "a.png", "mask": "../m0.png"}, ("must name an uploaded file", "not found")),
                     ({"template": "a.png", "mask": "m0.png", "steps": 0}, ("steps: must be between",)),
                     ({"template": "nope", "mask": "m0.png"}, ("'nope' not found",))):
        body = (json.dumps(rows[0]) + "\n" + json.dumps({"id": "bad", **bad}) + "\n").encode()
        resp = requests.post(url + "/v1/catalogs", headers=h, files=[("manifest", ("c.jsonl", body)), *files[1:]],
                             timeout=30)
        assert resp.status_code == 422 and "row 1 (bad)" in resp.json()["error"]["message"], resp.text
        assert any(w in resp.json()["error"]["message"] for w in why), resp.text
    assert len(r.keys("stencil:catalog:*")) == before


# -- webhooks ------------------------------------------------------------------------------------------

class Receiver(BaseHTTPRequestHandler):
    """Answers 500 to the first delivery of each event, then 204 (a receiver that was briefly down)."""

    calls: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        event = self.headers["Stencil-Event-Id"]
        first = not any(c["event"] == event for c in self.calls)
        self.calls.append({"event": event, "signature": self.headers["Stencil-Signature"], "body": body,
                           "at": time.monotonic()})
        self.send_response(500 if first else 204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def receiver() -> Iterator[str]:
    Receiver.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


def test_webhooks_are_signed_and_retried_by_the_sender(stack: EmbeddedStack, gateway: Gateway, receiver: str) -> None:
    from app.gateway.tenants import Tenants
    from app.webhooks import verify_signature

    tenant = tenant_name("hook")
    key = make_key(stack, tenant)
    stack.start_webhook_sender(STENCIL_WEBHOOK_ALLOW_PRIVATE="1")
    try:
        job = submit(gateway, key, image=template(55), steps=3, webhook_url=receiver).json()
        failing = submit(gateway, key, image=template(55), mask=np.ones((64, 64), bool), steps=3,
                         webhook_url=receiver).json()
        deadline = time.monotonic() + 90
        events_wanted = {f"{job['id']}.done", f"{failing['id']}.failed"}
        while Counter(c["event"] for c in Receiver.calls) != {e: 2 for e in events_wanted}:
            assert time.monotonic() < deadline, Receiver.calls
            time.sleep(0.2)
        time.sleep(0.5)  # a third (wrong) delivery would show up now
    finally:
        stack.kill("webhook-sender", signal.SIGTERM)
    secret = Tenants(stack.redis(), stack.settings).webhook_secret(tenant)
    by_event: dict[str, list[dict[str, Any]]] = {}
    for call in Receiver.calls:
        by_event.setdefault(call["event"], []).append(call)
    assert set(by_event) == {f"{job['id']}.done", f"{failing['id']}.failed"}
    for event, calls in by_event.items():
        assert len(calls) == 2, event  # 500 first, then delivered
        assert calls[1]["at"] - calls[0]["at"] >= 0.7  # backoff: 1 s +-20 %
        for call in calls:
            assert verify_signature(secret or "", call["signature"], call["body"])
            assert not verify_signature("whsec_wrong", call["signature"], call["body"])
            assert not verify_signature(secret or "", call["signature"], call["body"] + b" ")
        payload = json.loads(calls[1]["body"])
        assert payload["type"] == "job." + event.rsplit(".", 1)[1] and payload["job"]["id"] == event.rsplit(".", 1)[0]
        assert calls[0]["body"] == calls[1]["body"]
    failed_payload = json.loads(by_event[f"{failing['id']}.failed"][0]["body"])
    assert "does not match image size" in failed_payload["job"]["error"]
    record = requests.get(gateway.url + f"/v1/jobs/{job['id']}", headers=auth(key), timeout=10).json()["record"]
    assert record["webhook_status"] == "delivered" and record["webhook_attempts"] == "2"


# -- the README's walkthrough -----------------------------------------------------------------------

def test_the_readme_curl_walkthrough_runs_as_written(stack: EmbeddedStack, gateway: Gateway, tmp_path: Path) -> None:
    import re

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- api-walkthrough -->\n```bash\n(.*?)```", readme, flags=re.S)
    assert block, "README.md has no api-walkthrough block"
    script = block.group(1)
    assert "curl" in script and "python" not in script
    tenant = tenant_name("readme")
    key = make_key(stack, tenant)
    Image.fromarray(np.asarray(template(62))).save(tmp_path / "template.png")
    Image.fromarray(make_mask(0.2, (SIZE, SIZE), "blob", seed=7).astype(np.uint8) * 255).save(tmp_path / "mask.png")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin", "STENCIL": gateway.url, "KEY": key})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert '"status":"done"' in run.stdout and "event: update" in run.stdout
    with Image.open(tmp_path / "result.png") as result:
        assert result.format == "PNG" and result.size == (SIZE, SIZE)
    listed = json.loads(run.stdout[run.stdout.rindex('{"jobs":'):])  # curl prints no newline of its own
    assert [j["status"] for j in listed["jobs"]] == ["done", "done"]
    assert listed["jobs"][0]["template_id"] == "shoe" and listed["jobs"][0]["record"]["idempotency_key"] == "order-17"
