"""Catalog processing: ``stencil catalog edit MANIFEST`` and ``stencil catalog warm MANIFEST``.

A catalog is thousands of edits run overnight. What matters, and why the code is shaped so:

- Streaming. The manifest (CSV, JSONL, or a folder of ``x.png`` + ``x.mask.png``) is read row
  by row and at most ``--in-flight`` jobs exist at once, so 10,000 rows cost neither the client's
  memory nor Redis's (job records expire by the service's TTL; inputs are deleted when a job ends).
- Rate limit = cluster capacity. Default in-flight limit: GPU workers x max batch x 2, enough to
  keep every engine's batch full while the CPU workers prepare the next jobs, without flooding
  the queues (priority and fairness for other users stay meaningful).
- Resumable. A row's idempotency key hashes (manifest identity, row id or index, row content
  including the template and mask bytes). The report is appended and flushed row by row; a rerun
  skips rows the report says are done, and resubmitting a row that is still running (or finished
  after the client died) returns the same job through the service's idempotency key: it is
  re-waited, never recomputed.
- Templates given as files are stored once (content-addressed id) and referenced by id, so the
  service sees template reuse (and its activation cache can work) instead of 10,000 uploads.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from app.adapters import DEFAULT_MAX_LORAS, adapter_set
from app.controls import control_spec
from app.fidelity import POLICIES, check_policy
from app.jobs import JobParams

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
PARAM_FIELDS = ("prompt", "negative_prompt", "steps", "guidance", "strength", "seed", "priority", "fidelity",
                "loras")
TERMINAL = ("done", "failed", "cancelled", "expired")
# Report statuses besides the job statuses: the client gave up waiting (the job may still run;
# a rerun re-waits it), the row could not be submitted, or the job record vanished.
CLIENT_STATUSES = ("timeout", "invalid", "lost")
WARM_KEY_PREFIX = "stencil:warm:"


class ManifestError(ValueError):
    """The manifest as a whole is unusable (missing, unknown format)."""


@dataclass(frozen=True)
class Defaults:
    """Values for columns a row leaves empty (CLI flags); the service's own job defaults."""

    prompt: str = JobParams.prompt
    negative_prompt: str = JobParams.negative_prompt
    steps: int = JobParams.steps
    guidance: float = JobParams.guidance
    strength: float = JobParams.strength
    seed: int = JobParams.seed
    priority: int = JobParams.priority
    fidelity: str = JobParams.fidelity
    loras: tuple[tuple[str, float], ...] = ()


@dataclass
class Row:
    """One manifest row, normalised. ``error`` set = the row cannot be submitted (reported)."""

    index: int
    row_id: str
    template: str = ""
    template_is_path: bool = False
    mask: Path | None = None
    params: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _to_int(value: Any) -> int:
    """``4``, ``"4"`` and ``"4.0"`` are 4; ``"4.5"`` is an error, not a silent 4."""
    number = float(value) if isinstance(value, str) else value
    if isinstance(number, float):
        if not number.is_integer():
            raise ValueError(f"{value!r} is not an integer")
        return int(number)
    return int(number)


def _convert(raw: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    """The row's job parameters, typed; empty cells take the defaults."""
    types: dict[str, Callable[[Any], Any]] = {"prompt": str, "negative_prompt": str, "steps": _to_int,
                                              "guidance": float, "strength": float, "seed": _to_int,
                                              "priority": _to_int, "fidelity": check_policy,
                                              "loras": lambda v: adapter_set(v, DEFAULT_MAX_LORAS)}
    out: dict[str, Any] = {}
    for name in PARAM_FIELDS:
        value = raw.get(name)
        if value is None or (isinstance(value, str) and value.strip() == ""):
            out[name] = getattr(defaults, name)
        else:
            out[name] = types[name](value)
    if not out["loras"]:  # rows without adapters keep the parameters (and idempotency keys) they had
        del out["loras"]
    return out


class Manifest:
    """A catalog's rows, streamed. ``identity`` names the catalog in idempotency keys."""

    def __init__(self, path: Path | str, catalog_id: str | None = None) -> None:
        self.path = Path(path).resolve()
        if not self.path.exists():
            raise ManifestError(f"manifest {self.path} does not exist")
        if self.path.is_dir():
            self.kind = "folder"
        elif self.path.suffix.lower() in (".jsonl", ".ndjson"):
            self.kind = "jsonl"
        elif self.path.suffix.lower() in (".csv", ".tsv"):
            self.kind = "csv"
        else:
            with open(self.path, encoding="utf-8") as fh:
                first = fh.read(1)
            self.kind = "jsonl" if first == "{" else "csv"
        self.base = self.path if self.kind == "folder" else self.path.parent
        self.identity = catalog_id or str(self.path)
        self.fingerprint = hashlib.sha256(self.identity.encode()).hexdigest()[:12]

    # -- raw rows --------------------------------------------------------------------------
    def raw_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(index, raw fields) one at a time; a row that cannot be parsed gives ``{"__error__": ...}``."""
        if self.kind == "folder":
            yield from self._folder_rows()
            return
        with open(self.path, encoding="utf-8", newline="") as fh:
            if self.kind == "csv":
                dialect = "excel-tab" if self.path.suffix.lower() == ".tsv" else "excel"
                for index, rec in enumerate(csv.DictReader(fh, dialect=dialect)):
                    yield index, {(k or "").strip(): v for k, v in rec.items()}
                return
            index = 0
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError("a JSONL row must be an object")
                except ValueError as exc:
                    rec = {"__error__": f"unparseable JSONL row: {exc}"}
                yield index, rec
                index += 1

    def _folder_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        # Names only (not images) are sorted, for a stable order; 10,000 names are ~1 MB.
        names = sorted(e.name for e in os.scandir(self.path)
                       if e.is_file() and e.name.lower().endswith(IMAGE_SUFFIXES)
                       and ".mask." not in e.name.lower())
        for index, name in enumerate(names):
            stem = name.rsplit(".", 1)[0]
            mask = next((self.path / f"{stem}.mask{s}" for s in IMAGE_SUFFIXES
                         if (self.path / f"{stem}.mask{s}").is_file()), None)
            rec: dict[str, Any] = {"id": stem, "template": name, "mask": mask.name if mask else ""}
            sidecar = self.path / f"{stem}.json"
            if sidecar.is_file():
                try:
                    rec.update({k: v for k, v in json.loads(sidecar.read_text()).items()
                                if k not in ("id", "template", "mask")})
                except ValueError as exc:
                    rec["__error__"] = f"unparseable sidecar {sidecar.name}: {exc}"
            if mask is None:
                rec["__error__"] = f"no mask beside {name} (expected {stem}.mask.png)"
            yield index, rec

    def count(self) -> int:
        """Number of rows, by a streaming pass (for the progress bar)."""
        return sum(1 for _ in self.raw_rows())

    # -- normalised rows -------------------------------------------------------------------
    def rows(self, defaults: Defaults = Defaults()) -> Iterator[Row]:
        for index, raw in self.raw_rows():
            row_id = str(raw.get("id") or "").strip() or f"#{index}"
            row = Row(index=index, row_id=row_id)
            if raw.get("__error__"):
                row.error = str(raw["__error__"])
                yield row
                continue
            try:
                row.params = _convert(raw, defaults)
                template = str(raw.get("template") or "").strip()
                mask = str(raw.get("mask") or "").strip()
                if not template:
                    raise ValueError("no template")
                if not mask:
                    raise ValueError("no mask")
                row.template, row.template_is_path = self._template(template)
                row.mask = self._file(mask, "mask")
                if raw.get("controls"):
                    row.params["controls"] = self._controls(raw["controls"])
            except (ValueError, TypeError, OverflowError) as exc:
                row.error = f"bad row: {exc}"
            yield row

    def _controls(self, value: Any) -> list[list[Any]]:
        """A row's controls: ``id:image[:scale[:start:end]]`` separated by ``;`` (CSV) or a JSON list of
        ``{"id", "image", "scale", "start", "end"}`` (JSONL); images resolved beside the manifest."""
        if isinstance(value, str):
            items: list[Any] = []
            for part in filter(None, (p.strip() for p in value.split(";"))):
                fields = part.split(":")
                if len(fields) not in (2, 3, 5):
                    raise ValueError(f"control {part!r} is not id:image[:scale[:start:end]]")
                items.append([fields[0], fields[1], *map(float, fields[2:])])
        elif isinstance(value, list):
            items = value
        else:
            raise ValueError("controls must be a list or 'id:image[:scale]' text")
        out = []
        for item in items:
            (cid, scale, start, end), image = control_spec(item)
            out.append([cid, str(self._file(str(image), "control image")), scale, start, end])
        return out

    def _file(self, value: str, what: str) -> Path:
        path = Path(value).expanduser()
        path = path if path.is_absolute() else self.base / path
        if not path.is_file():
            raise ValueError(f"{what} file {value!r} not found")
        return path

    def _template(self, value: str) -> tuple[str, bool]:
        """A template file (uploaded once) or a stored template id."""
        path = Path(value).expanduser()
        path = path if path.is_absolute() else self.base / path
        if path.is_file():
            return str(path), True
        if "/" in value or "\\" in value or value.lower().endswith(IMAGE_SUFFIXES):
            raise ValueError(f"template file {value!r} not found")
        return value, False


class _Digests:
    """sha256 of files, remembered by (path, size, mtime) in a bounded LRU."""

    def __init__(self, limit: int = 4096) -> None:
        self._memo: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        self._limit = limit

    def of(self, path: Path, data: bytes | None = None) -> str:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in self._memo:
            self._memo.move_to_end(key)
            return self._memo[key]
        digest = hashlib.sha256(data if data is not None else path.read_bytes()).hexdigest()
        self._memo[key] = digest
        if len(self._memo) > self._limit:
            self._memo.popitem(last=False)
        return digest


def row_key(manifest: Manifest, row: Row, template_ref: str, mask_digest: str) -> str:
    """The row's idempotency key: catalog, row id (or index) and everything that shapes the result."""
    content = json.dumps({"v": 1, "catalog": manifest.identity, "row": row.row_id, "params": row.params,
                          "template": template_ref, "mask": mask_digest}, sort_keys=True, separators=(",", ":"))
    return f"catalog:{manifest.fingerprint}:{hashlib.sha256(content.encode()).hexdigest()[:40]}"


def default_in_flight(settings: Any) -> int:
    """GPU workers x max batch x 2: full batches on every engine plus one batch being prepared."""
    return max(1, len(settings.gpu_worker_ids) * settings.max_batch * 2)


# -- the report ------------------------------------------------------------------------------

def read_report(path: Path) -> dict[str, tuple[str, int]]:
    """(status, attempt) of the last line per row key; ~200 bytes a row, so 10,000 rows are ~2 MB.
    A torn last line (the writer was killed mid-write) is ignored."""
    entries: dict[str, tuple[str, int]] = {}
    if not path.is_file():
        return entries
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("key"):
                entries[rec["key"]] = (sys.intern(str(rec.get("status"))), int(rec.get("attempt") or 0))
    return entries


class _Progress:
    """tqdm on stderr (rate and ETA), or nothing."""

    def __init__(self, total: int, enabled: bool, stream: IO[str]) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="row", file=stream, dynamic_ncols=True, smoothing=0.05,
                            mininterval=0.5, desc="catalog")

    def update(self, n: int, **postfix: int) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class EditOptions:
    out_dir: Path | None = None  # default: <manifest>.catalog/ beside the manifest
    in_flight: int = 0  # 0 = default_in_flight(settings)
    poll_seconds: float = 0.2
    job_timeout: float = 0.0  # 0 = wait as long as it takes
    retry_failed: bool = False
    progress: bool = True
    save_results: Path | None = None
    catalog_id: str | None = None


@dataclass
class _Pending:
    row: Row
    key: str
    idem: str
    attempt: int
    submitted: float
    created: bool


@dataclass
class _Stats:
    rows: int = 0
    skipped_done: int = 0
    carried_failed: int = 0
    submitted: int = 0
    rewaited: int = 0
    max_in_flight: int = 0
    finished_this_run: int = 0
    status: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def count(self, status: str) -> None:
        self.status[status] = self.status.get(status, 0) + 1


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def pct(p: float) -> float:
        return round(s[min(len(s) - 1, int(round(p * (len(s) - 1))))], 4)

    return {"mean": round(sum(s) / len(s), 4), "p50": pct(0.5), "p95": pct(0.95), "max": round(s[-1], 4)}


class CatalogRun:
    """One ``catalog edit`` run: submit, follow, report. ``run()`` returns the summary."""

    def __init__(self, client: Any, manifest: Manifest, defaults: Defaults, options: EditOptions,
                 *, stderr: IO[str] | None = None) -> None:
        self.client = client
        self.manifest = manifest
        self.defaults = defaults
        self.opt = options
        self.limit = options.in_flight or default_in_flight(client.settings)
        self.out_dir = options.out_dir or manifest.base / f"{manifest.path.name}.catalog"
        self.report_path = self.out_dir / "report.jsonl"
        self.summary_path = self.out_dir / "summary.json"
        self.stderr = stderr or sys.stderr
        self.digests = _Digests()
        self.stored_templates: OrderedDict[str, str] = OrderedDict()  # template digest -> id
        self.stats = _Stats()
        self.pending: dict[str, list[_Pending]] = {}  # job id -> rows waiting on it
        self.stop_requested = False
        self.started = time.time()

    # -- submission ------------------------------------------------------------------------
    def _template_ref(self, row: Row) -> tuple[str, str]:
        """(value for submit, value for the key): a stored id for both; files are stored once."""
        if not row.template_is_path:
            return row.template, "id:" + row.template
        path = Path(row.template)
        digest = self.digests.of(path)
        template_id = self.stored_templates.get(digest)
        if template_id is None:
            template_id = f"tpl-{digest[:32]}"
            self.client.add_template(path.read_bytes(), template_id)
            self.stored_templates[digest] = template_id
            if len(self.stored_templates) > 4096:
                self.stored_templates.popitem(last=False)
        return template_id, "sha256:" + digest

    def _prepare(self, row: Row) -> tuple[str, bytes] | None:
        """(idempotency key, mask bytes); None if the row's files cannot be read (``row.error``).

        The key uses the template's digest or id only, so skipping a done row uploads nothing."""
        if row.mask is None:
            row.error = "no mask"
            return None
        try:
            mask = row.mask.read_bytes()
            if row.template_is_path:
                template_part = "sha256:" + self.digests.of(Path(row.template))
            else:
                template_part = "id:" + row.template
        except OSError as exc:
            row.error = f"cannot read the row's files: {exc}"
            return None
        return row_key(self.manifest, row, template_part, hashlib.sha256(mask).hexdigest()), mask

    def _submit(self, row: Row, key: str, mask: bytes, attempt: int) -> None:
        template, _ = self._template_ref(row)
        idem = key if attempt == 0 else f"{key}:{attempt}"
        handle = self.client.submit(template=template, mask=mask, idempotency_key=idem, **_with_files(row.params))
        if handle.created:
            self.stats.submitted += 1
        else:
            self.stats.rewaited += 1
        self.pending.setdefault(handle.id, []).append(
            _Pending(row, key, idem, attempt, time.monotonic(), handle.created))

    def _in_flight(self) -> int:
        return sum(len(v) for v in self.pending.values())

    # -- results ---------------------------------------------------------------------------
    def _write(self, fh: IO[str], line: dict[str, Any]) -> None:
        fh.write(json.dumps(line, sort_keys=True) + "\n")
        fh.flush()

    def _finish(self, fh: IO[str], p: _Pending, job_id: str | None, status: str,
                rec: Any = None, reason: str | None = None) -> None:
        latency = None
        output_key = None
        if rec is not None:
            output_key = rec.result_key
            reason = reason or rec.error
            end = rec.ts(rec.status) if rec.status.terminal else None
            start = rec.ts("queued")
            if end is not None and start is not None:
                latency = round(end - start, 4)
                self.stats.latencies.append(latency)
        if status == "done" and output_key and self.opt.save_results is not None:
            self._save_result(p.row, output_key)
        self._write(fh, {"row": p.row.row_id, "index": p.row.index, "status": status, "job_id": job_id,
                         "output_key": output_key, "latency_s": latency, "reason": reason, "key": p.key,
                         "idempotency_key": p.idem, "attempt": p.attempt, "rewaited": bool(job_id) and not p.created,
                         "finished_at": round(time.time(), 3)})
        self.stats.count(status)
        self.stats.finished_this_run += 1

    def _save_result(self, row: Row, output_key: str) -> None:
        assert self.opt.save_results is not None
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in row.row_id.lstrip("#")) or str(row.index)
        try:
            (self.opt.save_results / f"{safe}.png").write_bytes(self.client.store.get(output_key))
        except Exception as exc:  # the report still says done; the file can be fetched later
            log.warning("row %s: could not save %s: %s", row.row_id, output_key, exc)

    def _poll(self, fh: IO[str]) -> int:
        """Report jobs that ended; returns how many rows finished."""
        if not self.pending:
            return 0
        statuses = self.client.jobs.statuses(list(self.pending))
        finished = 0
        now = time.monotonic()
        for job_id, status in statuses.items():
            waiting = self.pending[job_id]
            if status is None:
                for p in self.pending.pop(job_id):
                    self._finish(fh, p, job_id, "lost", reason="the job record is gone (expired or deleted)")
                    finished += 1
            elif status.terminal:
                rec = self.client.jobs.get(job_id)
                for p in self.pending.pop(job_id):
                    self._finish(fh, p, job_id, status.value, rec)
                    finished += 1
            elif self.opt.job_timeout and now - waiting[0].submitted > self.opt.job_timeout:
                for p in self.pending.pop(job_id):
                    self._finish(fh, p, job_id, "timeout",
                                 reason=f"still {status.value} after {self.opt.job_timeout:.0f}s (a rerun re-waits it)")
                    finished += 1
        return finished

    # -- the loop ------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Process the manifest. ``stop_after``: return after that many rows finished in this run,
        leaving submitted jobs running (an interruption, for tests and partial runs)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.opt.save_results is not None:
            self.opt.save_results.mkdir(parents=True, exist_ok=True)
        previous = read_report(self.report_path)
        total = self.manifest.count()
        log.info("catalog %s: %d rows, %d already reported, at most %d in flight",
                 self.manifest.path, total, len(previous), self.limit)
        progress = _Progress(total, self.opt.progress, self.stderr)
        rows = self.manifest.rows(self.defaults)
        exhausted = False
        interrupted = False
        try:
            with open(self.report_path, "a", encoding="utf-8") as fh:
                while True:
                    done_now = 0
                    while not exhausted and not self.stop_requested and self._in_flight() < self.limit:
                        row = next(rows, None)
                        if row is None:
                            exhausted = True
                            break
                        done_now += self._take(fh, row, previous)
                    self.stats.max_in_flight = max(self.stats.max_in_flight, self._in_flight())
                    if stop_after is not None and self.stats.finished_this_run >= stop_after:
                        interrupted = True
                        break
                    if not self.pending and (exhausted or self.stop_requested):
                        interrupted = self.stop_requested and not exhausted
                        break
                    finished = self._poll(fh)
                    done_now += finished
                    progress.update(done_now, done=self.stats.status.get("done", 0) + self.stats.skipped_done,
                                    failed=self._failed_count(), inflight=self._in_flight())
                    if not finished:
                        time.sleep(self.opt.poll_seconds)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            progress.close()
            summary = self._summary(total, interrupted or bool(self.pending))
            self._write_summary(summary)
        return summary

    def _take(self, fh: IO[str], row: Row, previous: dict[str, tuple[str, int]]) -> int:
        """Skip, report or submit one row; returns rows finished without a job (0 or 1)."""
        self.stats.rows += 1
        prepared = None if row.error else self._prepare(row)
        if prepared is None:
            p = _Pending(row, f"invalid:{self.manifest.fingerprint}:{row.row_id}", "", 0, time.monotonic(), False)
            self._finish(fh, p, None, "invalid", reason=row.error)
            return 1
        key, mask = prepared
        before = previous.get(key)
        attempt = 0
        if before is not None:
            status, attempt = before
            if status == "done":
                self.stats.skipped_done += 1
                return 1
            if status in ("failed", "cancelled", "expired"):
                if not self.opt.retry_failed:
                    self.stats.carried_failed += 1
                    self.stats.count(status)
                    return 1
                attempt += 1
            elif status == "lost":
                attempt += 1
            # "timeout" / "invalid": same key; the service returns the running job if any.
        try:
            self._submit(row, key, mask, attempt)
        except Exception as exc:  # the service refused the submission: report, go on
            log.warning("row %s: submission failed: %s", row.row_id, exc)
            p = _Pending(row, key, key, attempt, time.monotonic(), False)
            self._finish(fh, p, None, "invalid", reason=f"submission failed: {type(exc).__name__}: {exc}")
            return 1
        return 0

    def _failed_count(self) -> int:
        return sum(v for k, v in self.stats.status.items() if k != "done")

    def _summary(self, total: int, interrupted: bool) -> dict[str, Any]:
        elapsed = time.time() - self.started
        counts = dict(self.stats.status)
        counts["done"] = counts.get("done", 0) + self.stats.skipped_done
        accounted = sum(counts.values())
        return {
            "manifest": str(self.manifest.path), "catalog_id": self.manifest.identity,
            "fingerprint": self.manifest.fingerprint, "rows": total, "rows_seen": self.stats.rows,
            "status": counts, "accounted": accounted, "complete": not interrupted and accounted == total,
            "interrupted": interrupted, "in_flight_left": self._in_flight(),
            "skipped_done": self.stats.skipped_done, "carried_failed": self.stats.carried_failed,
            "submitted": self.stats.submitted, "rewaited": self.stats.rewaited,
            "finished_this_run": self.stats.finished_this_run, "in_flight_limit": self.limit,
            "max_in_flight": self.stats.max_in_flight, "elapsed_s": round(elapsed, 3),
            "rows_per_s": round(self.stats.finished_this_run / elapsed, 3) if elapsed > 0 else 0.0,
            "latency_s": _percentiles(self.stats.latencies), "report": str(self.report_path),
        }

    def _write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.summary_path)


def run_edit(client: Any, manifest_path: Path | str, *, defaults: Defaults = Defaults(),
             options: EditOptions | None = None, stop_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) ``catalog edit``; returns the summary (also written to summary.json)."""
    options = options or EditOptions()
    manifest = Manifest(manifest_path, options.catalog_id)
    return CatalogRun(client, manifest, defaults, options).run(stop_after=stop_after)


# -- warm ------------------------------------------------------------------------------------

def _warm_params(params: dict[str, Any]) -> dict[str, Any]:
    """What a template's activation cache depends on (DESIGN.md section 2: cache validity)."""
    out = {"steps": params["steps"], "strength": params["strength"], "guidance": params["guidance"],
           "cfg": params["guidance"] > 1.0}
    if params.get("loras"):  # add-ons change every token's activations: a cache per add-on set
        out["loras"] = [list(p) for p in params["loras"]]
    if params.get("controls"):
        out["controls"] = params["controls"]
    return out


def _with_files(params: dict[str, Any]) -> dict[str, Any]:
    """Row parameters as the client takes them (control images as files to upload)."""
    if not params.get("controls"):
        return params
    return {**params, "controls": [(c[0], Path(c[1]), *c[2:]) for c in params["controls"]]}


def _region_params(params: dict[str, Any], mask: bytes) -> dict[str, Any]:
    """What makes a region warm-up exact for a row's edit (``app/fidelity.py``): its mask, prompt,
    negative prompt and seed on top of the cache parameters."""
    return {**_warm_params(params), "mask_sha256": hashlib.sha256(mask).hexdigest(), "prompt": params["prompt"],
            "negative_prompt": params["negative_prompt"], "seed": params["seed"]}


def _warm_via_client(client: Any, template_id: str, params: dict[str, Any], mask: bytes | None = None) -> Any:
    """The service's warm-up job (``StencilClient.warm_template``); returns its handle. With a
    mask, a region warm-up with the row's prompt, negative prompt and seed."""
    addons = {"loras": params.get("loras") or (), "controls": _with_files(params).get("controls") or ()}
    if mask is None:
        return client.warm_template(template_id, steps=params["steps"], guidance=params["guidance"],
                                    strength=params["strength"], **addons)
    return client.warm_template(template_id, steps=params["steps"], guidance=params["guidance"],
                                strength=params["strength"], mask=mask, prompt=params["prompt"],
                                negative_prompt=params["negative_prompt"], seed=params["seed"], **addons)


def run_warm(client: Any, manifest_path: Path | str, *, defaults: Defaults = Defaults(),
             catalog_id: str | None = None, out_dir: Path | None = None, in_flight: int = 0,
             timeout: float | None = None, warm: Callable[..., Any] | None = None,
             regions: bool = False) -> dict[str, Any]:
    """Record a warm-up intent per distinct (template, cache parameters), then warm each one.

    ``regions``: one warm-up per distinct (template, region) instead, recorded with the row's mask,
    prompt, negative prompt and seed, so that the catalog's edits take the exact path.

    Intents go to Redis (``stencil:warm:<template id>``, field = parameter digest) before any
    warm-up runs, so whatever builds caches can find them even if this command cannot warm.
    Warm-ups that return a job handle run at most ``in_flight`` at a time (default as for
    ``edit``) and are waited for; ``<out>/warm.jsonl`` gets one line per intent with its outcome.
    ``warm`` replaces the service's warm-up job (tests, other cache builders).
    """
    manifest = Manifest(manifest_path, catalog_id)
    run = CatalogRun(client, manifest, defaults, EditOptions(out_dir=out_dir, progress=False))
    run.out_dir.mkdir(parents=True, exist_ok=True)
    warm = warm or _warm_via_client
    limit = in_flight or run.limit
    seen: set[str] = set()
    counts = {"intents": 0, "warmed": 0, "failed": 0, "invalid_rows": 0}
    pending: list[tuple[dict[str, Any], Any]] = []

    def settle(fh: IO[str], intent: dict[str, Any], handle: Any) -> None:
        if handle is not None and callable(getattr(handle, "wait", None)):
            rec = handle.wait(timeout)
            intent.update(job_id=handle.id, status="warmed" if rec.status.value == "done" else rec.status.value,
                          reason=rec.error)
        else:
            intent["status"] = "warmed"
        counts["warmed" if intent["status"] == "warmed" else "failed"] += 1
        fh.write(json.dumps(intent, sort_keys=True) + "\n")
        fh.flush()

    with open(run.out_dir / "warm.jsonl", "a", encoding="utf-8") as fh:
        for row in manifest.rows(defaults):
            if row.error:
                counts["invalid_rows"] += 1
                continue
            template_id, _ = run._template_ref(row)
            mask = row.mask.read_bytes() if regions and row.mask is not None else None
            params = _warm_params(row.params) if mask is None else _region_params(row.params, mask)
            digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
            if f"{template_id}:{digest}" in seen:
                continue
            seen.add(f"{template_id}:{digest}")
            intent = {"template": template_id, "params": params, "requested_at": round(time.time(), 3),
                      "catalog": manifest.identity, "status": "requested"}
            client.redis.hset(WARM_KEY_PREFIX + template_id, digest, json.dumps(intent, sort_keys=True))
            counts["intents"] += 1
            pending.append((intent, warm(client, template_id, params, mask) if mask is not None
                            else warm(client, template_id, params)))
            if len(pending) >= limit:
                settle(fh, *pending.pop(0))
        for intent, handle in pending:
            settle(fh, intent, handle)
    return {"manifest": str(manifest.path), **counts}


# -- CLI ---------------------------------------------------------------------------------------

def _client():  # type: ignore[no-untyped-def]
    from app.client import StencilClient

    return StencilClient()


def _defaults(args: argparse.Namespace) -> Defaults:
    return Defaults(prompt=args.prompt, negative_prompt=args.negative_prompt, steps=args.steps,
                    guidance=args.guidance, strength=args.strength, seed=args.seed, priority=args.priority,
                    fidelity=args.fidelity, loras=adapter_set(args.loras, DEFAULT_MAX_LORAS))


def cmd_catalog_edit(args: argparse.Namespace) -> int:
    options = EditOptions(out_dir=Path(args.out) if args.out else None, in_flight=args.in_flight,
                          poll_seconds=args.poll, job_timeout=args.job_timeout, retry_failed=args.retry_failed,
                          progress=not args.no_progress,
                          save_results=Path(args.save_results) if args.save_results else None,
                          catalog_id=args.catalog_id)
    run = CatalogRun(_client(), Manifest(args.manifest, args.catalog_id), _defaults(args), options)

    def on_term(*_: object) -> None:  # stop submitting, wait for the jobs in flight, write the summary
        run.stop_requested = True

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        summary = run.run()
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted: rerun the same command to resume ({run.summary_path})\n")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stdout.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if summary["interrupted"]:
        return 130
    return 0 if summary["status"].get("done", 0) == summary["rows"] else 1


def cmd_catalog_warm(args: argparse.Namespace) -> int:
    summary = run_warm(_client(), args.manifest, defaults=_defaults(args), catalog_id=args.catalog_id,
                       out_dir=Path(args.out) if args.out else None, in_flight=args.in_flight,
                       timeout=args.job_timeout or None, regions=args.regions)
    sys.stdout.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0 if summary["failed"] == 0 else 1


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", help="CSV or JSONL (columns: template, mask, prompt, negative_prompt, steps, "
                                    "guidance, strength, seed, priority, fidelity, loras, controls, id) or a folder "
                                    "of x.png + x.mask.png")
    p.add_argument("--out", default=None, help="report folder (default: <manifest>.catalog/ beside it)")
    p.add_argument("--catalog-id", default=None,
                   help="the catalog's identity in idempotency keys (default: the manifest's absolute path)")
    p.add_argument("--prompt", default="", help="default for rows without a prompt")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--strength", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--fidelity", default="", choices=("", *POLICIES),
                   help="exact | balanced | fast for rows without one (default: the service's)")
    p.add_argument("--loras", default="", help="LoRA adapters for rows without a loras column, e.g. "
                                               "'papercut:0.8;filmic:0.5'")


def add_catalog_commands(subparsers: Any) -> None:
    """Register ``catalog edit`` and ``catalog warm`` on an argparse subparsers object."""
    catalog = subparsers.add_parser("catalog", help="process a catalog (manifest or folder) of edits")
    sub = catalog.add_subparsers(dest="catalog_command", required=True)
    e = sub.add_parser("edit", help="submit every row, rate-limited and resumable; write a report")
    _add_common(e)
    e.add_argument("--in-flight", type=int, default=0,
                   help="jobs in flight at most (default: GPU workers x max batch x 2)")
    e.add_argument("--poll", type=float, default=0.2, help="seconds between status polls")
    e.add_argument("--job-timeout", type=float, default=0.0,
                   help="stop waiting for a job after this many seconds (0 = no limit; a rerun re-waits)")
    e.add_argument("--retry-failed", action="store_true", help="resubmit rows that failed in an earlier run")
    e.add_argument("--save-results", default=None, help="also download each result to DIR/<row id>.png")
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.set_defaults(func=cmd_catalog_edit)
    w = sub.add_parser("warm", help="warm the template caches a catalog needs (one warm-up per template "
                                    "and cache parameters)")
    _add_common(w)
    w.add_argument("--in-flight", type=int, default=0, help="warm-ups in flight at most (default as for edit)")
    w.add_argument("--job-timeout", type=float, default=0.0, help="seconds to wait for one warm-up (0 = no limit)")
    w.add_argument("--regions", action="store_true",
                   help="one warm-up per (template, region): recorded with each row's mask, prompt and seed, "
                        "so those edits are exact (default: one per template, edits approximate)")
    w.set_defaults(func=cmd_catalog_warm)


def main(argv: list[str] | None = None) -> int:
    """``python -m app.catalog edit|warm ...`` (the same as ``stencil catalog edit|warm ...``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("edit", "warm"):
        argv = ["catalog", *argv]
    parser = argparse.ArgumentParser(prog="stencil")
    parser.add_argument("--log-level", default=os.environ.get("STENCIL_LOG_LEVEL", "INFO"))
    add_catalog_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
