"""Shared fixtures: the real default model (SmolLM2-135M GGUF), loaded once per test session."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.weights.loader import LoadedModel, default_model_path, load_model

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Building an engine sets the process's torch thread count (its --num-threads): put it back, so
    no test runs on what an earlier one left (the suite passes in any order: --random-order)."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _unfreeze_the_heap() -> Iterator[None]:
    """A server freezes the heap once ready (tailserve.server.app): thaw it after each test, so the
    objects a finished test leaves frozen can still be collected."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """SmolLM2-135M-Instruct dequantized to fp32 by our GGUF loader."""
    return load_model("default", torch.float32)


@pytest.fixture(scope="session")
def hf_reference() -> torch.nn.Module:
    """The same GGUF file loaded by Hugging Face transformers' own GGUF path (independent of ours)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


EngineFactory = Callable[..., object]


@pytest.fixture
def engine_config() -> Callable[..., EngineConfig]:
    """Build an EngineConfig for the default model with overrides per concern."""

    def make(
        kv_cache_memory_bytes: int | None = 64 << 20,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        **scheduler: object,
    ) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=2048),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(**scheduler),  # type: ignore[arg-type]
        )

    return make
