"""What the policies see of a request body: its session key, its prompt as plain text, its cache_salt.

Chat messages are rendered role by role so that conversations sharing a history share a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tailserve.router.policies import RouteRequest

SESSION_HEADER = "x-session-id"


def _content_text(content: Any) -> str:
    """A message's content as text (a string, or the text parts of a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt (completions) or the rendered messages (chat, and the Responses API's
    instructions and input, rendered as the same messages) of an OpenAI request body."""
    messages = body.get("messages")
    if messages is None and "input" in body:
        messages = _responses_messages(body)
    if isinstance(messages, list):
        rendered = []
        for message in messages:
            if isinstance(message, dict):
                rendered.append(f"<|{message.get('role', '')}|>\n{_content_text(message.get('content'))}\n")
        return "".join(rendered)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first decides placement
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids
        return ",".join(str(t) for t in prompt) + ","
    return ""


def _responses_messages(body: Mapping[str, Any]) -> list[Any]:
    """/v1/responses: `instructions` as the system message, then `input` (a string, or items of
    which the messages count)."""
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += [item for item in given if isinstance(item, dict) and "role" in item]
    return messages


def route_request(body: Mapping[str, Any], headers: Mapping[str, str]) -> RouteRequest:
    """The session key (`user` field, else the X-Session-Id header), the prompt text and the
    `cache_salt` (a bad one is the replica's 400 to give; here it is no salt)."""
    user = body.get("user")
    key = user if isinstance(user, str) and user else headers.get(SESSION_HEADER) or None
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    return RouteRequest(session_key=key, prompt_text=prompt_text(body), cache_salt=salt)
