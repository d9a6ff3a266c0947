#!/usr/bin/env bash
# Set up everything (see setup.sh), then serve the default model on 127.0.0.1:8000.
# Extra arguments go to `tailserve serve` (e.g. --port 9000, --model PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tailserve serve "$@"
