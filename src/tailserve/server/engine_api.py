"""The slice of the engine API the server relies on (docs/INTERFACES.md), as typing Protocols.

Lets the server be type-checked and unit-tested without importing torch; it must never grow beyond
what the contract documents.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from tailserve.engine.request import RequestOutput, SamplingParams


class Tokenizer(Protocol):
    """Text <-> token ids, and the chat template with the generation prompt appended."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


class EngineStats(Protocol):
    """A snapshot of the engine's queues, KV pool and prefix cache."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def kv_blocks_used(self) -> int: ...

    @property
    def prefix_cache_queries(self) -> int: ...

    @property
    def prefix_cache_hits(self) -> int: ...

    @property
    def preemptions_total(self) -> int: ...


class Engine(Protocol):
    """What `create_app` needs from `tailserve.engine.AsyncEngine`."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def estimate_wait_s(self, num_prompt_tokens: int) -> float: ...
