# One image for every Stencil process (dispatcher, CPU and GPU workers, Flower); docker-compose.yml
# picks the process with `command: ["stencil", ...]`, the same subcommands the README documents.
#
# Build args:
#   TORCH_INDEX_URL  empty (default): torch from PyPI, i.e. the CUDA build on linux/amd64, for GPU
#                    hosts. For CPU-only images point it at PyTorch's CPU wheel index (much smaller).
#   TORCH_VERSION    must match pyproject.toml.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    STENCIL_HOME=/var/lib/stencil

# tini reaps Celery's children and forwards SIGTERM, so `docker compose stop` is a warm shutdown.
# Unpinned on purpose: Debian stable's security updates should land on every rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /home/stencil stencil \
 && mkdir -p /var/lib/stencil /var/lib/flower /models \
 && chown stencil:stencil /var/lib/stencil /var/lib/flower

WORKDIR /opt/stencil

# torch first (the big, rarely changing layer), from the index the build arg names.
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

COPY pyproject.toml README.md ./
COPY app ./app
COPY workers ./workers
COPY ops ./ops
RUN pip install . && stencil --help >/dev/null

# Numeric, so orchestrators can verify that the process is not root.
USER 10001:10001
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["stencil", "--help"]
