"""tailserve.engine: request state, KV block manager, scheduler, the step loop and the async front.

Names are imported on first use, so `tailserve.engine.cli` (and every other CLI command) starts
without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "tailserve.engine.async_engine",
    "LLM": "tailserve.engine.llm",
    "LLMEngine": "tailserve.engine.llm_engine",
    "RequestOutput": "tailserve.engine.request",
    "RequestTimings": "tailserve.engine.request",
    "SamplingParams": "tailserve.engine.request",
    "EngineStats": "tailserve.engine.stats",
    "CacheConfig": "tailserve.config",
    "EngineConfig": "tailserve.config",
    "ModelConfig": "tailserve.config",
    "SchedulerConfig": "tailserve.config",
}

if TYPE_CHECKING:
    from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tailserve.engine.async_engine import AsyncEngine
    from tailserve.engine.llm import LLM
    from tailserve.engine.llm_engine import LLMEngine
    from tailserve.engine.request import RequestOutput, RequestTimings, SamplingParams
    from tailserve.engine.stats import EngineStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tailserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "AsyncEngine",
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "SchedulerConfig",
]
