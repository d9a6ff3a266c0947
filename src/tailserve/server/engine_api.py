"""The slice of the engine API the server relies on (docs/INTERFACES.md), as typing Protocols.

Lets the server be type-checked and unit-tested without importing torch; it must never grow beyond
what the contract documents. Stats and limits are the engine's own types (engine/stats.py,
config.py), which import no torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

from tailserve.config import EngineConfig
from tailserve.engine.quote import Admitted, WaitQuote
from tailserve.engine.request import GrammarSpec, RequestOutput, SamplingParams, SloTarget
from tailserve.engine.stats import EngineStats

T = TypeVar("T")


class Tokenizer(Protocol):
    """Text <-> token ids, and the chat template with the generation prompt appended."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def supports_tools(self) -> bool:
        """The chat template reads `tools` itself (else server/tools.py writes the default tool prompt)."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...


class Engine(Protocol):
    """What `create_app` needs from `tailserve.engine.AsyncEngine`."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def config(self) -> EngineConfig: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Compile a structured-output grammar off the step loop (cached); a bad one raises a 400."""
        ...

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        admit: Callable[[WaitQuote], T],
        *,
        slo: SloTarget | None = None,
        fork_of: str | None = None,
    ) -> Admitted[T]:
        """Price the request once (WaitQuote: prompt work less the cached prefix, TTFT target,
        predicted wait), call `admit` with the price (raising refuses: nothing is queued), queue it:
        the one call per request of the HTTP flow. `slo`: its latency targets (None: the engine's);
        `fork_of`: the engine request whose prompt it shares (n > 1)."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request without admission (the server's warm-up); errors arrive on iteration."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def flush_prefix_cache(self, force: bool = False) -> bool:
        """Empty the prefix cache between steps; False (nothing changed) while requests are queued or
        running, unless forced."""
        ...
