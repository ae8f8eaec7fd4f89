"""S3 object store (AWS S3, MinIO, SeaweedFS) on boto3.

Why the client is configured the way it is:

- ``request_checksum_calculation`` / ``response_checksum_validation = "when_required"``: boto3
  >= 1.36 otherwise sends CRC trailers that MinIO and other S3-compatible servers reject
  (DESIGN.md section 4). Integrity of tensors is checked end to end by ``tensorfile`` instead.
- Path-style addressing and an explicit region: self-hosted servers have no per-bucket DNS.
- Short connect timeout and few retries: the activation cache is an optimisation. When the store
  is down, a job must fall back to full compute quickly, not hang; so every transport failure
  surfaces as ``StoreUnavailable`` within a few seconds (refused connection: ~0.1-0.3 s with the
  3 attempts' jittered backoff; an endpoint that drops packets: 3 x 1 s connect timeouts plus
  backoff, about 3.5 s typical, 6 s worst case).
- Multipart only above a threshold sized for activation tensors (one block's cache is a few MiB to
  ~50 MiB); below it one ``put_object`` is cheaper (one request, object appears whole).

Atomic visibility is S3's own: a PUT (or a completed multipart upload) appears whole or not at all.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from app.storage.base import ObjectNotFound, ObjectStore, StoreUnavailable

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# A bare "404" (no S3 error body) is trusted only for HEAD, where S3 never sends a body; on GET
# it means something other than S3 answered (a proxy, a wrong endpoint), i.e. unavailable.
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound"}
_DELETE_BATCH = 1000  # S3's limit per DeleteObjects request


def _validate_key(key: str) -> str:
    """Reject keys the local backend rejects too, so both backends accept the same keys."""
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"invalid object key: {key!r}")
    return key


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


class S3Store(ObjectStore):
    """``ObjectStore`` on one S3 bucket. Thread-safe: one boto3 client shared by all threads."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout_s: float = 1.0,
        read_timeout_s: float = 30.0,
        max_attempts: int = 3,
        max_pool_connections: int = 16,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 4,
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url or None
        self.region = region
        config = Config(
            region_name=region,
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # total attempts, first included ("max_attempts" would count retries only)
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max_pool_connections,
            tcp_keepalive=True,
        )
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region,
            aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None,
            config=config,
        )
        self.multipart_threshold = multipart_threshold
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
        )

    @classmethod
    def from_settings(cls, settings: "Settings") -> "S3Store":
        """The store the S3 settings name (docs/configuration.md); empty endpoint means AWS itself."""
        return cls(
            settings.s3_bucket,
            endpoint_url=settings.s3_endpoint_url or None,
            region=settings.s3_region,
            access_key=settings.s3_access_key or None,
            secret_key=settings.s3_secret_key or None,
        )

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, endpoint_url={self.endpoint_url!r})"

    # -- error mapping -------------------------------------------------------------------------

    def _unavailable(self, op: str, key: str, exc: Exception) -> StoreUnavailable:
        """Anything but "no such key" means the cache tier cannot be used right now."""
        if isinstance(exc, ClientError):
            detail = f"{_error_code(exc)} (HTTP {_http_status(exc)})"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        log.warning("s3 %s %s/%s failed: %s", op, self.bucket, key, detail)
        return StoreUnavailable(f"S3 {op} {self.bucket}/{key} at {self.endpoint_url}: {detail}")

    def _is_not_found(self, exc: ClientError) -> bool:
        # NoSuchBucket is a 404 too, but it is a deployment problem, not a missing object.
        return _error_code(exc) in _NOT_FOUND_CODES

    # -- bucket --------------------------------------------------------------------------------

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (idempotent; safe under races)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            if _http_status(exc) != 404 and _error_code(exc) not in {"404", "NoSuchBucket"}:
                raise self._unavailable("head_bucket", "", exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("head_bucket", "", exc) from exc
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region and self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self._client.create_bucket(**kwargs)
            log.info("created bucket %s at %s", self.bucket, self.endpoint_url)
        except ClientError as exc:
            if _error_code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise self._unavailable("create_bucket", "", exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("create_bucket", "", exc) from exc

    # -- objects -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """One PUT below the multipart threshold, a parallel multipart upload above it."""
        _validate_key(key)
        try:
            if len(data) < self.multipart_threshold:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data))
            else:
                self._client.upload_fileobj(
                    io.BytesIO(data), self.bucket, key, Config=self._transfer
                )
        except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
            # S3UploadFailedError: s3transfer's wrapper around a failed multipart upload.
            raise self._unavailable("put", key, exc) from exc

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Whole object, or bytes ``[start, end)`` via one ranged GET (``bytes=start-end-1``).

        Ranges past the end are clipped like a file read: an empty range returns ``b""``.
        """
        _validate_key(key)
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError("negative offsets are not supported")
        begin = start or 0
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if end is not None and end <= begin:
            self.size(key)  # raises ObjectNotFound like the local backend
            return b""
        if start is not None or end is not None:
            kwargs["Range"] = f"bytes={begin}-" if end is None else f"bytes={begin}-{end - 1}"
        try:
            response = self._client.get_object(**kwargs)
            return response["Body"].read()
        except ClientError as exc:
            if self._is_not_found(exc):
                raise ObjectNotFound(key) from exc
            if _error_code(exc) == "InvalidRange":  # start at or past the end (or empty object)
                return b""
            raise self._unavailable("get", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("get", key, exc) from exc

    def _head(self, key: str) -> dict[str, Any] | None:
        _validate_key(key)
        try:
            return self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            # HEAD has no body, so a missing key is a bare 404; a missing bucket looks the same
            # to HEAD, which is acceptable: neither holds the object.
            if self._is_not_found(exc) or _http_status(exc) == 404:
                return None
            raise self._unavailable("head", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("head", key, exc) from exc

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def size(self, key: str) -> int:
        head = self._head(key)
        if head is None:
            raise ObjectNotFound(key)
        return int(head["ContentLength"])

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` in lexicographic order.

        Collected and sorted client-side: SeaweedFS lists in directory-tree order (``a/b``
        before ``a-c``), not S3's byte order, and callers rely on the documented order.
        """
        keys: list[str] = []
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))
        except (ClientError, BotoCoreError) as exc:
            raise self._unavailable("list", prefix, exc) from exc
        yield from sorted(keys)

    def delete(self, key: str) -> None:
        _validate_key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if self._is_not_found(exc):
                return
            raise self._unavailable("delete", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("delete", key, exc) from exc

    def delete_prefix(self, prefix: str) -> int:
        """Batch deletes (1000 keys per request) instead of one request per key."""
        keys = list(self.list(prefix))
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            try:
                response = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            except (ClientError, BotoCoreError) as exc:
                raise self._unavailable("delete_objects", prefix, exc) from exc
            errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise StoreUnavailable(f"S3 delete_objects under {prefix!r} failed: {errors[:3]}")
        return len(keys)

    def close(self) -> None:
        """Release pooled connections."""
        self._client.close()


__all__ = ["S3Store"]
