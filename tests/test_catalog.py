"""Catalog processing (app/catalog.py): manifests, keys, streaming, and an interrupted 200-row
catalog on the embedded stack that a rerun completes without redoing finished rows."""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from app.catalog import (
    Defaults,
    EditOptions,
    Manifest,
    Row,
    add_catalog_commands,
    default_in_flight,
    read_report,
    row_key,
    run_edit,
    run_warm,
)
from app.jobs import JobParams, JobRecord, JobStatus
from app.maskgen import make_mask
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
SIZE = 64
COLUMNS = ["id", "template", "mask", "prompt", "negative_prompt", "steps", "guidance", "strength", "seed",
           "priority"]


log = logging.getLogger(__name__)

def _png(path: Path, arr: np.ndarray) -> Path:
    Image.fromarray(arr).save(path)
    return path


def make_template(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    arr = np.stack([np.sin(xx * rng.uniform(2, 8)), np.cos(yy * rng.uniform(2, 8)),
                    np.sin((xx + yy) * rng.uniform(2, 8))], axis=-1)
    return _png(path, ((arr * 0.5 + 0.5) * 255).astype(np.uint8))


def make_mask_png(path: Path, seed: int, ratio: float = 0.2) -> Path:
    shape = ("rect", "blob", "stroke")[seed % 3]
    return _png(path, make_mask(ratio, (SIZE, SIZE), shape, seed=seed).astype(np.uint8) * 255)


def write_catalog(folder: Path, rows: int, stored_template: str | None = None) -> Path:
    """A CSV catalog: 4 template files (plus a stored id on every 10th row), one mask per row."""
    folder.mkdir(parents=True, exist_ok=True)
    templates = [make_template(folder / f"template{t}.png", t).name for t in range(4)]
    manifest = folder / "catalog.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for i in range(rows):
            mask = make_mask_png(folder / f"m{i:04d}.png", seed=i, ratio=0.1 + 0.05 * (i % 5)).name
            template = stored_template if (stored_template and i % 10 == 0) else templates[i % 4]
            w.writerow({"id": "" if i % 7 == 3 else f"sku-{i:04d}",  # some rows fall back to their index
                        "template": template, "mask": mask, "prompt": f"product {i}", "negative_prompt": "",
                        "steps": 2 + i % 3, "guidance": 7.5 if i % 2 else 1.0, "strength": 1.0, "seed": i,
                        "priority": 0})
    return manifest


# -- manifests and keys (no service) ------------------------------------------------------------

def test_csv_jsonl_and_folder_manifests_normalise_the_same_rows(tmp_path: Path) -> None:
    make_template(tmp_path / "a.png", 1)
    make_mask_png(tmp_path / "a.mask.png", 1)
    (tmp_path / "a.json").write_text(json.dumps({"prompt": "a scarf", "steps": 3}))
    make_template(tmp_path / "b.png", 2)
    make_mask_png(tmp_path / "b.mask.png", 2)
    make_template(tmp_path / "lonely.png", 3)  # no mask beside it: reported, not fatal
    (tmp_path / "m.csv").write_text("id,template,mask,prompt,steps,seed\n"
                                    "a,a.png,a.mask.png,a scarf,3,\n"
                                    ",stored-template-7,b.mask.png,,4.0,9\n"
                                    "bad,a.png,a.mask.png,x,4.5,0\n"
                                    "gone,missing.png,a.mask.png,x,2,0\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"id": "a", "template": "a.png", "mask": "a.mask.png",
                                                  "prompt": "a scarf", "steps": 3}) + "\n\n{not json\n")
    d = Defaults(steps=20, seed=5)

    csv_rows = list(Manifest(tmp_path / "m.csv").rows(d))
    assert [r.row_id for r in csv_rows] == ["a", "#1", "bad", "gone"]
    assert csv_rows[0].template == str(tmp_path / "a.png") and csv_rows[0].template_is_path
    assert csv_rows[0].params == {"prompt": "a scarf", "negative_prompt": "", "steps": 3, "guidance": 7.5,
                                  "strength": 1.0, "seed": 5, "priority": 0, "fidelity": ""}
    assert csv_rows[1].template == "stored-template-7" and not csv_rows[1].template_is_path
    assert csv_rows[1].params["steps"] == 4 and csv_rows[1].params["seed"] == 9
    assert "not an integer" in (csv_rows[2].error or "")
    assert "not found" in (csv_rows[3].error or "")

    jsonl_rows = list(Manifest(tmp_path / "m.jsonl").rows(d))
    assert jsonl_rows[0].params == csv_rows[0].params and jsonl_rows[0].mask == csv_rows[0].mask
    assert "unparseable" in (jsonl_rows[1].error or "")

    folder_rows = list(Manifest(tmp_path).rows(d))
    assert [r.row_id for r in folder_rows] == ["a", "b", "lonely"]
    assert folder_rows[0].params["prompt"] == "a scarf" and folder_rows[0].params["steps"] == 3
    assert folder_rows[0].mask == tmp_path / "a.mask.png"
    assert folder_rows[1].error is None and "no mask beside lonely.png" in (folder_rows[2].error or "")
    assert Manifest(tmp_path).count() == 3 and Manifest(tmp_path / "m.csv").count() == 4


def test_rows_carry_adapters_and_controls_to_the_client(tmp_path: Path) -> None:
    from app.catalog import _with_files

    make_template(tmp_path / "a.png", 1)
    make_mask_png(tmp_path / "a.mask.png", 1)
    make_mask_png(tmp_path / "edges.png", 2)
    (tmp_path / "m.csv").write_text("id,template,mask,loras,controls\n"
                                    "a,a.png,a.mask.png,papercut:0.8;filmic,canny:edges.png:0.7\n"
                                    "b,a.png,a.mask.png,,canny:nowhere.png\n"
                                    "c,a.png,a.mask.png,x:y:z,\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({
        "id": "a", "template": "a.png", "mask": "a.mask.png", "loras": [["papercut", 0.8], "filmic"],
        "controls": [{"id": "canny", "image": "edges.png", "scale": 0.7}]}) + "\n")
    csv_rows = list(Manifest(tmp_path / "m.csv").rows(Defaults()))
    jsonl_rows = list(Manifest(tmp_path / "m.jsonl").rows(Defaults()))
    for row in (csv_rows[0], jsonl_rows[0]):
        assert row.error is None, row.error
        assert row.params["loras"] == (("filmic", 1.0), ("papercut", 0.8))
        assert row.params["controls"] == [["canny", str(tmp_path / "edges.png"), 0.7, 0.0, 1.0]]
        assert _with_files(row.params)["controls"][0][1] == tmp_path / "edges.png"
    assert "control image file 'nowhere.png' not found" in (csv_rows[1].error or "")
    assert "loras" in (csv_rows[2].error or "")


def test_row_key_depends_on_catalog_row_and_content(tmp_path: Path) -> None:
    (tmp_path / "m.csv").write_text("id,template,mask\n")
    m = Manifest(tmp_path / "m.csv")
    other = Manifest(tmp_path / "m.csv", catalog_id="another catalog")
    row = Row(index=0, row_id="sku-1", params={"prompt": "x", "steps": 4})
    base = row_key(m, row, "sha256:aa", "bb")
    assert base == row_key(m, row, "sha256:aa", "bb")  # stable across runs
    assert base.startswith(f"catalog:{m.fingerprint}:")
    assert base != row_key(other, row, "sha256:aa", "bb")
    assert base != row_key(m, row, "sha256:ab", "bb")  # template bytes changed
    assert base != row_key(m, row, "sha256:aa", "bc")  # mask bytes changed
    row.params = {"prompt": "y", "steps": 4}
    assert base != row_key(m, row, "sha256:aa", "bb")  # prompt changed


def test_manifest_of_10000_rows_streams_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    make_template(tmp_path / "t.png", 0)
    make_mask_png(tmp_path / "m.png", 0)
    with open(path, "w") as fh:
        for i in range(10_000):
            fh.write(json.dumps({"id": f"r{i}", "template": "t.png", "mask": "m.png", "prompt": "x" * 200,
                                 "seed": i}) + "\n")
    manifest = Manifest(path)
    tracemalloc.start()
    try:
        assert manifest.count() == 10_000
        n = sum(1 for row in manifest.rows() if row.error is None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 10_000
    assert peak < 2_000_000, f"iterating 10,000 rows peaked at {peak} bytes: rows are being held"


class StandInService:
    """An in-memory stand-in for StencilClient, for the client-side loop at 10,000-row scale only
    (the service itself is exercised on the real stack below). A job ends on its first poll. It
    keeps ~100 bytes per job (a hash and a status byte), so tracemalloc measures the client."""

    def __init__(self, gpu_workers: str = "0", max_batch: int = 4) -> None:
        self.settings = Settings(gpu_workers=gpu_workers, max_batch=max_batch)
        self.idem: dict[int, int] = {}  # hash(idempotency key) -> job number
        self.done = bytearray()  # per job number: 0 = running, 1 = done, 2 = to fail, 3 = failed
        self.templates: set[str] = set()
        self.open_jobs = 0
        self.max_open = 0
        self.jobs = self

    def add_template(self, data: bytes, template_id: str) -> str:
        self.templates.add(template_id)
        return template_id

    def submit(self, *, template: str, mask: bytes, idempotency_key: str, **params: object):  # type: ignore[no-untyped-def]
        assert isinstance(template, str) and template in self.templates | {"stored"}
        n = self.idem.get(hash(idempotency_key))
        if n is not None:
            return SimpleNamespace(id=f"job{n}", created=False)
        n = self.idem[hash(idempotency_key)] = len(self.done)
        self.done.append(2 if "fail" in str(params.get("prompt")) else 0)
        self.open_jobs += 1
        self.max_open = max(self.max_open, self.open_jobs)
        return SimpleNamespace(id=f"job{n}", created=True)

    def statuses(self, job_ids: list[str]):  # type: ignore[no-untyped-def]
        for j in job_ids:
            n = int(j[3:])
            if self.done[n] in (0, 2):
                self.done[n] += 1
                self.open_jobs -= 1
        return {j: JobStatus.DONE if self.done[int(j[3:])] == 1 else JobStatus.FAILED for j in job_ids}

    def get(self, job_id: str):  # type: ignore[no-untyped-def]
        if self.done[int(job_id[3:])] == 3:
            return JobRecord(id=job_id, status=JobStatus.FAILED, params=JobParams(),
                             fields={"ts_queued": "1.0", "ts_failed": "1.25", "error": "denoising failed: boom"})
        return JobRecord(id=job_id, status=JobStatus.DONE, params=JobParams(),
                         fields={"ts_queued": "1.0", "ts_done": "1.5", "result_key": f"results/{job_id}.png"})


def test_10000_row_catalog_keeps_bounded_client_memory_and_in_flight(tmp_path: Path) -> None:
    make_template(tmp_path / "t.png", 0)
    make_mask_png(tmp_path / "m.png", 0)
    rows = 10_000
    with open(tmp_path / "big.jsonl", "w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": f"r{i}", "template": "t.png" if i % 3 else "stored", "mask": "m.png",
                                 "prompt": "x" * 100, "seed": i, "steps": 2}) + "\n")
    service = StandInService(gpu_workers="0,1", max_batch=4)
    options = EditOptions(out_dir=tmp_path / "out", poll_seconds=0.0, progress=False)
    tracemalloc.start()
    try:
        summary = run_edit(service, tmp_path / "big.jsonl", options=options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary["complete"] and summary["status"] == {"done": rows} and summary["submitted"] == rows
    assert service.max_open <= 16 == summary["in_flight_limit"]  # 2 GPU workers x batch 4 x 2
    assert len(service.templates) == 1, "a template file must be stored once, not per row"
    assert peak < 4_000_000, f"client memory peaked at {peak / 1e6:.1f} MB for {rows} rows"
    assert len((tmp_path / "out" / "report.jsonl").read_text().splitlines()) == rows
    # The rerun skips everything, reading the report back in bounded memory too.
    tracemalloc.start()
    try:
        again = run_edit(service, tmp_path / "big.jsonl", options=options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert again["skipped_done"] == rows and again["submitted"] == 0 and len(service.done) == rows
    assert peak < 4_000_000, f"rerun peaked at {peak / 1e6:.1f} MB"


def test_failed_and_invalid_rows_are_reported_and_retried_only_on_request(tmp_path: Path) -> None:
    make_template(tmp_path / "t.png", 0)
    make_mask_png(tmp_path / "m.png", 0)
    rows = [{"id": f"r{i}", "template": "t.png", "mask": "m.png", "prompt": "fail" if i in (2, 5) else "ok"}
            for i in range(8)]
    rows[6]["mask"] = "missing.png"
    rows[7]["steps"] = "many"
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    service = StandInService()
    opts = EditOptions(out_dir=tmp_path / "out", poll_seconds=0.0, progress=False)

    first = run_edit(service, tmp_path / "c.jsonl", options=opts)
    assert first["status"] == {"done": 4, "failed": 2, "invalid": 2} and first["complete"]
    report = [json.loads(x) for x in (tmp_path / "out" / "report.jsonl").read_text().splitlines()]
    by_row = {r["row"]: r for r in report}
    assert by_row["r2"]["reason"] == "denoising failed: boom" and by_row["r2"]["job_id"]
    assert "not found" in by_row["r6"]["reason"] and by_row["r6"]["job_id"] is None
    assert "many" in by_row["r7"]["reason"]

    second = run_edit(service, tmp_path / "c.jsonl", options=opts)  # failures carried, nothing resubmitted
    assert second["submitted"] == 0 and second["skipped_done"] == 4 and second["carried_failed"] == 2
    assert second["status"] == first["status"] and len(service.done) == 6

    third = run_edit(service, tmp_path / "c.jsonl",
                     options=EditOptions(out_dir=tmp_path / "out", poll_seconds=0.0, progress=False, retry_failed=True))
    assert third["submitted"] == 2 and len(service.done) == 8  # a new attempt (new key) per failed row
    retried = [json.loads(x) for x in (tmp_path / "out" / "report.jsonl").read_text().splitlines()][-4:]
    assert {(r["row"], r["attempt"]) for r in retried if r["job_id"]} == {("r2", 1), ("r5", 1)}
    assert all(r["idempotency_key"].endswith(":1") for r in retried if r["job_id"])


def test_report_reader_keeps_the_last_line_and_ignores_a_torn_one(tmp_path: Path) -> None:
    report = tmp_path / "report.jsonl"
    report.write_text(json.dumps({"key": "k1", "status": "timeout", "job_id": "j1", "attempt": 0}) + "\n"
                      + json.dumps({"key": "k1", "status": "done", "job_id": "j1", "attempt": 0}) + "\n"
                      + '{"key": "k2", "status": "do')
    assert read_report(report) == {"k1": ("done", 0)}


def test_cli_registration_and_default_capacity() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_catalog_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["catalog", "edit", "x.csv", "--in-flight", "5", "--steps", "3"])
    assert args.in_flight == 5 and args.steps == 3 and callable(args.func)
    args = parser.parse_args(["catalog", "warm", "x.csv"])
    assert args.func.__name__ == "cmd_catalog_warm"
    assert default_in_flight(Settings(gpu_workers="0,1", max_batch=8)) == 32
    assert default_in_flight(Settings(gpu_workers="0", max_batch=4)) == 8


def test_warm_records_one_intent_per_template_and_parameters(tmp_path: Path, redis_server,  # type: ignore[no-untyped-def]
                                                             redis_client) -> None:
    from app.client import StencilClient

    client = StencilClient(Settings(redis_url=redis_server.url, store_dir=tmp_path / "store"))
    manifest = write_catalog(tmp_path / "cat", rows=12)
    run_warm(client, manifest, out_dir=tmp_path / "out", warm=lambda c, template, params: None)
    keys = sorted(k.decode() for k in redis_client.scan_iter("stencil:warm:*"))
    assert len(keys) == 4  # 4 distinct template files -> 4 stored templates
    intents = [json.loads(v) for k in keys for v in redis_client.hvals(k)]
    # One intent per template and cache parameters: steps 2-4, CFG on odd rows only.
    assert len(intents) == 12 and {(i["params"]["steps"], i["params"]["cfg"]) for i in intents} >= {(2, False),
                                                                                                    (3, True)}
    assert len((tmp_path / "out" / "warm.jsonl").read_text().splitlines()) == len(intents)
    calls = []
    summary = run_warm(client, manifest, out_dir=tmp_path / "out2",
                       warm=lambda c, template, params: calls.append((template, params)))
    assert summary["warmed"] == len(calls) == len(intents) and summary["failed"] == 0


@pytest.mark.integration
def test_catalog_warm_runs_the_warm_ups_on_the_stack(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from app.client import StencilClient

    client = StencilClient(stack.settings)
    manifest = write_catalog(tmp_path / "cat", rows=8)
    out = tmp_path / "out"
    summary = run_warm(client, manifest, out_dir=out, in_flight=3, timeout=240)
    assert summary["intents"] == 8 and summary["warmed"] == 8 and summary["failed"] == 0, summary
    lines = [json.loads(x) for x in (out / "warm.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and all(x["status"] == "warmed" and x["job_id"] for x in lines)
    for x in lines:
        rec = client.jobs.get(x["job_id"])
        assert rec is not None and rec.status == JobStatus.DONE and rec.fields.get("kind") == "warm"
        assert rec.fields["template_id"] == x["template"] and int(rec.fields["steps"]) == x["params"]["steps"]
        recorded = [json.loads(v) for v in stack.redis().hvals(f"stencil:warm:{x['template']}")]
        assert x["params"] in [i["params"] for i in recorded], "the intent was not recorded in Redis"


@pytest.mark.integration
def test_catalog_region_warm_ups_make_the_catalog_edits_exact(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``catalog warm --regions``: one warm-up per (template, region) with the row's mask, prompt and
    seed; the same catalog's edits then take the exact path (not the approximate template cache)."""
    from app.catalog import CatalogRun, Defaults, EditOptions, Manifest
    from app.client import StencilClient

    client = StencilClient(stack.settings)
    manifest = write_catalog(tmp_path / "cat", rows=4)
    summary = run_warm(client, manifest, out_dir=tmp_path / "warm", in_flight=2, timeout=240, regions=True)
    assert summary["intents"] == 4 and summary["warmed"] == 4, summary
    run = CatalogRun(client, Manifest(manifest), Defaults(), EditOptions(out_dir=tmp_path / "edit", progress=False))
    result = run.run()
    assert result["status"].get("done") == 4, result
    lines = [json.loads(x) for x in (tmp_path / "edit" / "report.jsonl").read_text().splitlines()]
    for line in lines:
        rec = client.jobs.get(line["job_id"])
        assert rec is not None and rec.fields["cache_path"] == "exact", rec.fields
        assert rec.fields["approximate"] == "0" and int(rec.fields["masked_steps"]) > 0


# -- the real thing: 200 rows on the embedded stack, interrupted and resumed ---------------------

def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def watch_progress(report: Path, target: int, proc: subprocess.Popen, err: Path, stall: float = 150.0) -> None:
    """Until ``report`` has ``target`` lines; fails if the process dies first or nothing new is
    reported for ``stall`` seconds (stuck, as opposed to slow)."""
    seen, last_change = -1, time.monotonic()
    while True:
        n = len(_lines(report))
        if n >= target:
            return
        if n != seen:
            seen, last_change = n, time.monotonic()
        if proc.poll() is not None:
            assert n >= target, f"catalog exited ({proc.returncode}) at {n} rows: {err.read_text()[-3000:]}"
        assert time.monotonic() - last_change < stall, f"no row finished in {stall:.0f}s (at {n} rows)"
        time.sleep(0.1)


@pytest.mark.integration
def test_catalog_interrupted_and_resumed_on_the_stack(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from app.client import StencilClient

    client = StencilClient(stack.settings)
    stored = client.add_template(Image.open(make_template(tmp_path / "stored.png", 99)))
    rows = 200
    manifest = write_catalog(tmp_path / "catalog", rows, stored_template=stored)
    out = tmp_path / "out"
    report = out / "report.jsonl"
    limit = 8
    cmd = [sys.executable, "-m", "app.catalog", "edit", str(manifest), "--out", str(out), "--in-flight", str(limit),
           "--poll", "0.05"]
    env = stack.env()

    # Run 1, killed (SIGKILL: no chance to clean up) once about half the rows are reported. The
    # watchdog fails on a stall, not on slowness: a busy 2-core box can be several times slower.
    t0 = time.time()
    with open(tmp_path / "run1.err", "w") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            watch_progress(report, rows // 2, proc, tmp_path / "run1.err")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    killed_at = time.time()
    run1 = {r["row"]: r for r in _lines(report)}
    assert rows // 2 <= len(run1) < rows
    assert all(r["status"] == "done" for r in run1.values()), [r for r in run1.values() if r["status"] != "done"]
    r = stack.redis()
    prefix = f"stencil:idem:catalog:{Manifest(manifest).fingerprint}:"
    submitted_run1 = {k.decode()[len("stencil:idem:"):]: r.get(k).decode() for k in r.scan_iter(prefix + "*")}
    in_flight_at_kill = set(submitted_run1) - {x["idempotency_key"] for x in run1.values()}
    assert 0 < len(in_flight_at_kill) <= limit, "the kill should leave jobs in flight (re-waited by the rerun)"
    run1_seconds = killed_at - t0
    err1 = (tmp_path / "run1.err").read_text()
    assert "row/s" in err1 or "s/row" in err1, "progress bar with a rate on stderr"

    # Run 2: the same command resumes and completes.
    t1 = time.time()
    with open(tmp_path / "run2.out", "w") as out2, open(tmp_path / "run2.err", "w") as err2:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out2, stderr=err2, start_new_session=True)
        try:
            watch_progress(report, rows, proc, tmp_path / "run2.err")
            assert proc.wait(60) == 0, (tmp_path / "run2.err").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    run2_seconds = time.time() - t1
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads((tmp_path / "run2.out").read_text())
    assert summary["complete"] and summary["status"] == {"done": rows} and summary["accounted"] == rows
    assert summary["skipped_done"] == len(run1)
    assert summary["rewaited"] >= len(in_flight_at_kill)
    assert summary["submitted"] + summary["rewaited"] == rows - len(run1)
    assert summary["max_in_flight"] <= limit

    # The report accounts for every row exactly once; finished rows kept their job ids.
    lines = _lines(report)
    by_row: dict[str, list[dict]] = {}
    for line in lines:
        by_row.setdefault(line["row"], []).append(line)
    assert len(by_row) == rows and all(len(v) == 1 for v in by_row.values()), "a row was reported twice"
    ids = {f"sku-{i:04d}" if i % 7 != 3 else f"#{i}" for i in range(rows)}
    assert set(by_row) == ids
    for row_id, first in run1.items():
        assert by_row[row_id][0]["job_id"] == first["job_id"]
    for line in lines:
        assert line["status"] == "done" and line["output_key"] and line["latency_s"] > 0
        assert submitted_run1.get(line["idempotency_key"], line["job_id"]) == line["job_id"], \
            "a row submitted before the kill got a new job"

    # No job was created twice, and every result exists in the object store.
    idem_now = {k.decode()[len("stencil:idem:"):]: r.get(k).decode() for k in r.scan_iter(prefix + "*")}
    assert len(idem_now) == rows and len(set(idem_now.values())) == rows
    jobs = {line["job_id"]: client.jobs.get(line["job_id"]) for line in lines}
    assert all(rec is not None and rec.status.value == "done" for rec in jobs.values())
    for row_id, first in run1.items():
        assert jobs[first["job_id"]].ts("queued") < killed_at, f"{row_id} was recomputed after the kill"
    assert all(client.store.exists(line["output_key"]) for line in lines[:: max(1, rows // 20)])

    # Rate limit, checked from the service's own timestamps: run 1 never had more than `limit`
    # jobs between submission and completion at once.
    run1_jobs = [rec for rec in jobs.values() if rec.ts("queued") < killed_at]
    assert _max_overlap([(rec.ts("queued"), rec.ts("done")) for rec in run1_jobs]) <= limit

    # A third run has nothing to do.
    again = run_edit(client, manifest, options=EditOptions(out_dir=out, progress=False))
    assert again["skipped_done"] == rows and again["submitted"] == again["rewaited"] == 0
    log.info(f"catalog: run 1 {len(run1)} rows in {run1_seconds:.1f}s (killed), "
          f"run 2 {rows - len(run1)} rows in {run2_seconds:.1f}s, latency {summary['latency_s']}")
