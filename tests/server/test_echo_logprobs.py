"""echo (with prompt log-probabilities), best_of and suffix in /v1/completions, through the official
`openai` client against the real default model in fp32, checked against in-process teacher-forced
logits."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tailserve.engine import LLM
from tailserve.server.protocol import FIM_TOKENS, CompletionRequest, completion_prompt_ids
from tailserve.weights.loader import LoadedModel
from tests.server.reference import fp32_llm, teacher_forced
from tests.server.test_server import assert_idle

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def llm(smol: LoadedModel) -> LLM:
    return fp32_llm(smol)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _model(base: str) -> str:
    return str(_client(base).models.list().data[0].id)


def test_echo_scores_the_prompt_as_teacher_forced_logits(smol_fp32: str, llm: LLM) -> None:
    c, model = _client(smol_fp32), _model(smol_fp32)
    ids = llm.tokenizer.encode(PROMPT)
    ref = teacher_forced(llm, ids)
    only = c.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = only.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert only.usage is not None and only.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < 1e-4
        top = lp.top_logprobs[i]
        assert len(top) == 3
        best = ref[i - 1].topk(3)
        assert [llm.tokenizer.decode([t]) for t in best.indices.tolist()] == list(top)
        assert max(top.values()) == pytest.approx(float(best.values[0]), abs=1e-4)
    assert_idle(smol_fp32)


def test_echo_with_generated_tokens_streamed_and_not(smol_fp32: str, llm: LLM) -> None:
    c, model = _client(smol_fp32), _model(smol_fp32)
    ids = llm.tokenizer.encode(PROMPT)
    plain = c.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    full = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    text = full.choices[0].text
    assert text == PROMPT + plain.choices[0].text
    lp, gen = full.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and gen is not None and lp.token_logprobs and gen.token_logprobs and lp.tokens
    assert len(lp.tokens) == len(ids) + 4 and lp.tokens[len(ids) :] == gen.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(gen.token_logprobs, abs=1e-4)
    assert lp.text_offset is not None and lp.text_offset[len(ids)] == len(
        PROMPT
    )  # offsets into the echoed text
    chunks = list(
        c.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT  # the prompt comes first, with its logprobs
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    streamed: list[Any] = []
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.token_logprobs or []
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # Token-id prompts (what lm-eval sends), several at once, with n: each choice echoes its prompt.
    two = c.completions.create(model=model, prompt=[ids, ids[:5]], max_tokens=1, echo=True, n=2, logprobs=0)
    assert [
        ch.text.startswith(p)
        for ch, p in zip(two.choices, [PROMPT] * 2 + [llm.tokenizer.decode(ids[:5])] * 2, strict=True)
    ] == [True] * 4
    firsts = [ch.logprobs.token_logprobs[: len(ids)] for ch in two.choices[:2] if ch.logprobs]
    assert firsts[0] == firsts[1]  # the forked choice carries the same prompt scores
    streamed_two = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, echo=True, n=2, stream=True, logprobs=0
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for ch in streamed_two:
        for part in ch.choices:
            if not by_index[part.index]:
                assert part.text == PROMPT  # each choice's stream starts with the prompt
            by_index[part.index] += part.text
            offsets[part.index] += (part.logprobs.text_offset or []) if part.logprobs else []
    assert all(text.startswith(PROMPT) and len(text) > len(PROMPT) for text in by_index.values())
    for i, text in by_index.items():  # every token once, offsets into the choice's own echoed text
        assert len(offsets[i]) == len(ids) + 2 and offsets[i][len(ids)] == len(PROMPT)
        assert offsets[i] == sorted(offsets[i]) and offsets[i][-1] < len(text)
    assert_idle(smol_fp32)


def test_best_of_returns_the_candidate_of_highest_cumulative_logprob(smol_fp32: str) -> None:
    c, model = _client(smol_fp32), _model(smol_fp32)
    args: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.0}
    args["extra_body"] = {"ignore_eos": True}
    # best_of candidates run as n choices would (seed + j each), so n=3 shows all of them.
    every = c.completions.create(**args, n=3, seed=11, logprobs=0)
    totals = [sum(ch.logprobs.token_logprobs or []) for ch in every.choices if ch.logprobs]
    assert len(set(ch.text for ch in every.choices)) > 1
    best = c.completions.create(**args, best_of=3, seed=11)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # not asked, not shown
    assert best.choices[0].text == every.choices[totals.index(max(totals))].text
    assert best.usage is not None and best.usage.completion_tokens == 15  # every candidate's tokens
    two = c.completions.create(**args, best_of=3, n=2, seed=11, logprobs=0)
    assert [ch.text for ch in two.choices] == [
        every.choices[i].text for i in sorted(range(3), key=lambda i: -totals[i])[:2]
    ]
    assert_idle(smol_fp32)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"suffix": " end."}, "suffix"),  # SmolLM2 has no fill-in-the-middle tokens
        ({"max_tokens": 0}, "max_tokens"),  # only with echo
        ({"echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_echo_best_of_and_suffix_get_a_400_naming_the_field(
    smol_fp32: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{smol_fp32}/v1/completions",
        json={"model": _model(smol_fp32), "prompt": "Hello", "max_tokens": 2, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == param
    assert_idle(smol_fp32)


class _FimTokenizer:
    """A tokenizer whose vocabulary has StarCoder's FIM markers (one id each), words otherwise."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {t: i for i, t in enumerate(FIM_TOKENS[0])}

    def encode(self, text: str) -> list[int]:
        for marker, i in self.vocab.items():
            text = text.replace(marker, f" @{i} ")
        return [int(w[1:]) if w.startswith("@") else 100 + len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        raise NotImplementedError


def test_suffix_renders_the_prompt_in_fill_in_the_middle_order() -> None:
    req = CompletionRequest(model="m", prompt="def add(a, b):", suffix="return c")
    ids = completion_prompt_ids(req, _FimTokenizer())
    prefix, suffix, middle = 0, 1, 2
    assert ids == [[prefix, 100 + 3, 100 + 6, 100 + 3, suffix, 100 + 6, 100 + 1, middle]]
