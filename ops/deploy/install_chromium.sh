#!/usr/bin/env bash
# Headless Chromium for UI tests and screenshots (Debian package `chromium`), and with --driver its
# WebDriver (`chromium-driver`, the same release) for tests that drive pages. Idempotent: installs
# only what is missing. Prints the browser's path (with --driver: the browser's and the driver's).
set -euo pipefail

WANT_DRIVER=0
[ "${1:-}" = "--driver" ] && WANT_DRIVER=1

find_chromium() {
  command -v chromium || command -v chromium-browser || command -v google-chrome || true
}
find_driver() {
  command -v chromedriver || true
}

BIN="$(find_chromium)"
DRIVER="$(find_driver)"
PACKAGES=()
[ -z "$BIN" ] && PACKAGES+=(chromium fonts-dejavu-core)
[ "$WANT_DRIVER" = 1 ] && [ -z "$DRIVER" ] && PACKAGES+=(chromium-driver)
if [ "${#PACKAGES[@]}" -gt 0 ]; then
  echo "[install_chromium] installing the Debian packages ${PACKAGES[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
  BIN="$(find_chromium)"
  DRIVER="$(find_driver)"
fi
if [ -z "$BIN" ] || { [ "$WANT_DRIVER" = 1 ] && [ -z "$DRIVER" ]; }; then
  echo "[install_chromium] chromium or chromedriver is still missing after the install" >&2
  exit 1
fi
if [ "$WANT_DRIVER" = 1 ]; then
  echo "$BIN $DRIVER"
else
  echo "$BIN"
fi
