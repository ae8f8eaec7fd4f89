#!/usr/bin/env bash
# The test suite: set up, then pytest (tests start their own redis-server, Celery workers and
# S3 server on free loopback ports; the web page's test drives Chromium). Slow benchmarks are
# excluded (-m slow selects them).
# Tests run in STENCIL_TEST_PROCESSES pytest processes (pytest-xdist; default 2, one per core of
# the CI machine; 0 = in this process): much of the suite waits on the processes it starts, and
# each test process computes on one torch thread.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/ops/bootstrap.sh" --browser
cd "$ROOT"
export HF_HUB_OFFLINE=1
# Let Python cache what it compiles (an environment may forbid it): each process of the stack
# would otherwise compile the modules it imports anew.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -n "${STENCIL_TEST_PROCESSES:-2}" --dist worksteal "$@"
