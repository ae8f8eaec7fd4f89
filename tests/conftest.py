"""Shared fixtures: a private redis-server and an embedded Stencil stack (real processes)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests run on the random-init embedded model (same UNet shape as the trained default, smaller
# VAE, no copy of the committed weights); tests/test_trained_model.py selects the trained one.
os.environ.setdefault("STENCIL_MODEL_ID", "tiny-sd-inpaint")
torch.set_num_threads(1)  # the workers the tests start need the other core

from app.embedded import EmbeddedStack, RedisServer  # noqa: E402

log = logging.getLogger(__name__)


# The modules that take longest (a minute or more of a test process), run first, longest first:
# the suite's processes share out the rest (pytest-xdist's worksteal), and a long module left for
# the end would keep one process busy while the other has nothing left to do.
LONGEST_FIRST = ("test_bench_quick", "test_bf16_exactness", "test_trained_addons", "test_bf16_addons",
                 "test_multihost", "test_catalog", "test_on_demand_models", "test_weight_uploads",
                 "test_batch_invariance", "test_serve", "test_cli", "test_fault_recovery")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (each module's tests in their order); ``gpu`` tests need CUDA:
    skipped (with the reason) on machines without it."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU machine: pytest -m gpu -p no:xdist tests/test_gpu.py)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture()
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the suite's other process shares the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture()
def redis_client(redis_server: RedisServer):  # type: ignore[no-untyped-def]
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    return client


@pytest.fixture(scope="session")
def model_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One saved embedded model for every stack of the session."""
    home = tmp_path_factory.mktemp("home")
    from app.settings import Settings
    from workers.models.loader import ensure_model_dir

    ensure_model_dir(Settings.from_env(home=home))
    return home


@pytest.fixture(scope="session")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default written by ``stencil model save`` (a standard diffusers folder)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("model") / "tiny-sd"
    subprocess.run([sys.executable, "-m", "app.cli", "model", "save", str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, model_home: Path, saved_model: Path) -> Iterator[EmbeddedStack]:
    """The shared embedded stack: 1 CPU worker, 1 GPU worker (max batch 4), the dispatcher,
    all loading the model folder that ``stencil model save`` wrote."""
    workdir = tmp_path_factory.mktemp("stack")
    with EmbeddedStack.start(workdir, home=model_home, model_dir=str(saved_model), max_batch=4,
                             max_image_pixels=200_000) as s:
        yield s
    logs = workdir / "logs"
    if logs.is_dir():
        for f in logs.iterdir():
            log.debug("%s:\n%s", f.name, f.read_text()[-2000:])


@pytest.fixture()
def client(stack: EmbeddedStack):  # type: ignore[no-untyped-def]
    from app.client import StencilClient

    return StencilClient(stack.settings)


# The gateway of the shared stack: limits high by default (tests set a tenant's own limits where they
# test them), short timeouts for slow-client tests, a small body limit, loopback webhook receivers.
GATEWAY_ENV = {"STENCIL_API_RATE_PER_S": "1000", "STENCIL_API_BURST": "1000", "STENCIL_API_HEADER_TIMEOUT_S": "1.5",
               "STENCIL_API_BODY_TIMEOUT_S": "1.5", "STENCIL_API_MAX_BODY_BYTES": str(2 << 20),
               "STENCIL_WEBHOOK_ALLOW_PRIVATE": "1"}


@pytest.fixture(scope="session")
def gateway(stack: EmbeddedStack):  # type: ignore[no-untyped-def]
    """``stencil api`` on the shared stack (a real uvicorn process on a free loopback port)."""
    from tests.support.gateway import Gateway

    gw = Gateway(stack, **GATEWAY_ENV)
    yield gw
    gw.stop()
