"""tailserve.engine: request state, KV block manager, scheduler, the step loop and the async front."""

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.async_engine import AsyncEngine
from tailserve.engine.llm import LLM
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import RequestOutput, RequestTimings, SamplingParams
from tailserve.engine.stats import EngineStats

__all__ = [
    "AsyncEngine",
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "LLM",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "SchedulerConfig",
]
