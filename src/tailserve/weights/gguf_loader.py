"""GGUF files: parsed once from a memory map, renamed to HF names, dense copies in the target dtype.

The quantized blocks are kept too (rows in HF order), so int4 weights are built from the file's own
codes, never re-quantized. The tokenizer and chat template come from the file's metadata; llama.cpp's
Q/K row permutation (done at conversion for rotary embeddings) is undone so rows match HF layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tailserve.errors import UnsupportedModelError
from tailserve.weights.arch import ArchConfig, check_weights
from tailserve.weights.formats import dequantize_tensor
from tailserve.weights.gguf_file import GGUFFile, GGUFTensor, read_gguf
from tailserve.weights.gguf_tokenizer import TOKEN_TYPE_CONTROL, GGUFTokenizer
from tailserve.weights.tokenizer import Tokenizer

_GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2"}
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_FLOAT_TYPES = ("F32", "F16", "BF16")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class GGUFWeights:
    """What a GGUF file holds, under HF names: dense tensors plus the raw blocks of quantized ones."""

    name: str
    arch: ArchConfig
    dense: dict[str, torch.Tensor]
    blocks: dict[str, GGUFTensor]  # quantized tensors only, rows in HF order
    tokenizer: Tokenizer


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    dense_q4: bool = True,
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> GGUFWeights:
    """Parse the file once; return name, shapes, HF-named weights (dense and blocks) and the tokenizer.

    `dense_q4=False` leaves Q4_0 / Q4_1 tensors as shape-only (meta) dense entries: for a model that
    runs them from their blocks alone (the int4 plan on AMX), which skips decoding ~100M weights.
    `keep(name, tensor)` cuts each dense tensor as soon as it is decoded (a tensor-parallel shard),
    so no more than one whole tensor is ever held; the blocks stay mapped from the file."""
    gguf_file = read_gguf(path)
    meta = gguf_file.metadata
    arch, blocks = _arch_and_blocks(gguf_file, path)
    check_weights(arch, {k: t.shape for k, t in blocks.items()}, str(path))
    cut = keep or (lambda _, t: t)
    dense = {
        k: cut(k, dequantize_tensor(t, dtype))
        if dense_q4 or t.type_name not in ("Q4_0", "Q4_1")
        else cut(k, torch.empty(t.shape, dtype=dtype, device="meta"))
        for k, t in blocks.items()
    }
    quantized = {k: t for k, t in blocks.items() if t.type_name not in _FLOAT_TYPES}
    tokenizer = _tokenizer(meta, path, arch)
    name = path.name.removesuffix(".gguf").split(".")[0]
    return GGUFWeights(name, arch, dense, quantized, tokenizer)


def read_gguf_arch(path: Path) -> ArchConfig:
    """The architecture alone (header and tensor directory; no tensor is decoded)."""
    return _arch_and_blocks(read_gguf(path), path)[0]


def _arch_and_blocks(gguf_file: GGUFFile, path: Path) -> tuple[ArchConfig, dict[str, GGUFTensor]]:
    arch = _arch_from_metadata(gguf_file.metadata, path)
    blocks = _hf_blocks(gguf_file.tensors, arch)
    if "lm_head.weight" not in blocks and not arch.tie_word_embeddings:
        arch = ArchConfig(**{**arch.__dict__, "tie_word_embeddings": True})
    return arch, blocks


def _arch_from_metadata(meta: dict[str, Any], path: Path) -> ArchConfig:
    gguf_arch = meta.get("general.architecture")
    family = _GGUF_FAMILIES.get(str(gguf_arch))
    if family is None:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported (tailserve serves llama and qwen2)"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(
            f"{path}: rope scaling {get('rope.scaling.type')!r} in GGUF is not supported"
        )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ArchConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        intermediate_size=int(get("feed_forward_length")),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=False,
        qkv_bias=family == "qwen2",
        max_position_embeddings=int(get("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _hf_blocks(tensors: dict[str, GGUFTensor], arch: ArchConfig) -> dict[str, GGUFTensor]:
    """The model's tensors under HF names, with llama's Q/K rows back in HF order (raw bytes, no decode)."""
    out: dict[str, GGUFTensor] = {}
    layer_re = re.compile(r"blk\.(\d+)\.(.+)")
    for t in tensors.values():
        m = layer_re.fullmatch(t.name)
        if m and m.group(2) in _LAYER_NAMES:
            hf_name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        elif t.name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[t.name]
        else:
            continue  # e.g. rope_freqs: derived from the config instead
        if arch.family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch.num_heads if "q_proj" in hf_name else arch.num_kv_heads
            order = _unpermute_rotary_rows(torch.arange(t.data.shape[0]), heads).numpy()
            t = GGUFTensor(t.name, t.type_id, t.type_name, t.shape, t.data[order])
        out[hf_name] = t
    return out


def _unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rows (pairs -> halves), back to HF's rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tokenizer(meta: dict[str, Any], path: Path, arch: ArchConfig) -> Tokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        failure = f"{path}: cannot build its tokenizer"
        return Tokenizer.from_transformers(
            arch.eos_token_ids, path.name, failure, str(path.parent), gguf_file=path.name
        )
    bpe = GGUFTokenizer(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    template = bpe.chat_template or ""
    eos = set(arch.eos_token_ids)
    # Chat models end a turn with a control token their template writes, often not the file's eos.
    for name in _TURN_END_TOKENS:
        if name in vocab and token_types[vocab[name]] == TOKEN_TYPE_CONTROL and name in template:
            eos.add(vocab[name])
    return Tokenizer(bpe, sorted(eos), path.name)
