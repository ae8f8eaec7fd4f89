#!/usr/bin/env bash
# The main job on embedded defaults: set up, then run `stencil demo` (its own redis-server,
# local object store, CPU worker, GPU worker on the CPU, dispatcher). Extra args go to the demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/ops/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1
# Let Python cache what it compiles (an environment may forbid it): each process of the stack
# would otherwise compile the modules it imports anew.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/stencil demo --jobs 4 --out demo-out "$@"
