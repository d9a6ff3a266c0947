"""LLM: the offline interface. Give it prompts, get completions; batching is the engine's business."""

from __future__ import annotations

from collections.abc import Sequence

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import RequestOutput, SamplingParams
from tailserve.weights.loader import LoadedModel


class LLM:
    """`LLM(model=...).generate(prompts, SamplingParams(...))` runs every prompt to completion."""

    def __init__(
        self,
        model: str = "default",
        *,
        config: EngineConfig | None = None,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        loaded: LoadedModel | None = None,
        **model_kwargs: object,
    ) -> None:
        if config is None:
            config = EngineConfig(
                model=ModelConfig(model=model, **model_kwargs),  # type: ignore[arg-type]
                cache=cache or CacheConfig(),
                scheduler=scheduler or SchedulerConfig(),
            )
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Stop the tensor-parallel workers and the KV-event publisher, if any; the LLM cannot generate
        afterwards."""
        self.engine.close()

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Final outputs in prompt order. Strings are tokenized (as a user turn if `chat`)."""
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        ids: list[str] = []
        for prompt, p in zip(prompts, params_list, strict=True):
            token_ids = self._tokens(prompt, chat)
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, token_ids, p)
            ids.append(rid)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]

    def _tokens(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)
