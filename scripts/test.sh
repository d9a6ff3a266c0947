#!/usr/bin/env bash
# Set up everything from scratch (venv, package, default model, promtool, Chromium), then lint,
# type-check and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# System tools the tests drive for real: promtool (alert rules) and headless Chromium (HTML reports).
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
V=.venv/bin
"$V/ruff" check src tests benchmarks
"$V/ruff" format --check src tests benchmarks
"$V/mypy" --no-error-summary
"$V/python" -m pytest -q "$@"
