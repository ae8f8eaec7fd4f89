#!/usr/bin/env bash
# The test suite: set up, then pytest (tests start their own redis-server, Celery workers and
# S3 server on free loopback ports). Slow benchmarks are excluded (-m slow selects them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/ops/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
