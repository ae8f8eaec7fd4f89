#!/usr/bin/env bash
# Idempotent set-up for a fresh clone: redis-server (OS package) if missing, a virtual
# environment at .venv/ with the CPU build of torch==2.13.0 and this package (editable), and with
# --browser (the test suite) Chromium and its WebDriver (OS packages) for the web page's test.
# Re-running is cheap: the Python install is skipped while pyproject.toml is unchanged, and each
# OS package is installed only when missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[bootstrap] installing redis-server (Debian package)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ "${1:-}" = "--browser" ]; then
  bash "$ROOT/ops/deploy/install_chromium.sh" --driver >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv" >&2
  "$PY" -m venv .venv
fi

STAMP=.venv/.stencil-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[bootstrap] installing Python dependencies" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # CPU build of torch first, so nothing below pulls a CUDA build. Elsewhere than this
  # machine, point STENCIL_TORCH_INDEX_URL at PyTorch's CPU wheel index.
  # --no-compile: byte-compiling every installed module (torch, transformers: tens of thousands of
  # files) took a third of the install; Python compiles and caches the modules a process imports.
  .venv/bin/python -m pip install -q --no-compile "torch==2.13.0" \
    ${STENCIL_TORCH_INDEX_URL:+--index-url "$STENCIL_TORCH_INDEX_URL"}
  .venv/bin/python -m pip install -q --no-compile -e ".[test]"
  echo "$WANT" > "$STAMP"
fi

# Byte-compile, once, what every worker process imports (torch, transformers, diffusers: about
# 4,000 modules). An environment with PYTHONDONTWRITEBYTECODE set otherwise makes each process of
# the stack compile them again: half of a worker's start on 2 cores.
BYTECODE=.venv/.stencil-bytecode
if [ ! -f "$BYTECODE" ] || [ "$(cat "$BYTECODE")" != "$WANT" ]; then
  env -u PYTHONDONTWRITEBYTECODE HF_HUB_OFFLINE=1 .venv/bin/python -c \
    "import app.cli, workers.gpu_tasks, workers.cpu_tasks, diffusers, transformers
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline, FluxFillPipeline" \
    >/dev/null 2>&1 || { echo "[bootstrap] importing the workers' modules failed" >&2; exit 1; }
  echo "$WANT" > "$BYTECODE"
fi
