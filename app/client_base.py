"""What the Python client over Redis (``app/client.py``) and over HTTP (``app/http_client.py``)
share: the job handle, the errors, image encoding and the methods built on ``submit``.

A ``JobHandle`` asks its client for the record, the wait, the result and the cancellation, so a
handle behaves the same whichever way its client reaches the service.
"""

from __future__ import annotations

import hashlib
import io
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from app.jobs import JobRecord, JobStatus
from app.masks import mask_from_array

ImageLike = bytes | Image.Image | np.ndarray | Path


class InvalidAdapter(ValueError):
    """An add-on (LoRA adapter, ControlNet) the service refused (format, shapes that do not fit...)."""


class JobFailed(RuntimeError):
    """The job ended in failed, cancelled or expired; ``record`` holds the reason."""

    def __init__(self, record: JobRecord) -> None:
        super().__init__(f"job {record.id} {record.status.value}: {record.error or 'no reason given'}")
        self.record = record


def controlnet_folder(folder: Path) -> Path:
    """A diffusers ControlNetModel folder with safetensors weights, else ``InvalidAdapter``."""
    from app.controls import CONTROL_FILES

    folder = Path(folder)
    missing = [n for n in CONTROL_FILES if not (folder / n).is_file()]
    if missing:
        raise InvalidAdapter(f"{folder.name}: not a diffusers ControlNetModel folder with safetensors weights "
                             f"(missing {', '.join(missing)}; pickle-based .bin weights are refused)")
    return folder


def content_id(data: bytes, prefix: str) -> str:
    """Content id of template bytes (``UPLOAD_PREFIX``: uploaded with a job, warmed when seen again;
    ``TEMPLATE_PREFIX``: added as a template, warmed on its first edit)."""
    return prefix + hashlib.sha256(data).hexdigest()[:32]


def image_bytes(value: ImageLike, *, mask: bool) -> bytes:
    """Encoded image bytes (PNG unless given as bytes or a file); numpy masks: True/nonzero = edit."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, Path):
        return value.read_bytes()
    if isinstance(value, np.ndarray):
        if mask:
            value = mask_from_array(value)
        else:
            value = Image.fromarray(np.asarray(value, dtype=np.uint8))
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"expected bytes, a PIL image, a numpy array or a Path, got {type(value).__name__}")


def wait_until_terminal(read: Any, job_id: str, timeout: float | None, poll: float) -> JobRecord:
    """Poll ``read()`` (a job record) until the job is terminal; TimeoutError after ``timeout`` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        rec = read()
        if rec.status.terminal:
            return rec
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {rec.status.value} after {timeout}s")
        time.sleep(poll)


class JobHandle:
    """A submitted job. Cheap to create from an id (``client.job(id)``)."""

    def __init__(self, client: "ClientBase", job_id: str, created: bool = True) -> None:
        self.client = client
        self.id = job_id
        self.created = created

    def __repr__(self) -> str:
        return f"JobHandle({self.id})"

    def record(self) -> JobRecord:
        """The job's record; raises ``KeyError`` if it does not exist (or expired)."""
        return self.client._record(self.id)

    def status(self) -> JobStatus:
        return self.record().status

    def progress(self) -> tuple[int, int]:
        """(steps done, total steps)."""
        return self.record().progress

    def wait(self, timeout: float | None = None, poll: float = 0.05) -> JobRecord:
        """Block until the job is terminal; returns its record. Raises TimeoutError."""
        return self.client._wait(self.id, timeout, poll)

    def result_bytes(self) -> bytes:
        return self.client._result_bytes(self.id)

    def result(self) -> Image.Image:
        """The edited image (PIL). Raises ``JobFailed`` for failed/cancelled/expired jobs."""
        return Image.open(io.BytesIO(self.result_bytes()))

    def cancel(self) -> bool:
        """Cancel a queued or running job; False if it had already ended."""
        return self.client._cancel(self.id)


class ClientBase(ABC):
    """The methods built on ``submit`` and the job handle's questions, which each client answers."""

    @abstractmethod
    def submit(self, **kwargs: Any) -> JobHandle: ...

    def submit_many(self, requests: Iterable[Mapping[str, Any]]) -> list[JobHandle]:
        """Submit several jobs (each mapping holds ``submit``'s keyword arguments)."""
        return [self.submit(**dict(req)) for req in requests]

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id, created=False)

    def wait_all(self, handles: Iterable[JobHandle], timeout: float | None = None) -> list[JobRecord]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for handle in handles:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(handle.wait(remaining))
        return out

    @abstractmethod
    def _record(self, job_id: str) -> JobRecord: ...

    def _wait(self, job_id: str, timeout: float | None, poll: float) -> JobRecord:
        return wait_until_terminal(lambda: self._record(job_id), job_id, timeout, poll)

    @abstractmethod
    def _result_bytes(self, job_id: str) -> bytes: ...

    @abstractmethod
    def _cancel(self, job_id: str) -> bool: ...
