#!/usr/bin/env bash
# The main job on embedded defaults: set up, then run `stencil demo` (its own redis-server,
# local object store, CPU worker, GPU worker on the CPU, dispatcher). Extra args go to the demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/ops/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1
exec .venv/bin/stencil demo --jobs 4 --out demo-out "$@"
