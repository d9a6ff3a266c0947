"""The transformers-free GGUF tokenizer gives exactly what transformers' PreTrainedTokenizerFast gives over
the same Rust pipeline: ids, text, chat prompts and vocabulary size, for the default model. Loading the
default model must not import transformers (its import is ~4 s of cold start).
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from typing import Any

import pytest

from tailserve.errors import InvalidRequestError
from tailserve.weights.gguf_file import read_gguf
from tailserve.weights.gguf_tokenizer import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    GGUFTokenizer,
    bpe_pipeline,
)
from tailserve.weights.loader import default_model_path
from tailserve.weights.tokenizer import Tokenizer

SPECIAL_IDS = [0, 1, 2, 3, 16]  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, <empty_output>

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system prompt"}],
    [
        {"role": "system", "content": "You translate."},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Hello, how are you?"},
        {"role": "user", "content": "日本語で: おはようございます 🌅"},
        {"role": "assistant", "content": "Good morning 🌅"},
        {"role": "user", "content": "Ещё раз, пожалуйста.\n\n  indented\tand tabbed  "},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": ""},
    ],
    [{"role": "user", "content": "literal <|im_start|>assistant\nand <|im_end|> inside"}],
    [{"role": "user", "content": "  leading and trailing spaces  \n"}, {"role": "tool", "content": "{}"}],
]
# A None value is dropped before rendering (OpenAI clients send content=None), so templates see no key.
CONTENT_NONE = [{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}]

# Uses what Hub templates reach for: tojson, loop controls, namespace, the named tokens, generation blocks.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | default('(none)') | tojson }}"
    "{% endgeneration %}"
    "{% else %}{{ m | tojson(indent=2, sort_keys=true) }}{% endif %}\n"
    "{% if ns.n > 4 %}{% break %}{% endif %}{% endfor %}"
    "{{ ns.n }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ tools is none }}|{{ documents is none }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    return read_gguf(default_model_path()).metadata


@pytest.fixture(scope="module")
def ours(meta: dict[str, Any]) -> GGUFTokenizer:
    return GGUFTokenizer(meta)


def transformers_tokenizer(meta: dict[str, Any]) -> Any:
    """The wrapping tailserve used before: PreTrainedTokenizerFast over the same Rust pipeline."""
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])

    def named(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe_pipeline(meta),
        bos_token=named("bos"),
        eos_token=named("eos"),
        unk_token=named("unknown"),
        pad_token=named("padding"),
    )
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_TYPE_CONTROL]
    hf.add_special_tokens({"additional_special_tokens": control})
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_TYPE_USER_DEFINED]
    if user:
        hf.add_tokens(user)
    hf.chat_template = str(meta["tokenizer.chat_template"])
    return hf


@pytest.fixture(scope="module")
def reference(meta: dict[str, Any]) -> Any:
    return transformers_tokenizer(meta)


@pytest.fixture(scope="module")
def corpus_lines() -> list[str]:
    text = resources.files("tailserve.bench").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    lines = text.split("\n")
    assert len(lines) > 1000
    return lines


def test_vocabulary_and_added_tokens_match(ours: GGUFTokenizer, reference: Any) -> None:
    assert len(ours) == len(reference) == 49152
    ours_added = json.loads(ours.backend.to_str())["added_tokens"]
    assert ours_added == json.loads(reference.backend_tokenizer.to_str())["added_tokens"]
    assert len(ours_added) == 17


def test_corpus_encodes_and_decodes_the_same(
    ours: GGUFTokenizer, reference: Any, corpus_lines: list[str]
) -> None:
    for line in corpus_lines:
        for text in (line, f"<|im_start|>user\n{line}<|im_end|>\n"):
            for add in (True, False):
                ids = ours.encode(text, add_special_tokens=add)
                assert ids == reference.encode(text, add_special_tokens=add), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip
                ), text


def test_decode_with_special_tokens_inserted(
    ours: GGUFTokenizer, reference: Any, corpus_lines: list[str]
) -> None:
    for n, line in enumerate(corpus_lines[:500]):
        ids = ours.encode(line)
        cut = len(ids) // 2
        ids = [SPECIAL_IDS[n % 5], *ids[:cut], SPECIAL_IDS[(n + 1) % 5], *ids[cut:], SPECIAL_IDS[(n + 2) % 5]]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.decode([1, 2, 0], skip_special_tokens=True) == ""
    assert ours.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_the_same(
    ours: GGUFTokenizer, reference: Any, messages: list[dict[str, Any]], generation_prompt: bool
) -> None:
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages", [*CONVERSATIONS, CONTENT_NONE])
def test_template_features_render_the_same(
    meta: dict[str, Any], reference: Any, messages: list[dict[str, Any]]
) -> None:
    featured = GGUFTokenizer({**meta, "tokenizer.chat_template": FEATURE_TEMPLATE})
    text = featured.apply_chat_template(messages, add_generation_prompt=True)
    assert text == reference.apply_chat_template(
        messages, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>") and "|<|im_end|>|<|im_end|>|<|endoftext|>|True|True" in text


def test_tokenizer_prompt_ids_match_the_reference(ours: GGUFTokenizer, reference: Any) -> None:
    messages = CONVERSATIONS[3]
    ids = Tokenizer(ours, [2]).apply_chat_template(messages)
    assert ids == Tokenizer(reference, [2]).apply_chat_template(messages)
    assert ids[-4:] == ours.encode("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (None, [{"role": "user"}]),  # the default template reads message['content']
        (None, ["not a dict"]),
        (None, CONTENT_NONE),
        ("{{ raise_exception('only user turns') }}", [{"role": "user", "content": "x"}]),
        ("{% for m in messages %}{{ m['content'] }", [{"role": "user", "content": "x"}]),  # syntax error
    ],
)
def test_template_errors_are_invalid_requests(
    meta: dict[str, Any], reference: Any, template: str | None, messages: list[Any]
) -> None:
    tok = GGUFTokenizer(meta if template is None else {**meta, "tokenizer.chat_template": template})
    with pytest.raises(InvalidRequestError, match="messages do not fit the chat template"):
        Tokenizer(tok, [2]).apply_chat_template(messages)
    with pytest.raises(Exception):  # noqa: B017 - the reference fails too (its own error types)
        reference.apply_chat_template(
            messages, chat_template=tok.chat_template, tokenize=False, add_generation_prompt=True
        )


def test_loading_the_default_model_does_not_import_transformers() -> None:
    script = (
        "import sys, torch\n"
        "from tailserve.weights.loader import load_model\n"
        "model = load_model('default', torch.float32)\n"
        "assert model.tokenizer.encode('Hello') and model.tokenizer.apply_chat_template("
        "[{'role': 'user', 'content': 'hi'}])\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
