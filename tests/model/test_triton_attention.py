"""The Triton backend equals the portable torch backend in fp32 (within 1e-4).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before the
kernels are defined); with CUDA they are compiled. Tiny shapes; cases cover grouped-query heads,
contexts ending on and across block boundaries, split-K decode with its reduction, and prefill
chunks on top of a cached prefix.
"""

from __future__ import annotations

import os
import sys

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    # Read when a kernel is defined, i.e. when tailserve.model.triton_attention is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
_IMPORTED_EARLY = "tailserve.model.triton_attention" in sys.modules

import random  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.6.0)")

from tailserve.executor.runner import ModelRunner, SeqChunk  # noqa: E402
from tailserve.model.attention import AttentionMetadata, PrefillSpan, TorchPagedAttention  # noqa: E402
from tailserve.model.sampler import SamplingSpec  # noqa: E402
from tailserve.model.transformer import TransformerLM  # noqa: E402
from tailserve.model.triton_attention import TritonPagedAttention  # noqa: E402
from tailserve.weights.loader import load_model  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
if not ON_CUDA and (_IMPORTED_EARLY or os.environ.get("TRITON_INTERPRET") != "1"):
    pytest.skip(
        "without CUDA the kernels need TRITON_INTERPRET=1 before tailserve.model.triton_attention is imported",
        allow_module_level=True,
    )


def _interpreter_numpy24_fix() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (shape [1]) into a loop bound with int(), which
    numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by squeezing first)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_index", False):
        return

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if not ON_CUDA:
    _interpreter_numpy24_fix()

TOL = 1e-4


@dataclass
class Seq:
    """One sequence of a step: `cached` tokens already in the cache, `new` tokens this step."""

    cached: int
    new: int


def _build(
    seqs: list[Seq], kv_heads: int, dim: int, page: int, num_blocks: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random KV pool (blocks handed out shuffled) and the step's metadata, as ModelRunner lays them out."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((2, num_blocks * page, kv_heads, dim), generator=gen)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    ordered = sorted(seqs, key=lambda s: not _is_decode(s))  # decodes first, like ModelRunner
    tables: list[list[int]] = []
    slots: list[int] = []
    spans: list[PrefillSpan] = []
    qsl = [0]
    for s in ordered:
        total = s.cached + s.new
        table = [free.pop() for _ in range(-(-total // page))]
        tables.append(table)
        slots.extend(table[p // page] * page + p % page for p in range(s.cached, total))
        if not _is_decode(s):
            prefix = torch.tensor(table[: -(-s.cached // page)], dtype=torch.long) if s.cached else None
            spans.append(PrefillSpan(qsl[-1], s.new, s.cached, _dev(prefix)))
        qsl.append(qsl[-1] + s.new)
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    seq_lens = torch.tensor([s.cached + s.new for s in ordered], dtype=torch.long)
    d = sum(_is_decode(s) for s in seqs)
    dec_lens = seq_lens[:d]
    dec_blocks = -(-int(dec_lens.max()) // page) if d else 0
    span = torch.arange(dec_blocks * page)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        num_decodes=d,
        decode_block_tables=padded[:d, :dec_blocks].to(DEVICE),
        decode_context_lens=dec_lens.to(DEVICE),
        decode_key_mask=(span[None, :] < dec_lens[:, None])[:, None, None, :].to(DEVICE),
        prefills=spans,
        block_size=page,
        query_start_loc=torch.tensor(qsl, dtype=torch.long, device=DEVICE),
        seq_lens=seq_lens.to(DEVICE),
        block_tables=padded.to(DEVICE),
    )
    pool = pool.to(DEVICE)
    return pool[0], pool[1], meta


def _dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def _is_decode(s: Seq) -> bool:
    return s.new == 1 and s.cached > 0


def _compare(
    seqs: list[Seq],
    heads: int,
    kv_heads: int,
    dim: int,
    page: int,
    backend: TritonPagedAttention,
    num_blocks: int = 64,
    seed: int = 0,
) -> None:
    k_cache, v_cache, meta = _build(seqs, kv_heads, dim, page, num_blocks, seed)
    tokens = sum(s.new for s in seqs)
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn((tokens, h, dim), generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    scale = dim**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta, scale)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "KV written to the wrong slots"
    err = (got - want).abs().max().item()
    assert err < TOL, f"max abs error {err:.2e}"


# Small tiles so tiny contexts still span several tiles, pages and splits.
SPLITTING = TritonPagedAttention(block_n=16, block_m=16, min_split_tokens=16, target_programs=1 << 10)
SINGLE = TritonPagedAttention(block_n=16, block_m=16, target_programs=1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [
        (4, 4, 16),
        (8, 2, 32),
        (6, 2, 24),
    ],  # plain multi-head, GQA group 4, GQA with a head_dim not a power of 2
)
@pytest.mark.parametrize("backend", [SINGLE, SPLITTING], ids=["one-split", "split-k"])
def test_decode_matches_torch(heads: int, kv_heads: int, dim: int, backend: TritonPagedAttention) -> None:
    """Contexts of 2 tokens, exactly one and two blocks, one past a block and many blocks, in one batch."""
    seqs = [Seq(1, 1), Seq(7, 1), Seq(8, 1), Seq(15, 1), Seq(57, 1), Seq(100, 1)]
    # page 8: contexts 8 and 16 end on a block boundary, 9 starts a new block; 101 spans 13 blocks.
    _compare(seqs, heads, kv_heads, dim, page=8, backend=backend)


def test_split_plan_covers_the_context() -> None:
    """Slices are whole tiles, cover every position, and a split count of 1 means one slice."""
    b = SPLITTING
    splits, split_len = b.plan_splits(num_seqs=2, kv_heads=2, max_ctx=104, device=torch.device("cpu"))
    assert splits > 1 and split_len % b.block_n == 0 and splits * split_len >= 104
    assert (splits - 1) * split_len < 104  # no slice lies wholly past the longest context
    assert SINGLE.plan_splits(2, 2, 104, torch.device("cpu"))[0] == 1


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_prefill_with_cached_prefix_matches_torch(heads: int, kv_heads: int) -> None:
    """Prompts from zero, chunks after a cached prefix (on and off block boundaries), longer than a tile."""
    seqs = [Seq(0, 5), Seq(16, 9), Seq(13, 20), Seq(0, 37)]
    _compare(seqs, heads, kv_heads, 16, page=4, backend=SINGLE, seed=3)


def test_mixed_batch_decodes_then_prefills() -> None:
    """Decodes (split-K) and prefill chunks share one step, as ModelRunner flattens them."""
    seqs = [Seq(40, 1), Seq(0, 12), Seq(3, 1), Seq(24, 17), Seq(70, 1)]
    _compare(seqs, 8, 2, 16, page=8, backend=SPLITTING, seed=5)


def test_padding_slots_are_skipped() -> None:
    """A slot of -1 writes nothing (CUDA-graph padding rows)."""
    k_cache = torch.zeros((16, 2, 16), device=DEVICE)
    v_cache = torch.zeros((16, 2, 16), device=DEVICE)
    k = torch.randn((3, 2, 16), device=DEVICE)
    v = torch.randn((3, 2, 16), device=DEVICE)
    TritonPagedAttention.write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0], device=DEVICE))
    assert torch.equal(k_cache[5], k[0]) and torch.equal(v_cache[0], v[2])
    assert int((k_cache.abs().sum((1, 2)) > 0).sum()) == 2


def test_runner_logits_match_torch_backend() -> None:
    """dummy:tiny through ModelRunner: prefill, chunked prefill over a cached prefix, then decodes."""
    loaded = load_model("dummy:tiny", torch.float32)
    page = 8
    runners = [
        ModelRunner(TransformerLM(loaded.arch, loaded.weights, 256).to(DEVICE), 32, page, DEVICE, backend=b)
        for b in (TorchPagedAttention(), SPLITTING)
    ]
    prompts = [list(range(3, 22)), list(range(40, 48)), list(range(100, 103))]
    tables = [[0, 1, 2, 3], [4, 5], [6, 7]]
    spec = SamplingSpec(temperature=0.0)

    def step(chunks: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        # One-token chunks over a cached context are the step's decodes; they go first.
        ordered = sorted(chunks, key=lambda c: not (c[2] - c[1] == 1 and c[1] > 0))
        batch = [
            SeqChunk(prompts[i][a:b], a, tables[i], b == len(prompts[i]), spec, b - a == 1 and a > 0)
            for i, a, b in ordered
        ]
        return [r.logits_for(batch) for r in runners]

    for i, p in enumerate(prompts):
        p.extend(range(200 + i, 204 + i))  # tokens fed later as decodes
    steps = [
        [(0, 0, 11), (1, 0, 8), (2, 0, 3)],  # whole prompts and a first chunk
        [(0, 11, 19), (1, 8, 9), (2, 3, 4)],  # a chunk over a cached prefix, alongside decodes
        [(0, 19, 20), (1, 9, 10), (2, 4, 5)],
        [(0, 20, 21), (1, 10, 11), (2, 5, 6)],
    ]
    for chunks in steps:
        want, got = step(chunks)
        err = (got - want).abs().max().item()
        assert err < TOL, f"max abs logit error {err:.2e}"


def test_static_graph_metadata_matches_torch_backend() -> None:
    """The CUDA-graph form (tables padded to a fixed width, batch padded by repeating a row) gives the
    same logits through the Triton kernels as the eager torch path."""
    from tailserve.executor.cuda_graphs import DecodeGraphRunner

    loaded = load_model("dummy:tiny", torch.float32)
    page = 8
    eager, wrapped = (
        ModelRunner(TransformerLM(loaded.arch, loaded.weights, 128).to(DEVICE), 16, page, DEVICE, backend=b)
        for b in (TorchPagedAttention(), SPLITTING)
    )
    graphs = DecodeGraphRunner(wrapped, batch_sizes=(4,), max_context=128)
    prompts = [list(range(3, 20)), list(range(40, 47)), list(range(90, 98))]
    tables = [[5, 1, 9], [2, 7], [12, 3]]
    spec = SamplingSpec(temperature=0.0)
    prefill = [SeqChunk(p, 0, t, True, spec) for p, t in zip(prompts, tables, strict=True)]
    assert eager.execute(prefill) == wrapped.execute(prefill)
    decodes = [
        SeqChunk([7], len(p), t, True, spec, decode=True) for p, t in zip(prompts, tables, strict=True)
    ]
    want = eager.logits_for(decodes)
    got = graphs.decode_logits(decodes)
    err = (got - want).abs().max().item()
    assert err < TOL, f"max abs logit error {err:.2e}"
