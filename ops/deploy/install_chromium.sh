#!/usr/bin/env bash
# Headless Chromium for UI tests and screenshots (Debian package `chromium`). Idempotent: does
# nothing when a chromium binary is already on PATH. Prints the binary's path on stdout.
set -euo pipefail

find_chromium() {
  command -v chromium || command -v chromium-browser || command -v google-chrome || true
}

BIN="$(find_chromium)"
if [ -z "$BIN" ]; then
  echo "[install_chromium] installing the Debian package chromium" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core >/dev/null
  BIN="$(find_chromium)"
fi
if [ -z "$BIN" ]; then
  echo "[install_chromium] chromium is still missing after the install" >&2
  exit 1
fi
echo "$BIN"
