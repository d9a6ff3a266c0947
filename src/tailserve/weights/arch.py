"""Architecture shapes of the supported model families, the tensors a model of them holds, and the
named presets for dummy weights.

Only the Llama family and Qwen2 are supported; anything else is rejected here, by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tailserve.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ArchConfig:
    """The shapes and constants a decoder-only transformer of our families needs."""

    family: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V elements stored per token, all layers: 2 x layers x kv_heads x head_dim."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Build from a Hugging Face config.json dict; unsupported architectures raise."""
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(cfg.get("model_type", ""))
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: tailserve serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama family and Qwen2)"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        heads = int(cfg["num_attention_heads"])
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            rope_theta=float(
                cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            ),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ArchConfig] = {
    "tiny": ArchConfig(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-0.5B's head layout (14 heads, 2 KV heads, q/k/v biases) at toy widths: the
    # tensor-parallel tests' split-KV shape, small enough to spawn several ranks of.
    "tp-qwen2": ArchConfig(
        family="qwen2",
        vocab_size=999,  # odd: the last vocabulary shard is one row short (gather pads it)
        hidden_size=224,
        num_layers=2,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=2048,
    ),
    "smollm2-135m": ArchConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen2.5-0.5b": ArchConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
    "llama-3.1-8b": ArchConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
    ),
}


def preset(name: str) -> ArchConfig:
    """A named architecture preset; unknown names raise with the list of known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnsupportedModelError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


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


def check_weights(arch: ArchConfig, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Every expected tensor present with the expected shape, or a clear error."""
    for name, shape in hf_weight_shapes(arch).items():
        got = shapes.get(name)
        if got is None:
            raise ModelLoadError(f"{where}: missing tensor {name}")
        if tuple(got) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(got)}, config says {shape}")
