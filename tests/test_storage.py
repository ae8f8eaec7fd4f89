"""Object stores against a real SeaweedFS S3 server and the local folder, plus tensorfile
integrity and the throttling wrapper. No mocks: every S3 call goes over HTTP to ``weed mini``."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.settings import Settings
from app.storage import LocalStore, ObjectNotFound, ObjectStore, StoreUnavailable, open_store
from app.storage.s3 import S3Store
from app.storage.tensorfile import (
    CorruptObject,
    decode,
    encode,
    read_all,
    read_header,
    read_tensor,
)
from app.storage.throttle import ThrottledStore

try:
    from tests.support.s3server import S3ServerInfo, running_s3_server
except ImportError:  # tests/ itself on sys.path (no package __init__)
    from support.s3server import S3ServerInfo, running_s3_server  # type: ignore[no-redef]

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)
MiB = 1024 * 1024
BUCKET = "stencil-test"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3ServerInfo]:
    with running_s3_server(tmp_path_factory.mktemp("weed")) as info:
        log.info("S3 server up in %.2f s on %s ports=%s", info.startup_s, info.endpoint_url,
                 info.ports)
        yield info


def make_s3(info: S3ServerInfo, bucket: str = BUCKET, **kwargs: int) -> S3Store:
    return S3Store(bucket, endpoint_url=info.endpoint_url, region=info.region,
                   access_key=info.access_key, secret_key=info.secret_key, **kwargs)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalStore(tmp_path / "store")
        return
    s3 = make_s3(request.getfixturevalue("s3_server"))
    s3.ensure_bucket()
    s3.delete_prefix("")  # the bucket is shared by the module's tests
    yield s3
    s3.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flip_byte(store: ObjectStore, key: str, offset: int) -> None:
    data = bytearray(store.get(key))
    data[offset] ^= 0x01
    store.put(key, bytes(data))


# -- ObjectStore contract, both backends -------------------------------------------------------


def test_round_trip_and_overwrite(store: ObjectStore) -> None:
    payload = os.urandom(10_000)
    store.put("jobs/1/input.png", payload)
    assert store.get("jobs/1/input.png") == payload
    assert store.exists("jobs/1/input.png") and store.size("jobs/1/input.png") == 10_000
    store.put("jobs/1/input.png", b"replaced")
    assert store.get("jobs/1/input.png") == b"replaced"
    store.put("empty", b"")
    assert store.get("empty") == b"" and store.size("empty") == 0
    assert store.get("empty", 0, 10) == b""


@pytest.mark.parametrize(
    ("start", "end"),
    [(2, 5), (0, None), (None, 3), (5, None), (8, 100), (20, 30), (5, 5), (7, 3), (0, 10)],
)
def test_ranged_reads_match_slicing(store: ObjectStore, start: int | None, end: int | None) -> None:
    store.put("r/obj", b"0123456789")
    expected = b"0123456789"[slice(start, end)]
    assert store.get("r/obj", start, end) == expected


def test_missing_object(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound):
        store.get("nope/missing")
    with pytest.raises(ObjectNotFound):
        store.get("nope/missing", 0, 8)
    with pytest.raises(ObjectNotFound):
        store.get("nope/missing", 4, 4)
    with pytest.raises(ObjectNotFound):
        store.size("nope/missing")
    assert not store.exists("nope/missing")
    store.delete("nope/missing")  # deleting a missing key is not an error
    with pytest.raises(ObjectNotFound):
        read_header(store, "nope/missing")


def test_list_is_lexicographic_and_delete_prefix(store: ObjectStore) -> None:
    keys = ["a/b", "a-c", "a/a/x", "a0", "a.x/y", "b/1", "ab"]
    for key in keys:
        store.put(key, key.encode())
    assert list(store.list("a")) == sorted(k for k in keys if k.startswith("a"))
    assert list(store.list("a/")) == ["a/a/x", "a/b"]
    assert list(store.list("zzz")) == []
    assert store.delete_prefix("a/") == 2
    assert list(store.list("")) == sorted(["a-c", "a0", "a.x/y", "b/1", "ab"])
    store.delete("b/1")
    assert not store.exists("b/1")
    assert store.delete_prefix("") == 4 and list(store.list("")) == []


def test_invalid_keys_rejected(store: ObjectStore) -> None:
    for bad in ("", "/abs", "a/../b"):
        with pytest.raises(ValueError):
            store.put(bad, b"x")


# -- tensorfile on both backends ---------------------------------------------------------------


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "down.0.attn1.k": torch.randn(1024, 64, generator=g),
        "down.0.attn1.v": torch.randn(1024, 64, generator=g).to(torch.bfloat16),
        "mask_index": torch.arange(37, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
    }


def test_tensorfile_round_trip_and_single_tensor_ranged_read(store: ObjectStore) -> None:
    tensors = sample_tensors()
    data = encode(tensors, metadata={"template": "tpl-1", "step": "3"})
    store.put("cache/tpl-1/003.safetensors", data)
    counted = ThrottledStore(store)  # infinite bandwidth: only counts bytes read
    header = read_header(counted, "cache/tpl-1/003.safetensors")
    assert header.metadata == {"template": "tpl-1", "step": "3"}
    assert header.total_size == len(data)
    before = counted.stats()
    value = read_tensor(counted, "cache/tpl-1/003.safetensors", "down.0.attn1.v", header)
    after = counted.stats()
    assert torch.equal(value, tensors["down.0.attn1.v"]) and value.dtype == torch.bfloat16
    info = header.tensors["down.0.attn1.v"]
    assert after.bytes_read - before.bytes_read == info.nbytes == 1024 * 64 * 2
    assert after.requests - before.requests == 1  # exactly one ranged GET
    loaded = read_all(store, "cache/tpl-1/003.safetensors")
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].shape == t.shape
    assert torch.equal(read_tensor(store, "cache/tpl-1/003.safetensors", "empty"), tensors["empty"])
    with pytest.raises(KeyError):
        read_tensor(store, "cache/tpl-1/003.safetensors", "no-such-tensor", header)


def test_tensorfile_is_plain_safetensors() -> None:
    from safetensors.torch import load

    tensors = sample_tensors()
    loaded = load(encode(tensors))
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t)


def test_corrupt_object_detected(store: ObjectStore) -> None:
    tensors = sample_tensors()
    key = "cache/tpl-2/000.safetensors"
    store.put(key, encode(tensors))
    header = read_header(store, key)
    k_info = header.tensors["down.0.attn1.k"]
    flip_byte(store, key, k_info.start + 1000)  # one bit inside one tensor's bytes
    with pytest.raises(CorruptObject):
        read_tensor(store, key, "down.0.attn1.k")
    assert torch.equal(read_tensor(store, key, "mask_index"), tensors["mask_index"])  # others ok
    with pytest.raises(CorruptObject):
        read_all(store, key)

    store.put(key, encode(tensors))
    flip_byte(store, key, 8 + 40)  # inside the JSON header
    with pytest.raises(CorruptObject):
        read_header(store, key)

    store.put(key, encode(tensors)[:-10])  # truncated upload
    with pytest.raises(CorruptObject):
        read_all(store, key)
    with pytest.raises(CorruptObject):
        read_tensor(store, key, sorted(header.tensors, key=lambda n: header.tensors[n].end)[-1])

    store.put(key, b"not a tensorfile at all")
    with pytest.raises(CorruptObject):
        read_header(store, key)


def test_every_single_byte_flip_is_detected() -> None:
    """No byte of a tensorfile (length prefix, header, padding, data) can change silently."""
    data = encode({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.int8)},
                  metadata={"template": "t"})
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            corrupt = bytearray(data)
            corrupt[i] ^= mask
            with pytest.raises(CorruptObject):
                decode(bytes(corrupt))


def test_large_tensor_header_needs_second_ranged_get(store: ObjectStore) -> None:
    """Headers beyond the 64 KiB speculative read (thousands of tensors) still parse."""
    tensors = {f"block.{i:05d}.attn.k": torch.full((2,), float(i)) for i in range(1500)}
    data = encode(tensors)
    assert int.from_bytes(data[:8], "little") > 64 * 1024
    store.put("many", data)
    header = read_header(store, "many")
    assert len(header.tensors) == 1500
    assert torch.equal(read_tensor(store, "many", "block.01499.attn.k", header),
                       torch.full((2,), 1499.0))


# -- S3-specific behaviour ---------------------------------------------------------------------


def test_s3_multipart_upload_and_throughput(s3_server: S3ServerInfo) -> None:
    s3 = make_s3(s3_server, multipart_threshold=8 * MiB, multipart_chunksize=5 * MiB)
    s3.ensure_bucket()
    payload = os.urandom(24 * MiB)
    t0 = time.perf_counter()
    s3.put("big/multipart.bin", payload)  # 24 MiB > threshold: 5 parts
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert s3.get("big/multipart.bin") == payload
    t_get = time.perf_counter() - t0
    assert s3.size("big/multipart.bin") == len(payload)
    boundary = 5 * MiB  # a ranged read across a part boundary
    across = s3.get("big/multipart.bin", boundary - 10, boundary + 10)
    assert across == payload[boundary - 10 : boundary + 10]
    t0 = time.perf_counter()
    for i in range(20):
        s3.get("big/multipart.bin", i * 4096, i * 4096 + 4096)
    t_range = (time.perf_counter() - t0) / 20
    log.info("S3 24 MiB: put %.0f MiB/s, get %.0f MiB/s, 4 KiB ranged get %.1f ms",
             24 / t_put, 24 / t_get, t_range * 1000)
    s3.delete("big/multipart.bin")
    s3.close()


def test_s3_unreachable_endpoint_fails_fast() -> None:
    s3 = S3Store("whatever", endpoint_url=f"http://127.0.0.1:{closed_port()}",
                 access_key="x", secret_key="y")
    for op in (lambda: s3.get("k"), lambda: s3.put("k", b"v"), lambda: s3.exists("k"),
               lambda: list(s3.list("")), s3.ensure_bucket):
        t0 = time.perf_counter()
        with pytest.raises(StoreUnavailable):
            op()
        assert time.perf_counter() - t0 < 5.0


def test_s3_endpoint_that_is_not_s3_is_unavailable() -> None:
    """A proxy or wrong service answering bare 404/503 must not look like "no such object"."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotS3(BaseHTTPRequestHandler):
        def _reply(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802 - http.server API
            self._reply(404)

        def do_PUT(self) -> None:  # noqa: N802
            self._reply(503)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        s3 = S3Store("bucket", endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
                     access_key="x", secret_key="y")
        for op in (lambda: s3.get("k"), lambda: s3.put("k", b"v")):
            t0 = time.perf_counter()
            with pytest.raises(StoreUnavailable):
                op()
            assert time.perf_counter() - t0 < 5.0
    finally:
        server.shutdown()
        server.server_close()


def test_s3_missing_bucket_and_bad_credentials_are_unavailable(s3_server: S3ServerInfo) -> None:
    missing = make_s3(s3_server, bucket="no-such-bucket-here")
    with pytest.raises(StoreUnavailable):
        missing.get("k")
    with pytest.raises(StoreUnavailable):
        list(missing.list(""))  # (no put: SeaweedFS auto-creates buckets for admin identities)
    wrong = S3Store(BUCKET, endpoint_url=s3_server.endpoint_url, access_key="wrong",
                    secret_key="wrong")
    with pytest.raises(StoreUnavailable):
        wrong.get("k")


def test_open_store_builds_s3_from_settings(s3_server: S3ServerInfo) -> None:
    settings = Settings(store_backend="s3", s3_endpoint_url=s3_server.endpoint_url,
                        s3_bucket="from-settings", s3_region=s3_server.region,
                        s3_access_key=s3_server.access_key, s3_secret_key=s3_server.secret_key)
    s3 = open_store(settings)
    assert isinstance(s3, S3Store)
    s3.ensure_bucket()
    s3.put("hello", b"world")
    assert s3.get("hello") == b"world"


def test_s3_concurrent_ranged_reads(s3_server: S3ServerInfo) -> None:
    """One client shared by threads (the host cache fetches from several threads)."""
    s3 = make_s3(s3_server)
    s3.ensure_bucket()
    payload = os.urandom(MiB)
    s3.put("shared/obj", payload)
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        try:
            for j in range(10):
                start = (i * 10 + j) * 1000
                assert s3.get("shared/obj", start, start + 1000) == payload[start : start + 1000]
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


# -- throttle (wraps the local store) ----------------------------------------------------------


def test_throttle_emulates_bandwidth_and_latency(tmp_path: Path) -> None:
    inner = LocalStore(tmp_path)
    inner.put("x", b"\0" * 200_000)
    slow = ThrottledStore(inner, bandwidth_bytes_per_s=2_000_000, latency_s=0.02)
    t0 = time.perf_counter()
    assert len(slow.get("x")) == 200_000  # 0.02 + 0.1 s
    elapsed = time.perf_counter() - t0
    assert 0.11 <= elapsed < 0.5
    assert slow.transfer_time(200_000) == pytest.approx(0.12)
    t0 = time.perf_counter()
    slow.get("x", 0, 100)  # latency dominates small ranged reads
    assert 0.02 <= time.perf_counter() - t0 < 0.2


def test_throttle_link_is_shared_by_concurrent_readers(tmp_path: Path) -> None:
    inner = LocalStore(tmp_path)
    inner.put("x", b"\0" * 100_000)
    slow = ThrottledStore(inner, bandwidth_bytes_per_s=1_000_000)
    threads = [threading.Thread(target=slow.get, args=("x",)) for _ in range(3)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.29  # 3 x 0.1 s serialized on one link, not 0.1 s in parallel
    stats = slow.stats()
    assert stats.requests == 3 and stats.bytes_read == 300_000
