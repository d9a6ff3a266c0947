"""Tool calls: the Hermes parser (whole and streamed at any split), the default tool prompt on the
real default model, `tool_choice` forced through the grammar so the output always parses, and the
Hermes path through a tool-aware template of our own on a dummy Qwen2.5-shaped model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine
from tailserve.errors import InvalidRequestError
from tailserve.server.config import ServerConfig
from tailserve.server.tools import ToolCallStream, assemble, parse_tool_calls, template_messages, tool_setup
from tailserve.weights.arch import preset
from tailserve.weights.loader import LoadedModel, hf_weight_shapes
from tailserve.weights.tokenizer import ByteTokenizer, Tokenizer
from tests.server.harness import threaded_server
from tests.server.test_structured_outputs import engine_state

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _call_view(result: tuple[str | None, list[dict[str, Any]]]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]): everything but the random call ids."""
    return result[0], [(c["function"]["name"], c["function"]["arguments"]) for c in result[1]]


# ----- the parser --------------------------------------------------------------------------------
OUTPUTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}is", "unit": {"x": 1}}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {"zone": "utc"}, "name": "get_time"}\n</tool_call>\n',
    "no call here, only a < and a <tool that is not one  ",
    "<tool_call>{not json}</tool_call> and text after",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off by max_tokens
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}\n</tool_call>',  # as a string
]


def test_parser_reads_calls_content_and_junk() -> None:
    content, calls = _call_view(parse_tool_calls(OUTPUTS[0]))
    assert content == "Let me check."
    assert calls == [
        ("get_weather", '{"city": "Par}is", "unit": {"x": 1}}'),
        ("get_time", '{"zone": "utc"}'),
    ]
    assert _call_view(parse_tool_calls(OUTPUTS[1])) == (OUTPUTS[1], [])
    assert _call_view(parse_tool_calls(OUTPUTS[2])) == (OUTPUTS[2], [])  # not a call: left as text
    assert _call_view(parse_tool_calls(OUTPUTS[3]))[1] == [("get_weather", '{"city": "Pa')]
    # parallel_tool_calls false: the first call only, and nothing the model wrote after it.
    assert _call_view(parse_tool_calls(OUTPUTS[0], max_calls=1)) == (
        "Let me check.", [("get_weather", '{"city": "Par}is", "unit": {"x": 1}}')]
    )  # fmt: skip
    # Arguments the model wrote as a JSON string arrive decoded: json.loads gives the object.
    assert _call_view(parse_tool_calls(OUTPUTS[4]))[1] == [("get_time", '{"zone": "utc"}')]
    whole = parse_tool_calls(OUTPUTS[0])[1]
    assert [c["type"] for c in whole] == ["function"] * 2 and len({c["id"] for c in whole}) == 2


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_deltas_reassemble_to_the_whole_parse_at_any_two_cuts(text: str) -> None:
    whole = _call_view(parse_tool_calls(text))
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            stream = ToolCallStream()
            deltas = stream.feed(text[:i]) + stream.feed(text[i:j]) + stream.feed(text[j:]) + stream.finish()
            assert _call_view(assemble(deltas)) == whole, (i, j)


def test_streamed_call_starts_with_its_header_then_argument_fragments() -> None:
    stream = ToolCallStream()
    deltas = [d for ch in OUTPUTS[0] for d in stream.feed(ch)] + stream.finish()  # one character at a time
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = calls[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [c["function"]["arguments"] for c in calls[1:] if c["index"] == 0]
    assert len(fragments) > 5  # arguments streamed as they came, not in one piece at the end
    assert "".join(fragments) == '{"city": "Par}is", "unit": {"x": 1}}'


# ----- checking and rendering ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools[0].function.name"),
        ([{"type": "retrieval"}], "auto", "tools[0]"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            "auto",
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_and_tool_choice_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        tool_setup(tools, choice)
    assert err.value.param == param


def test_default_tool_prompt_for_a_template_without_tools() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
        ]},
        {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
    ]  # fmt: skip
    messages, tools = template_messages(history, tool_setup(TOOLS, "auto"), template_has_tools=False)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert (
        system.startswith("Be brief.\n\n# Tools")
        and json.dumps(WEATHER) in system
        and "<tool_call>" in system
    )
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\n21 C\n</tool_response>"
    none, _ = template_messages(history[:2], tool_setup(TOOLS, "none"), template_has_tools=False)
    assert "# Tools" not in none[0]["content"]  # tool_choice none: the model is not offered the tools


# ----- the real default model (SmolLM2: no tools in its template) --------------------------------
@pytest.fixture(scope="module")
def smol_base(smol: LoadedModel) -> Iterator[str]:
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=2048),
        cache=CacheConfig(kv_cache_memory_bytes=128 << 20),
        scheduler=SchedulerConfig(slo_ttft_s=60.0, slo_tpot_s=60.0),
    )
    with threaded_server(AsyncEngine(config, loaded=smol), ServerConfig()) as url:
        yield url


def _streamed_calls(chunks: list[Any]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """What a client rebuilds from streamed chat chunks: content, [(name, arguments)], finish reason."""
    content, calls, reason = "", {}, None
    for ch in chunks:
        for choice in ch.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.type == "function" and tc.function.arguments == ""
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    calls[tc.index][1] += tc.function.arguments
            reason = choice.finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason  # type: ignore[misc]


def _check_args(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 12
    else:
        assert args == {"zone": args["zone"]} and args["zone"] in ("utc", "cet")


def test_required_tool_choice_always_parses_into_tool_calls(smol_base: str) -> None:
    async def one(c: openai.AsyncOpenAI, seed: int) -> Any:
        return await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            temperature=1.0, seed=seed, max_tokens=60,
        )  # fmt: skip

    async def main() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{smol_base}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(c, s) for s in range(4)))

    for out in asyncio.run(main()):
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _check_args(call.function.name, call.function.arguments)


def test_streamed_tool_call_deltas_equal_the_non_streamed_call(smol_base: str) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    c = openai.OpenAI(base_url=f"{smol_base}/v1", api_key="unused", max_retries=0, timeout=300)
    args: dict[str, Any] = dict(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0,
        seed=11, max_tokens=60,
    )  # fmt: skip
    whole = c.chat.completions.create(**args).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert len(calls) == 1 and whole.finish_reason == "tool_calls"
    assert calls[0][0] == "get_time"
    _check_args(*calls[0])
    content, streamed, reason = _streamed_calls(list(c.chat.completions.create(**args, stream=True)))
    assert streamed == calls and content == whole.message.content and reason == "tool_calls"


def test_a_conversation_with_tool_results_answers(smol_base: str) -> None:
    c = openai.OpenAI(base_url=f"{smol_base}/v1", api_key="unused", max_retries=0, timeout=300)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]  # fmt: skip
    out = c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=8,  # type: ignore[arg-type]
    )
    assert out.choices[0].message.content and out.usage is not None and out.usage.prompt_tokens > 100


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "21 C"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "c1"}]}, "messages[1].content"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
    ]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "no-such"}}}],
      "tool_choice": "required"}, "tools"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_tool_inputs_are_a_400_naming_the_field_and_change_nothing(
    smol_base: str, extra: dict[str, Any], param: str
) -> None:
    before = engine_state(smol_base)
    body = {"model": "SmolLM2-135M-Instruct", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{smol_base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    after = engine_state(smol_base)
    assert after == before and after["tailserve_requests_running"] == after["tailserve_kv_blocks_used"] == 0


# ----- the Hermes path: a tool-aware template of our own on a dummy Qwen2.5-shaped model -------------
# Written for this test in the shape of Qwen2.5's: tools listed in the system turn, calls as
# <tool_call> JSON, results in <tool_response> inside a user turn.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class TemplatedBytes(ByteTokenizer):
    """The dummy byte tokenizer with a chat template, rendered as Hugging Face renders one."""

    chat_template = HERMES_TEMPLATE

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:  # fmt: skip
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v: json.dumps(v)
        return env.from_string(HERMES_TEMPLATE).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )


def _dummy_qwen() -> LoadedModel:
    """Qwen2.5's architecture (qwen2 family: QKV bias, GQA) at a test size, random weights."""
    arch = dataclasses.replace(
        preset("qwen2.5-0.5b"), vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_position_embeddings=4096, eos_token_ids=(2,), bos_token_id=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.05
        for name, shape in hf_weight_shapes(arch).items()
    }
    tok = Tokenizer(TemplatedBytes(arch.vocab_size), [2], "dummy-qwen-tools")
    return LoadedModel(name="dummy-qwen-tools", arch=arch, weights=weights, tokenizer=tok, load_s=0.0)


@pytest.fixture(scope="module")
def qwen_base() -> Iterator[tuple[str, Tokenizer]]:
    loaded = _dummy_qwen()
    config = EngineConfig(
        model=ModelConfig(model="dummy:qwen2.5-0.5b", dtype="float32", device="cpu", max_model_len=4096),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
        scheduler=SchedulerConfig(slo_ttft_s=60.0, slo_tpot_s=60.0),
    )
    with threaded_server(AsyncEngine(config, loaded=loaded), ServerConfig()) as url:
        yield url, loaded.tokenizer


def test_hermes_template_gets_the_tools_and_history(qwen_base: tuple[str, Tokenizer]) -> None:
    _, tok = qwen_base
    assert tok.supports_tools
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
        ]},
        {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
    ]  # fmt: skip
    messages, tools = template_messages(history, tool_setup(TOOLS, "auto"), template_has_tools=True)
    text = tok.decode(tok.apply_chat_template(messages, tools))
    assert json.dumps(WEATHER) in text and "# Tools" in text  # the template's own rendering, not ours
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        in text
    )
    assert "<tool_response>\n21 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("stream", [False, True])
def test_hermes_forced_call_parses_on_the_dummy_model(qwen_base: tuple[str, Tokenizer], stream: bool) -> None:
    base, _ = qwen_base
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    args: dict[str, Any] = dict(
        model="dummy-qwen-tools", messages=ASK, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=5,
        max_tokens=200,
    )  # fmt: skip
    if stream:
        _, calls, reason = _streamed_calls(list(c.chat.completions.create(**args, stream=True)))
    else:
        choice = c.chat.completions.create(**args).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        reason = choice.finish_reason
    assert reason == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_weather", calls
    _check_args(*calls[0])
