"""The Hugging Face side of a tailserve model: its `LlamaConfig`, a `LlamaForCausalLM` holding the
same weights, and a safetensors + tokenizer directory of the default GGUF for HF-format peers.

Runs in tailserve's venv (torch, transformers, gguf). The weights come from tailserve's own loader
(dequantized to float32, Q/K rows already in HF order), so every peer serves exactly our numbers.

    .venv/bin/python benchmarks/hf_models.py [OUT_DIR]     # default benchmarks/.models/smollm2-hf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tailserve.weights.arch import ArchConfig
    from tailserve.weights.loader import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
HF_DIR = ROOT / "benchmarks" / ".models" / "smollm2-hf"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def llama_config(arch: ArchConfig, max_position_embeddings: int | None = None) -> LlamaConfig:
    """transformers' config for a Llama-family ArchConfig (the one place this mapping is written)."""
    from transformers import LlamaConfig

    if arch.family != "llama":
        raise ValueError(f"only the Llama family maps to LlamaConfig, not {arch.family!r}")
    eos = list(arch.eos_token_ids)
    return LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rope_parameters={"rope_type": "default", **(arch.rope_scaling or {}), "rope_theta": arch.rope_theta},
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.qkv_bias,
        max_position_embeddings=max_position_embeddings or arch.max_position_embeddings,
        bos_token_id=arch.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        architectures=["LlamaForCausalLM"],
    )


def hf_model(model: LoadedModel) -> LlamaForCausalLM:
    """A transformers LlamaForCausalLM holding the loaded weights (in eval mode)."""
    from transformers import LlamaForCausalLM

    hf: LlamaForCausalLM = LlamaForCausalLM(llama_config(model.arch))
    hf.eval()  # type: ignore[no-untyped-call]
    hf.load_state_dict(model.weights, strict=False)
    hf.tie_weights()
    return hf


def checkpoint_complete(out: Path) -> bool:
    return all((out / name).exists() for name in CHECKPOINT_FILES)


def write_hf_checkpoint(out: Path = HF_DIR) -> Path:
    """The default GGUF as an HF directory: float32 safetensors, config.json, tokenizer files.

    Written to a temporary sibling and renamed, so a half-written directory is never taken as done."""
    if checkpoint_complete(out):
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from tailserve.weights.loader import default_model_path, load_model

    gguf = default_model_path()
    model = load_model(str(gguf), torch.float32)
    config = llama_config(model.arch)
    config.dtype = "float32"
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    weights = {name: w.contiguous() for name, w in model.weights.items()}
    if model.arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, HF re-ties it
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=HF_DIR, help=f"default {HF_DIR}")
    args = parser.parse_args(argv)
    print(write_hf_checkpoint(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
