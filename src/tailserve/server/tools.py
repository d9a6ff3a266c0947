"""Tool calls: `tools` / `tool_choice` checked, the conversation rendered for the chat template, and
Hermes-style `<tool_call>{json}</tool_call>` output parsed into OpenAI tool calls, streamed or not.

A template that mentions `tools` gets them as Hugging Face passes them; any other template gets the
default tool prompt (a system block). `required` and a named function become a grammar (engine/
structured.py) so the output always parses. Pure functions and one parser class: no engine calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tailserve.engine.request import GrammarSpec
from tailserve.errors import InvalidRequestError

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# The start of a call body written name first: streamed from here on, argument text as it comes.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions are listed as JSON \
inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, reply with one JSON object per call, each inside <tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolSetup:
    """What a chat request's `tools` / `tool_choice` ask for."""

    tools: list[dict[str, Any]]  # OpenAI's shape: {"type": "function", "function": {...}}, checked
    render: bool  # the tools go into the prompt (not for tool_choice "none")
    parse: bool  # the output is parsed for <tool_call> blocks
    grammar: GrammarSpec | None  # tool_choice "required" or a named function: the call is forced


def tool_setup(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolSetup:
    """Check `tools` and `tool_choice` (a 400 names the field); the grammar that forces a call, if any."""
    checked = [_check_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequestError(
                f"'tool_choice' must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                "tool_choice",
            )
        forced = names if choice == "required" else []
    else:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                "'tool_choice' must look like {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in names:
            raise InvalidRequestError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        forced = [name]
    if choice != "auto" and choice != "none" and not checked:
        raise InvalidRequestError("'tool_choice' needs 'tools'", "tool_choice")
    grammar = None
    if forced:
        calls = [_call_schema(t) for t in checked if t["function"]["name"] in forced]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        grammar = GrammarSpec("tool_call", json.dumps(schema), param="tools")
    on = bool(checked) and choice != "none"
    return ToolSetup(checked, render=on, parse=on, grammar=grammar)


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidRequestError(f"'{param}' must be {{'type': 'function', 'function': {{...}}}}", param)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"'{param}.function.name' must be 1-64 letters, digits, '_', '-' or '.'", f"{param}.function.name"
        )
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise InvalidRequestError(
            f"'{param}.function.parameters' must be a JSON schema object", f"{param}.function.parameters"
        )
    if not isinstance(fn.get("description", ""), str):
        raise InvalidRequestError(
            f"'{param}.function.description' must be a string", f"{param}.function.description"
        )
    return {"type": "function", "function": fn}


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call body: name first (the stream parser relies on it), then arguments."""
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ----- rendering ---------------------------------------------------------------------------------
def template_messages(
    messages: list[dict[str, Any]], setup: ToolSetup, template_has_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. `messages` hold role, content (text), and for
    assistants `tool_calls` / for tools `tool_call_id`, already checked by `check_history`.

    A tool-aware template gets the messages as Hugging Face passes them (arguments as objects) and the
    tools; any other template gets plain turns: the default tool prompt in the system message, calls
    written as <tool_call> blocks, tool results as user turns in <tool_response> tags (as Qwen2.5's)."""
    tools = setup.tools if setup.render else None
    if template_has_tools:
        out = []
        for m in messages:
            one = {k: v for k, v in m.items() if k != "tool_calls"}
            if m.get("tool_calls"):
                one["tool_calls"] = [_hf_call(c) for c in m["tool_calls"]]
            out.append(one)
        return out, tools
    plain: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if plain and plain[-1]["role"] == "user" and plain[-1].get("tool_response"):
                plain[-1]["content"] += "\n" + text  # consecutive results share one turn
            else:
                plain.append({"role": "user", "content": text, "tool_response": True})
        elif m.get("tool_calls"):
            blocks = [
                f"{OPEN_TAG}\n{json.dumps(_hf_call(c)['function'], ensure_ascii=False)}\n{CLOSE_TAG}"
                for c in m["tool_calls"]
            ]
            plain.append(
                {"role": m["role"], "content": "\n".join([m["content"], *blocks] if m["content"] else blocks)}
            )
        else:
            plain.append({"role": m["role"], "content": m["content"]})
    for m in plain:
        m.pop("tool_response", None)
    if tools:
        block = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if plain and plain[0]["role"] in ("system", "developer"):
            plain[0] = {**plain[0], "content": f"{plain[0]['content']}\n\n{block}"}
        else:
            plain.insert(0, {"role": "system", "content": block})
    return plain, None


def _hf_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function",
        "id": call.get("id"),
        "function": {"name": fn["name"], "arguments": fn["arguments"]},
    }


def check_tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with each call's JSON arguments decoded (a 400 names the field)."""
    base = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"'{base}' must be a list", base)
    out = []
    for j, call in enumerate(calls):
        param = f"{base}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                f"'{param}' must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param
            )
        raw = fn.get("arguments", "{}")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise InvalidRequestError(
                f"'{param}.function.arguments' must be a JSON object (as a string)",
                f"{param}.function.arguments",
            )
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


# ----- parsing -----------------------------------------------------------------------------------
@dataclass
class _Call:
    index: int
    body: str = ""  # text after <tool_call>
    head_end: int = -1  # where the argument text starts in `body` (-1: name not known yet)
    sent: int = 0  # argument characters already emitted


@dataclass
class ToolCallStream:
    """Hermes-style output -> OpenAI chat deltas, fed the text as it comes in any pieces.

    Content outside <tool_call> blocks goes out as `content` deltas (whitespace next to a call is
    dropped); a call goes out as a header delta (index, id, type, function.name, empty arguments)
    and then argument fragments that concatenate to the call's arguments JSON. A block that does not
    parse as {"name", "arguments"} goes out as content. Non-streamed responses run the same parser.
    """

    max_calls: int | None = None  # parallel_tool_calls false: 1, and the output ends after that call
    calls: int = 0
    _held: str = ""  # text not yet sent: a possible partial <tool_call>, or whitespace
    _call: _Call | None = None
    _after_call: bool = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that `text` (the next piece of output) makes certain."""
        out: list[dict[str, Any]] = []
        rest = text
        while rest:
            rest = self._outside(rest, out) if self._call is None else self._inside(rest, out)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: what is still held goes out (a cut-off call's body as content)."""
        out: list[dict[str, Any]] = []
        if self._call is not None and self._call.head_end < 0:
            out.append({"content": OPEN_TAG + self._call.body})
        elif self._call is None and self._held and (self.calls == 0 or self._held.strip()):
            out.append({"content": self._held})
        self._call, self._held = None, ""
        return out

    def _outside(self, text: str, out: list[dict[str, Any]]) -> str:
        if self.max_calls is not None and self.calls >= self.max_calls:
            self._held = ""  # one call asked for, one made: what the model writes after it is dropped
            return ""
        buf = self._held + text
        self._held = ""
        if self._after_call:  # whitespace right after a call is dropped
            buf = buf.lstrip()
            self._after_call = not buf
        at = buf.find(OPEN_TAG)
        if at >= 0:
            if buf[:at].strip():
                out.append({"content": buf[:at].rstrip()})
            self._call = _Call(self.calls)
            return buf[at + len(OPEN_TAG) :]
        keep = _partial_tag(buf)
        self._content(buf[: len(buf) - keep], out)
        self._held += buf[len(buf) - keep :]
        return ""

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        """Send text but hold its trailing whitespace (dropped if a call follows)."""
        body = text.rstrip()
        if body:
            out.append({"content": body})
        self._held = text[len(body) :]

    def _inside(self, text: str, out: list[dict[str, Any]]) -> str:
        call = self._call
        assert call is not None
        call.body += text
        end = call.body.find(CLOSE_TAG)
        body = call.body if end < 0 else call.body[:end]
        if call.head_end < 0 and (m := _CALL_HEAD.match(body)) and (name := _json_string(m.group(1))):
            call.head_end = m.end()
            out.append(self._header(name, call.index))
        # Arguments written as a JSON string ("{\"a\": 1}") are decoded whole when the block closes:
        # streamed as they come, a client would get the string literal, quotes and escapes included.
        as_string = call.head_end >= 0 and body[call.head_end :].startswith('"')
        if call.head_end >= 0 and not as_string:
            args = body[call.head_end :]
            cut = args.rfind("}")  # the body's own closing brace may be this one: held back until the end
            upto = len(args[: cut if cut >= 0 else len(args)].rstrip())
            if upto > call.sent:
                out.append(self._fragment(call.index, args[call.sent : upto]))
                call.sent = upto
        if end < 0:
            return ""
        self._call = None
        if call.head_end < 0:
            parsed = _parse_body(body)
            if parsed is None:
                out.append({"content": OPEN_TAG + body + CLOSE_TAG})
                return call.body[end + len(CLOSE_TAG) :]
            out.append(self._header(parsed[0], call.index))
            out.append(self._fragment(call.index, parsed[1]))
        else:
            if as_string:
                parsed = _parse_body(body)
                args = body[call.head_end :].rstrip().removesuffix("}").rstrip()
                out.append(self._fragment(call.index, parsed[1] if parsed else args))
            self._after_call = True
        return call.body[end + len(CLOSE_TAG) :]

    def _header(self, name: str, index: int) -> dict[str, Any]:
        self.calls += 1
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        fn = {"name": name, "arguments": ""}
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": fn}]}

    @staticmethod
    def _fragment(index: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that could begin <tool_call>."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


def _json_string(escaped: str) -> str | None:
    try:
        value = json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) and value else None


def _parse_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call body written in any key order, or None if it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def assemble(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Deltas -> (content or None, OpenAI `message.tool_calls`), as a client reassembles a stream."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function", "function": dict(c["function"])}
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return (content or None), [calls[i] for i in sorted(calls)]


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output -> (content or None, tool calls): the stream parser fed everything at once."""
    stream = ToolCallStream(max_calls)
    return assemble(stream.feed(text) + stream.finish())
