"""Load through the HTTP gateway: edits submitted over HTTP by concurrent clients on a real stack.

    python -m ops.bench.api_load --edits 1000 --clients 8 --steps 5 --out docs/bench/api_load.md

An embedded stack (redis-server, one Celery CPU worker, one GPU worker on the CPU, the dispatcher),
``stencil api`` and ``stencil webhook-sender`` as real processes, the inference processes at a lower
CPU priority (``--worker-nice``: on this 2-core machine they share the cores the gateway runs on,
where a deployment gives the gateway its own); the tiny default model
(``STENCIL_MODEL_ID``), 128 px templates. ``--clients`` threads, in two tenants with the shipped
limits (rate, burst, job quota), each in a loop: submit an edit (a template upload with its mask,
``POST /v1/edits``), follow it (``GET /v1/jobs/{id}/events``) to its end, read it
(``GET /v1/jobs/{id}``) and fetch its result (``GET .../result``), until ``--edits`` were submitted.
Latency of each request is measured at the client, from sending to the whole answer (for the event
stream: to its first event), so the edit's own time is never in it; RSS of the gateway and of the
workers (each process group: prefork children included) is sampled every second. Checked after the
run: every job done, exactly one result object per job and none else, no job lost (each tenant's
listing holds exactly the jobs its clients submitted).
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import requests
from PIL import Image

from app.demo import demo_templates
from app.embedded import EmbeddedStack, free_port
from app.gateway.apikeys import ApiKeys
from app.gateway.tenants import Tenants
from app.maskgen import make_mask
from app.settings import Settings
from ops.bench.harness import cli
from ops.bench.harness.timing import cpu_model, uptime

log = logging.getLogger(__name__)

KINDS = ("submit", "events (first event)", "status", "result")
SIZE = 128


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _group(pid: int) -> Iterator[tuple[Path, list[str]]]:
    """(/proc entry, stat fields after the command) of each live process in the group ``pid`` leads
    (a process started in a session of its own and its children)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pid:  # the process group
                yield Path(entry.path), fields


def group_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process group's live processes."""
    return sum(int(f[11]) + int(f[12]) for _, f in _group(pid)) / os.sysconf("SC_CLK_TCK")


def group_rss_mib(pid: int) -> float:
    """Resident memory of a process group."""
    total = 0
    for path, _ in _group(pid):
        try:
            total += next(int(line.split()[1]) for line in (path / "status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


class RssSampler(threading.Thread):
    """RSS of named process groups every ``period`` seconds until stopped."""

    def __init__(self, pids: dict[str, int], period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.period = period
        self.samples: list[dict[str, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.samples.append({name: group_rss_mib(pid) for name, pid in self.pids.items()})


class Client:
    """One client (a thread of its own): submit, follow, read, fetch, while the shared budget lasts."""

    def __init__(self, url: str, key: str, budget: "Budget", steps: int, templates: list[bytes], seed: int) -> None:
        self.url = url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {key}"
        self.budget = budget
        self.steps = steps
        self.templates = templates
        self.rng = np.random.default_rng(seed)
        self.latency: dict[str, list[float]] = {k: [] for k in KINDS}
        self.jobs: list[tuple[str, str]] = []  # (job id, final status)
        self.errors: list[str] = []
        self.throttled = 0

    def request(self, kind: str, method: str, path: str, *, stream: bool = False, **kw: Any) -> requests.Response:
        """One request, its latency recorded (a streamed one: by the caller, at its first event);
        a 429 (the tenant's rate) is waited out as its Retry-After says and counted."""
        while True:
            t0 = time.perf_counter()
            resp = self.session.request(method, self.url + path, timeout=600, stream=stream, **kw)
            if not stream:
                self.latency[kind].append(time.perf_counter() - t0)
            if resp.status_code != 429:
                resp.raise_for_status()
                return resp
            self.throttled += 1
            resp.close()
            time.sleep(float(resp.headers.get("Retry-After", "1")))

    def run(self) -> None:
        while self.budget.take():
            try:
                self.one_edit()
            except Exception as exc:  # counted and reported, the run goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def one_edit(self) -> None:
        template = self.templates[int(self.rng.integers(len(self.templates)))]
        mask = png(Image.fromarray(make_mask(float(self.rng.uniform(0.05, 0.4)), (SIZE, SIZE),
                                             seed=int(self.rng.integers(1 << 30))).astype(np.uint8) * 255))
        files = {"template": ("t.png", template), "mask": ("m.png", mask)}
        data = {"steps": str(self.steps), "prompt": "a red scarf", "seed": str(int(self.rng.integers(1 << 30)))}
        job_id = self.request("submit", "POST", "/v1/edits", files=files, data=data).json()["id"]
        t0 = time.perf_counter()
        with self.request("events", "GET", f"/v1/jobs/{job_id}/events", stream=True) as stream:
            first = True
            for line in stream.iter_lines(decode_unicode=True):
                if first and line.startswith("data:"):
                    self.latency["events (first event)"].append(time.perf_counter() - t0)
                    first = False
        job = self.request("status", "GET", f"/v1/jobs/{job_id}").json()
        if job["status"] == "done":
            result = self.request("result", "GET", f"/v1/jobs/{job_id}/result")
            if not result.content.startswith(b"\x89PNG"):
                self.errors.append(f"job {job_id}: the result is not a PNG")
        self.jobs.append((job_id, job["status"]))


class Budget:
    def __init__(self, n: int) -> None:
        self.left = n
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.left <= 0:
                return False
            self.left -= 1
            return True


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


ROUTES = {"submit": "/v1/edits", "events (first event)": "/v1/jobs/{job_id}/events", "status": "/v1/jobs/{job_id}",
          "result": "/v1/jobs/{job_id}/result"}


def server_latency(metrics_text: str) -> dict[str, dict[str, float]]:
    """The gateway's own view (``stencil_api_request_seconds``: arrival to first byte), per request
    kind: count, and the bucket bounds (ms) the median and the 99th percentile fall in."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "stencil_api_request_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                per = buckets.setdefault(sample.labels["route"], {})
                le = float(sample.labels["le"])
                per[le] = per.get(le, 0.0) + sample.value
    out = {}
    for kind, route in ROUTES.items():
        cumulative = sorted(buckets.get(route, {}).items())
        total = cumulative[-1][1] if cumulative else 0.0

        def bound(q: float) -> float:
            return next((le * 1000 for le, n in cumulative if n >= q * total), float("nan"))

        out[kind] = {"n": total, "p50": bound(0.5), "p99": bound(0.99)}
    return out


def rss_summary(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per process group: the median of the first and last tenth of the run (after the first
    tenth's start-up) and the peak."""
    out = {}
    for name in samples[0] if samples else []:
        series = [s[name] for s in samples]
        tenth = max(1, len(series) // 10)
        start = series[tenth: 2 * tenth] or series[:1]
        first, last = float(np.median(start)), float(np.median(series[-tenth:]))
        out[name] = {"first": first, "last": last, "peak": max(series), "growth": last - first}
    return out


def run_load(args: Any) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="stencil-api-load-"))
    overrides: dict[str, Any] = {"max_batch": args.max_batch, "model_id": args.model}
    with EmbeddedStack.start(workdir, cpu_concurrency=args.cpu_concurrency, **overrides) as stack:
        metrics_port = free_port()
        url = stack.start_api(STENCIL_METRICS_PORT=str(metrics_port))
        stack.start_webhook_sender()
        for name in ("gpu0", "cpu"):  # the inference processes yield the CPU to the gateway (--worker-nice)
            os.setpriority(os.PRIO_PGRP, stack.procs[name].pid, args.worker_nice)
        r = stack.redis()
        tenants = [f"load-{i}" for i in range(args.tenants)]
        keys = {}
        for tenant in tenants:
            keys[tenant], _ = ApiKeys(r).create(tenant, ["submit", "read"], name="api_load")
            Tenants(r, stack.settings).ensure(tenant)
        templates = [png(img) for _, img in demo_templates(SIZE)]
        budget = Budget(args.edits)
        clients = [Client(url, keys[tenants[i % len(tenants)]], budget, args.steps, templates, args.seed + i)
                   for i in range(args.clients)]
        pids = {"gateway": stack.procs["api"].pid, "gpu worker": stack.procs["gpu0"].pid,
                "cpu worker": stack.procs["cpu"].pid, "dispatcher": stack.procs["dispatcher"].pid}
        sampler = RssSampler(pids)
        sampler.start()
        gateway_cpu = group_cpu_s(pids["gateway"])
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(clients), thread_name_prefix="client") as pool:
            list(pool.map(Client.run, clients))
        elapsed = time.monotonic() - t0
        gateway_cpu = group_cpu_s(pids["gateway"]) - gateway_cpu
        sampler.stop.set()
        sampler.join()
        jobs = [j for c in clients for j in c.jobs]
        by_tenant: dict[str, set[str]] = {t: set() for t in tenants}
        for job_id, _ in jobs:
            by_tenant[job_id.split(".")[0]].add(job_id)
        listed = {t: {k.decode() for k in r.zrange(Tenants.jobs_key(t), 0, -1)} for t in tenants}
        server = server_latency(requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)
        results = sorted(p.name for p in (Path(stack.settings.store_dir) / "results").glob("load-*.png"))
    statuses: dict[str, int] = {}
    for _, status in jobs:
        statuses[status] = statuses.get(status, 0) + 1
    latency = {k: [v for c in clients for v in c.latency[k]] for k in KINDS}
    requests_only = [v for k in ("submit", "status", "result") for v in latency[k]]
    return {"elapsed_s": elapsed, "jobs": len(jobs), "statuses": statuses,
            "errors": [e for c in clients for e in c.errors], "throttled": sum(c.throttled for c in clients),
            "one_result_each": results == sorted(f"{j}.png" for j, _ in jobs),
            "none_lost": listed == by_tenant and sum(map(len, listed.values())) == len(jobs) == args.edits,
            "latency": {k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99), "max": pct(v, 100)}
                        for k, v in latency.items()},
            "p99_requests_ms": pct(requests_only, 99), "rss": rss_summary(sampler.samples), "server": server,
            "gateway_cpu_ms_per_edit": gateway_cpu / max(1, len(jobs)) * 1000,
            "samples": len(sampler.samples)}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, out="docs/bench/api_load.md", threads=None, seed=0)
    p.add_argument("--edits", type=int, default=1000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--cpu-concurrency", type=int, default=1)
    p.add_argument("--worker-nice", type=int, default=10,
                   help="CPU priority of the GPU and CPU worker processes (0 = the gateway's): on a small machine "
                        "they share its cores with the gateway, which a deployment gives cores of its own")
    p.add_argument("--model", default=Settings.from_env().model_id, help="default: STENCIL_MODEL_ID")
    run = cli.start(p, argv, __file__, quick=dict(edits=8, clients=2, steps=2))
    args = run.args
    before = uptime()
    limits = Settings.from_env()
    out = run_load(args)
    lat = out["latency"]
    ok = (out["statuses"] == {"done": args.edits} and out["one_result_each"] and out["none_lost"]
          and not out["errors"])
    lines = [f"# HTTP gateway under load ({args.edits} edits, {args.clients} clients)\n",
             f"Command: `{run.command}`. Machine: {cpu_model()}, {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; load before: {before}; "
             f"after: {uptime()}.\n",
             f"Stack: redis-server, 1 CPU worker (concurrency {args.cpu_concurrency}), 1 GPU worker on the CPU "
             f"(max batch {args.max_batch}, both at nice {args.worker_nice}), the dispatcher, `stencil api`, "
             "`stencil webhook-sender`; model "
             f"`{args.model}`, {SIZE} px, {args.steps} steps; {args.clients} client threads in {args.tenants} "
             f"tenants with the limits of the settings ({limits.api_rate_per_s:g} requests/s, burst "
             f"{limits.api_burst}, {limits.api_max_jobs_per_tenant} jobs per tenant).\n",
             f"**{out['jobs']} edits in {out['elapsed_s']:.1f} s ({out['jobs'] / out['elapsed_s']:.2f} edits/s)**; "
             f"statuses {out['statuses']}; exactly one result per job: {'yes' if out['one_result_each'] else 'NO'}; "
             f"no job lost: {'yes' if out['none_lost'] else 'NO'}; client errors: {len(out['errors'])}"
             f"{' (' + '; '.join(out['errors'][:3]) + ')' if out['errors'] else ''}; requests answered 429 (the "
             f"tenant's rate, waited out): {out['throttled']}.\n",
             "Request latency at the client (the edit's own time is not in any of them):\n",
             "| request | n | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    for kind in KINDS:
        v = lat[kind]
        lines.append(f"| {kind} | {v['n']} | {v['p50']:.1f} | {v['p99']:.1f} | {v['max']:.1f} |")
    lines += ["", f"**p99 of submit, status and result requests together: {out['p99_requests_ms']:.1f} ms** "
                  f"(target < 50 ms).\n",
              "The gateway's own view (`stencil_api_request_seconds`: from a request's arrival to its first byte, "
              "histogram bucket bounds):\n", "| request | n | p50 <= ms | p99 <= ms |", "|---|---|---|---|"]
    for kind, v in out["server"].items():
        lines.append(f"| {kind} | {v['n']:.0f} | {v['p50']:g} | {v['p99']:g} |")
    lines += ["", f"Gateway CPU per edit (its submit, status and result requests and its event stream, whose "
                  f"server polls the record every 0.2 s): {out['gateway_cpu_ms_per_edit']:.1f} ms.\n",
              f"RSS per process group ({out['samples']} samples, one a second; first = median of the run's second "
              "tenth, last = median of its last tenth):\n",
              "| process | first MiB | last MiB | growth MiB | peak MiB |", "|---|---|---|---|---|"]
    for name, v in out["rss"].items():
        lines.append(f"| {name} | {v['first']:.0f} | {v['last']:.0f} | {v['growth']:+.0f} | {v['peak']:.0f} |")
    run.write(lines)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
