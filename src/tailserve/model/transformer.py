"""The decoder-only transformer (Llama family, Qwen2) over a flattened batch of new tokens.

Weights are fused at load (q|k|v, gate|up) so a layer is five matmuls; the KV cache is passed in,
never owned. Logits are computed only for the rows that will be sampled.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tailserve.errors import UnsupportedModelError
from tailserve.model.arch import ArchConfig
from tailserve.model.attention import AttentionBackend, AttentionMetadata


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 / linear scaling applied."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear and llama3 are)")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.arch = arch
        self.input_norm = RMSNorm(w[prefix + "input_layernorm.weight"], arch.rms_norm_eps)
        self.post_norm = RMSNorm(w[prefix + "post_attention_layernorm.weight"], arch.rms_norm_eps)
        a = prefix + "self_attn."
        self.qkv_weight = nn.Parameter(
            torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
            requires_grad=False,
        )
        self.qkv_bias = (
            nn.Parameter(
                torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]),
                requires_grad=False,
            )
            if arch.qkv_bias
            else None
        )
        self.o_weight = nn.Parameter(w[a + "o_proj.weight"], requires_grad=False)
        m = prefix + "mlp."
        self.gate_up_weight = nn.Parameter(
            torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]), requires_grad=False
        )
        self.down_weight = nn.Parameter(w[m + "down_proj.weight"], requires_grad=False)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        arch = self.arch
        x = self.input_norm(h)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = _rotate(q.view(-1, arch.num_heads, arch.head_dim), cos, sin)
        k = _rotate(k.view(-1, arch.num_kv_heads, arch.head_dim), cos, sin)
        v = v.reshape(-1, arch.num_kv_heads, arch.head_dim)
        attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        h = h + F.linear(attn.reshape(-1, self.q_size), self.o_weight)
        gate, up = F.linear(self.post_norm(h), self.gate_up_weight).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down_weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (Hugging Face layout). cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TransformerLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, built from Hugging Face-named weights."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, weights, f"model.layers.{i}.") for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(weights["model.norm.weight"], arch.rms_norm_eps)
        head = weights.get("lm_head.weight")
        self.lm_head = (
            self.embed
            if head is None or arch.tie_word_embeddings
            else nn.Parameter(head, requires_grad=False)
        )
        inv_freq = rope_inv_freq(arch)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        self.register_buffer("cos_table", emb.cos().to(torch.float32).to(dtype), persistent=False)
        self.register_buffer("sin_table", emb.sin().to(torch.float32).to(dtype), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # rows whose next-token logits are wanted
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, k_cache, v_cache, meta, backend)
        h = self.norm(h.index_select(0, logits_indices))
        return F.linear(h, self.lm_head).float()
