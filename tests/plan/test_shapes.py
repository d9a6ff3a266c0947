"""Model shapes: presets match published parameter counts, config.json parsing and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailserve.plan.errors import PlanError
from tailserve.plan.shapes import PRESETS, count_params, find_preset, load_hf_config, resolve_model

# Parameter counts published with the checkpoints (safetensors metadata on the Hugging Face Hub).
PUBLISHED_PARAMS = {
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3-70B": 70_553_706_496,
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-72B": 72_706_203_648,
    "SmolLM2-135M": 134_515_008,
}


@pytest.mark.parametrize(("name", "expected"), PUBLISHED_PARAMS.items())
def test_preset_param_count_matches_published_checkpoint(name: str, expected: int) -> None:
    shape = find_preset(name)
    assert shape is not None
    assert count_params(shape).total == expected


def test_llama_3_1_8b_counted_tensor_by_tensor() -> None:
    shape = find_preset("Llama-3.1-8B")
    assert shape is not None
    params = count_params(shape)
    embedding = 128256 * 4096
    attention = 4096 * 4096 * 2 + 4096 * 1024 * 2  # q, o and the 8-KV-head k, v
    mlp = 3 * 4096 * 14336
    assert params.embedding == embedding
    assert params.lm_head == embedding  # untied
    assert params.linear == 32 * (attention + mlp)
    assert params.small == 32 * 2 * 4096 + 4096  # two RMSNorms per layer + final norm


def test_qwen_counts_qkv_bias_and_smollm_ties_embeddings() -> None:
    qwen, smol = find_preset("Qwen2.5-7B"), find_preset("SmolLM2-135M")
    assert qwen is not None and smol is not None
    assert qwen.qkv_bias
    assert count_params(qwen).small == 28 * (2 * 3584 + 3584 + 2 * 512) + 3584
    assert count_params(smol).lm_head == 0


@pytest.mark.parametrize(
    "spelling", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "dummy:llama-3.1-8b", "LLAMA_3.1_8B"]
)
def test_preset_lookup_forgives_spelling(spelling: str) -> None:
    shape = find_preset(spelling)
    assert shape is not None and shape.name == "Llama-3.1-8B"


def test_every_preset_has_consistent_heads() -> None:
    for shape in PRESETS:
        assert shape.num_heads % shape.num_kv_heads == 0


def _write_config(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "MyModel" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


QWEN2_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}


def test_config_json_gives_the_same_shape_as_the_preset(tmp_path: Path) -> None:
    shape = load_hf_config(_write_config(tmp_path, QWEN2_7B_CONFIG))
    preset = find_preset("Qwen2.5-7B")
    assert preset is not None
    assert shape.name == "MyModel"
    assert shape.head_dim == 128  # derived: hidden / heads
    assert count_params(shape) == count_params(preset)


def test_model_directory_and_text_config_are_accepted(tmp_path: Path) -> None:
    path = _write_config(tmp_path, {"model_type": "llava", "text_config": QWEN2_7B_CONFIG})
    assert resolve_model(str(path.parent)).num_kv_heads == 4


def test_missing_kv_heads_means_multi_head_attention(tmp_path: Path) -> None:
    config = {k: v for k, v in QWEN2_7B_CONFIG.items() if k != "num_key_value_heads"}
    assert load_hf_config(_write_config(tmp_path, config)).num_kv_heads == 28


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {k: v for k, v in QWEN2_7B_CONFIG.items() if k != "hidden_size"},
            "missing required key 'hidden_size'",
        ),
        ({**QWEN2_7B_CONFIG, "num_hidden_layers": "28"}, "'num_hidden_layers' must be a positive integer"),
        ({**QWEN2_7B_CONFIG, "num_key_value_heads": 5}, "not a multiple"),
        ({**QWEN2_7B_CONFIG, "num_local_experts": 8}, "mixture-of-experts"),
        ([1, 2, 3], "expected a JSON object"),
    ],
)
def test_malformed_config_is_a_clear_error(tmp_path: Path, config: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        load_hf_config(_write_config(tmp_path, config))


def test_invalid_json_and_unknown_model_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="is not valid JSON"):
        load_hf_config(bad)
    with pytest.raises(PlanError, match="neither a preset"):
        resolve_model(str(tmp_path / "nope"))
