"""Teacher-forced logits through our paged path equal Hugging Face transformers' on the same GGUF."""

from __future__ import annotations

import torch

from tailserve.engine.block_manager import KVCacheManager
from tailserve.executor.runner import ModelRunner, SeqChunk
from tailserve.model.sampler import SamplingSpec
from tailserve.model.transformer import TransformerLM
from tailserve.weights.loader import LoadedModel

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "In 1905, Albert Einstein published four papers that changed physics: ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris is the capital of",
]


def _reference_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"max relative error {rel:.2e}"


def test_weights_match_transformers_gguf_loader(smol: LoadedModel, hf_reference: torch.nn.Module) -> None:
    """Our dequantization and Q/K un-permutation give exactly transformers' tensors."""
    ref = hf_reference.state_dict()
    for name, tensor in smol.weights.items():
        assert torch.allclose(tensor, ref[name], atol=1e-6), name


def test_paged_batch_logits_match_reference(smol: LoadedModel, hf_reference: torch.nn.Module) -> None:
    """Plain prefill, chunked prefill, decode and a prefix-cache hit, all in concurrent batches."""
    tok = smol.tokenizer
    seqs = [tok.encode(p) for p in PROMPTS]
    shared = seqs[0] + tok.encode(" And then it slept.")  # shares seqs[0]'s full blocks
    refs = [_reference_logits(hf_reference, s + [s[-1]]) for s in seqs]
    ref_shared = _reference_logits(hf_reference, shared)

    model = TransformerLM(smol.arch, smol.weights, 1024)
    bs = 16
    kv = KVCacheManager(num_blocks=64, block_size=bs)
    runner = ModelRunner(model, 64, bs, torch.device("cpu"))
    spec = SamplingSpec(temperature=0.0)

    def chunk(i: int, ids: list[int], start: int, end: int, decode: bool = False) -> SeqChunk:
        assert kv.allocate(str(i), end)
        return SeqChunk(ids[start:end], start, kv.block_table(str(i)), end == len(ids), spec, decode)

    # Step 1: seq 0 whole, seq 1 whole, seq 2 first 7 tokens (chunked), seq 3 whole.
    cut = 7
    step1 = [
        chunk(0, seqs[0], 0, len(seqs[0])),
        chunk(1, seqs[1], 0, len(seqs[1])),
        chunk(2, seqs[2], 0, cut),
    ]
    step1.append(chunk(3, seqs[3], 0, len(seqs[3])))
    out1 = runner.logits_for(step1)
    # Step 2: decodes for 0, 1, 3 (teacher-forced: feed the last prompt token again), the rest of seq 2.
    ext = [s + [s[-1]] for s in seqs]
    step2 = [chunk(i, ext[i], len(seqs[i]), len(seqs[i]) + 1, decode=True) for i in (0, 1, 3)]
    step2.append(chunk(2, ext[2], cut, len(ext[2])))
    out2 = runner.logits_for(step2)

    sizes1 = [len(seqs[0]), len(seqs[1]), cut, len(seqs[3])]
    got1 = dict(zip((0, 1, 2, 3), torch.split(out1, sizes1), strict=True))
    got2 = dict(zip((0, 1, 3, 2), torch.split(out2, [1, 1, 1, len(ext[2]) - cut]), strict=True))
    for i in (0, 1, 3):
        _assert_close(torch.cat([got1[i], got2[i]]), refs[i])
    _assert_close(torch.cat([got1[2], got2[2]]), refs[2])

    # A prefix-cache hit: seq 0's full blocks are registered, a new sequence reuses them.
    kv.commit("0", ext[0], len(ext[0]))
    cached = kv.match_prefix("shared", shared)
    assert cached == (len(seqs[0]) // bs) * bs and cached > 0
    assert kv.allocate("shared", len(shared))
    hit = runner.logits_for([SeqChunk(shared[cached:], cached, kv.block_table("shared"), True, spec)])
    _assert_close(hit, ref_shared[cached:])
