"""Where each peer's software and model files live, and how they are made on first use.

Peers get venvs of their own under benchmarks/.venvs/ (gitignored), never tailserve's: the peers'
venv (CPU torch, `transformers serve`, llama.cpp's `xllamacpp`) and vLLM's CPU engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
TAILSERVE = ROOT / ".venv" / "bin" / "tailserve"
VENVS = Path(os.environ.get("TAILSERVE_BENCH_VENVS", ROOT / "benchmarks" / ".venvs"))
PEERS_PYTHON = VENVS / "peers" / "bin" / "python"
VLLM_PYTHON = VENVS / "vllm" / "bin" / "python"
HF_DIR = ROOT / "benchmarks" / ".models" / "smollm2-hf"  # hf_models.HF_DIR, without importing torch here
TORCH_PIN = "torch==2.13.0"  # the CPU wheel on this disk; an unpinned torch would pull a CUDA build
PEER_PACKAGES = ("transformers[serving]", "xllamacpp", "gguf")
PEERS_IMPORT_CHECK = (
    "import torch, transformers, xllamacpp, gguf, fastapi, uvicorn; assert torch.version.cuda is None"
)


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def imports_ok(python: Path, code: str) -> bool:
    return python.exists() and subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def ensure_peers_venv() -> Path:
    """The peers' venv: the CPU torch first (pinned by a constraints file), then the servers."""
    if imports_ok(PEERS_PYTHON, PEERS_IMPORT_CHECK):
        return PEERS_PYTHON
    venv = PEERS_PYTHON.parents[1]
    log(f"creating the peers' venv at {venv} (torch CPU, transformers[serving], xllamacpp)")
    if not PEERS_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(PEERS_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run([*pip, "-c", str(constraints), *PEER_PACKAGES], check=True)
    if not imports_ok(PEERS_PYTHON, PEERS_IMPORT_CHECK):
        sys.exit(f"the peers' venv at {venv} is incomplete or has a CUDA torch; remove it and retry")
    return PEERS_PYTHON


def ensure_vllm_venv() -> Path:
    """vLLM's CPU engine in its own venv (~3.5 GB; see setup_vllm.sh)."""
    if not imports_ok(VLLM_PYTHON, "import vllm"):
        log(f"installing vLLM's CPU engine into {VLLM_PYTHON.parents[1]} (~3.5 GB)")
        script = Path(__file__).with_name("setup_vllm.sh")
        subprocess.run(["bash", str(script), str(VLLM_PYTHON.parents[1])], check=True)
    return VLLM_PYTHON


def gguf_path() -> Path:
    """The default model's GGUF, as tailserve finds it (asked in a subprocess: no tailserve import here)."""
    code = "from tailserve.weights.loader import default_model_path; print(default_model_path())"
    out = subprocess.run([str(MAIN_PYTHON), "-c", code], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def ensure_hf_dir() -> Path:
    """The default GGUF as an HF directory (float32 safetensors + tokenizer), written once by
    benchmarks/hf_models.py with tailserve's loader; HF-format peers and the bench's tokenizer use it."""
    if not (HF_DIR / "model.safetensors").exists() or not (HF_DIR / "tokenizer.json").exists():
        log(f"converting the default GGUF to {HF_DIR}")
        script = ROOT / "benchmarks" / "hf_models.py"
        subprocess.run([str(MAIN_PYTHON), str(script), str(HF_DIR)], check=True)
    return HF_DIR


def versions(python: Path, packages: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of `packages` in the venv of `python` ({} when it cannot say)."""
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))"
    )
    if not python.exists():
        return {}
    out = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}
