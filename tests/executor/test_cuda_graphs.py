"""Decode steps through DecodeGraphRunner's padded static buffers equal ModelRunner's eager steps.

On CPU the static-shape path runs eagerly (same padding, same metadata); the CUDA-graph replay
tests need a GPU and skip without one.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tailserve.executor.cuda_graphs import DecodeGraphRunner
from tailserve.executor.runner import ModelRunner, SeqChunk
from tailserve.model.sampler import SamplingSpec
from tailserve.model.transformer import TransformerLM
from tailserve.weights.loader import LoadedModel, load_model

PAGE = 8
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("dummy:tiny", torch.float32)


def _runner(loaded: LoadedModel, device: str = "cpu") -> ModelRunner:
    model = TransformerLM(loaded.arch, loaded.weights, 128).to(device)
    return ModelRunner(model, NUM_BLOCKS, PAGE, torch.device(device))


PROMPTS = [list(range(5, 18)), list(range(30, 38)), list(range(60, 63))]  # 13, 8 (a full block), 3 tokens
TABLES = [[3, 9, 4, 1], [7, 2, 11], [5, 0, 8]]  # scattered blocks; block 0 in use by a real sequence


def _prefill(runners: list[ModelRunner]) -> Sequence[int | None]:
    chunks = [
        SeqChunk(p, 0, t, True, SamplingSpec(temperature=0.0)) for p, t in zip(PROMPTS, TABLES, strict=True)
    ]
    outs = [r.execute(chunks).tokens for r in runners]
    assert all(o == outs[0] for o in outs)
    return outs[0]


def _decodes(seqs: list[list[int]]) -> list[SeqChunk]:
    return [
        SeqChunk([s[-1]], len(s) - 1, t, True, SamplingSpec(temperature=0.0), decode=True)
        for s, t in zip(seqs, TABLES, strict=True)
    ]


def test_padded_static_decode_equals_eager_steps(tiny: LoadedModel) -> None:
    """Greedy tokens, logits and the whole KV pool agree step by step; 3 decodes run padded to 4."""
    eager, wrapped = _runner(tiny), _runner(tiny)
    graphs = DecodeGraphRunner(wrapped, batch_sizes=(1, 2, 4), max_context=64)
    assert not graphs.use_graphs and graphs.padded_size(3) == 4
    first = _prefill([eager, wrapped])
    seqs = [p + [t] for p, t in zip(PROMPTS, first, strict=True) if t is not None]
    for _ in range(12):  # crosses block boundaries (8 -> 9, 16 -> 17 tokens)
        chunks = _decodes(seqs)
        before = wrapped.kv_pool.clone()
        want = eager.logits_for(chunks)
        got = graphs.decode_logits(chunks).clone()
        assert (got - want).abs().max().item() < 1e-5
        written = (wrapped.kv_pool != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
        own = sorted(c.block_table[c.start_pos // PAGE] * PAGE + c.start_pos % PAGE for c in chunks)
        assert sorted(written) == own, "padding wrote a slot no real sequence owns"
        tokens = graphs.execute(chunks).tokens
        assert tokens == eager.execute(chunks).tokens
        # Different batch shapes may round differently in the last bit.
        assert torch.allclose(wrapped.kv_pool, eager.kv_pool, atol=1e-5)
        seqs = [s + [t] for s, t in zip(seqs, tokens, strict=True) if t is not None]


def test_batches_it_cannot_replay_run_eagerly(tiny: LoadedModel) -> None:
    """A prefill in the batch, or more decodes than the largest size, falls back to the runner."""
    eager, wrapped = _runner(tiny), _runner(tiny)
    graphs = DecodeGraphRunner(wrapped, batch_sizes=(1, 2), max_context=64)
    first = _prefill([eager, wrapped])
    seqs = [p + [t] for p, t in zip(PROMPTS, first, strict=True) if t is not None]
    chunks = _decodes(seqs)
    assert not graphs.can_run(chunks)
    assert graphs.execute(chunks) == eager.execute(chunks)
    mixed = [chunks[0], SeqChunk([1, 2, 3], 0, [6], True, SamplingSpec(temperature=0.0))]
    assert not graphs.can_run(mixed)
    with pytest.raises(ValueError):
        graphs.decode_logits(mixed)


def test_the_switch_decides_which_path_a_decode_step_takes(tiny: LoadedModel) -> None:
    """With graphs attached and the switch on, decode-only steps go through them; off, they run eagerly.

    Prefill steps always run eagerly. Tokens are the same either way."""
    eager, switched = _runner(tiny), _runner(tiny)
    graphs = DecodeGraphRunner(switched, batch_sizes=(1, 2, 4), max_context=64)
    switched.attach_decode_graphs(graphs)
    first = _prefill([eager, switched])
    assert (switched.num_graph_steps, switched.num_eager_steps) == (0, 1)  # the prefill
    seqs = [p + [t] for p, t in zip(PROMPTS, first, strict=True) if t is not None]
    for use_graphs in (True, False, True):
        switched.use_decode_graphs = use_graphs
        graph_steps, eager_steps = switched.num_graph_steps, switched.num_eager_steps
        chunks = _decodes(seqs)
        tokens = switched.execute(chunks).tokens
        assert tokens == eager.execute(chunks).tokens
        assert switched.num_graph_steps - graph_steps == int(use_graphs)
        assert switched.num_eager_steps - eager_steps == int(not use_graphs)
        seqs = [s + [t] for s, t in zip(seqs, tokens, strict=True) if t is not None]


def test_the_runner_refuses_a_batch_with_decodes_after_prompts(tiny: LoadedModel) -> None:
    runner = _runner(tiny)
    _prefill([runner])
    decode = SeqChunk([7], 13, TABLES[0], True, SamplingSpec(temperature=0.0), decode=True)
    prompt = SeqChunk([1, 2, 3], 0, [6], True, SamplingSpec(temperature=0.0))
    with pytest.raises(ValueError, match="before prompt chunks"):
        runner.execute([prompt, decode])


def test_graphs_refuse_a_cpu_runner(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(_runner(tiny), use_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_equals_eager_on_cuda(tiny: LoadedModel) -> None:
    """Captured graphs replay the eager forward: same tokens, logits within fp32 noise, same KV pool."""
    backend = None
    try:
        from tailserve.model.triton_attention import TritonPagedAttention

        backend = TritonPagedAttention()
    except ImportError:
        pass
    runners = []
    for _ in range(2):
        r = _runner(tiny, "cuda")
        if backend is not None:
            r.backend = backend
        runners.append(r)
    eager, wrapped = runners
    graphs = DecodeGraphRunner(wrapped, batch_sizes=(1, 2, 4, 8), max_context=64)
    assert graphs.use_graphs
    first = _prefill([eager, wrapped])
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    seqs = [p + [t] for p, t in zip(PROMPTS, first, strict=True) if t is not None]
    for _ in range(10):
        chunks = _decodes(seqs)
        want = eager.logits_for(chunks)
        got = graphs.decode_logits(chunks).clone()
        assert (got - want).abs().max().item() < 1e-3
        tokens = graphs.execute(chunks).tokens
        assert tokens == eager.execute(chunks).tokens
        seqs = [s + [t] for s, t in zip(seqs, tokens, strict=True) if t is not None]
    assert torch.allclose(wrapped.kv_pool, eager.kv_pool, atol=1e-3)
