"""Model shapes for capacity planning: presets with real config shapes, and HF config.json parsing.

A shape is all the planner needs (layers, widths, heads, vocab, tying, biases); parameter counts
are derived from it tensor by tensor. Never loads weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailserve.plan.errors import PlanError


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a dense decoder-only transformer (Llama / Qwen2 family)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False  # Qwen2: biases on q, k, v projections
    o_bias: bool = False  # Llama `attention_bias` puts one on o_proj too
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field_name) <= 0:
                raise PlanError(f"model {self.name!r}: {field_name} must be positive")
        for field_name in ("intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, field_name) <= 0:
                raise PlanError(f"model {self.name!r}: {field_name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise PlanError(
                f"model {self.name!r}: num_attention_heads ({self.num_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_kv_heads})"
            )


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by where they live; `linear` is what weight quantization shrinks."""

    embedding: int
    linear: int  # q/k/v/o and gate/up/down matrices of every layer
    small: int  # norms and biases (kept in 16 bits by every quantization scheme)
    lm_head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        """All parameters, counting a tied embedding once."""
        return self.embedding + self.linear + self.small + self.lm_head


def count_params(shape: ModelShape) -> ParamCount:
    """Parameters tensor by tensor, as a Llama / Qwen2 checkpoint stores them."""
    h, layers = shape.hidden_size, shape.num_layers
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    attn_matrices = h * q_width + 2 * h * kv_width + q_width * h
    mlp_matrices = 3 * h * shape.intermediate_size  # gate, up, down
    biases = (q_width + 2 * kv_width if shape.qkv_bias else 0) + (h if shape.o_bias else 0)
    biases += (2 * shape.intermediate_size + h) if shape.mlp_bias else 0
    norms_per_layer = 2 * h  # input and post-attention RMSNorm
    embedding = shape.vocab_size * h
    return ParamCount(
        embedding=embedding,
        linear=layers * (attn_matrices + mlp_matrices),
        small=layers * (norms_per_layer + biases) + h,  # + final norm
        lm_head=0 if shape.tie_word_embeddings else embedding,
    )


PRESETS: tuple[ModelShape, ...] = (
    ModelShape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, 131072),
    ModelShape("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, False, 131072),
    ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, 8192),
    ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, False, 8192),
    ModelShape("Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151936, True, 32768, qkv_bias=True),
    ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, 32768, qkv_bias=True),
    ModelShape("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, False, 32768, qkv_bias=True),
    ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True, 8192),
)


def _key(name: str) -> str:
    """Preset key: case and separators ignored; `dummy:`, `Meta-` and `-Instruct` dropped."""
    name = name.lower().removeprefix("dummy:").removeprefix("meta-").removesuffix("-instruct")
    return re.sub(r"[^a-z0-9.]", "", name)


def find_preset(name: str) -> ModelShape | None:
    """The preset called `name` (e.g. "llama-3.1-8b", "Qwen2.5-7B-Instruct"), or None."""
    wanted = _key(name.rsplit("/", 1)[-1])
    return next((shape for shape in PRESETS if _key(shape.name) == wanted), None)


def _int_field(config: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    """A positive integer from config.json, or PlanError naming the key."""
    value = config.get(key, default)
    if value is None:
        raise PlanError(f"{source}: missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{source}: {key!r} must be a positive integer, got {value!r}")
    return value


def shape_from_hf_config(config: Mapping[str, Any], name: str, source: str = "config.json") -> ModelShape:
    """A ModelShape from the dict of a Hugging Face config.json (dense Llama-like models)."""
    if isinstance(config.get("text_config"), Mapping):  # multimodal wrappers keep the LM inside
        config = config["text_config"]
    if any(key in config for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise PlanError(f"{source}: mixture-of-experts models are not supported by the planner yet")
    heads = _int_field(config, "num_attention_heads", source)
    hidden = _int_field(config, "hidden_size", source)
    head_dim_default = hidden // heads if hidden % heads == 0 else None
    model_type = str(config.get("model_type", ""))
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        name=name,
        num_layers=_int_field(config, "num_hidden_layers", source),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_int_field(config, "num_key_value_heads", source, default=heads),
        head_dim=_int_field(config, "head_dim", source, default=head_dim_default),
        intermediate_size=_int_field(config, "intermediate_size", source),
        vocab_size=_int_field(config, "vocab_size", source),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=_int_field(config, "max_position_embeddings", source, default=4096),
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def load_hf_config(path: Path) -> ModelShape:
    """Parse a config.json file (or a model directory holding one) into a ModelShape."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"cannot read {file}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise PlanError(f"{file}: expected a JSON object, got {type(config).__name__}")
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return shape_from_hf_config(config, name=name, source=str(file))


def resolve_model(spec: str) -> ModelShape:
    """`spec` as a preset name, else as a path to config.json or a model directory."""
    preset = find_preset(spec)
    if preset is not None:
        return preset
    path = Path(spec)
    if path.exists():
        return load_hf_config(path)
    known = ", ".join(shape.name for shape in PRESETS)
    raise PlanError(f"{spec!r} is neither a preset ({known}) nor an existing config.json / model directory")
