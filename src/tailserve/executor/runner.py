"""ModelRunner: owns the model, the preallocated KV pool and the attention backend; runs one step.

It turns a list of sequence chunks into a flattened batch plus attention metadata, runs the
forward pass and samples, and returns what it found as a `StepResult` (it never writes into the
chunks). The caller says which chunks are decodes (they come first); the runner never guesses. It
knows nothing of requests, queues or stopping rules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from tailserve.model import cpu_fused
from tailserve.model.attention import AttentionBackend, AttentionMetadata, PrefillSpan, TorchPagedAttention
from tailserve.model.sampler import Sampled, SamplingSpec, TokenScore, sample, token_logprobs
from tailserve.model.transformer import TransformerLM
from tailserve.weights.arch import ArchConfig

if TYPE_CHECKING:
    from tailserve.executor.parallel import TensorParallel

log = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    """New tokens of one sequence to run this step, at positions start_pos.., with its block table.

    `decode` marks a generated token fed back over a cached context (one token, start_pos > 0): it
    runs through the decode path and the decode weight format. Any other chunk, even of one token,
    is a prompt chunk. Decode chunks must come before prompt chunks in a step.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool  # the chunk ends at the sequence's last known token: sample the next one
    sampling: SamplingSpec
    decode: bool = False
    # Prompt log-probabilities: row i of the chunk is scored against prompt_targets[i] (the token
    # after it) with its `prompt_top` most likely tokens (`StepResult.prompt_scores`).
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top: int = 0


class StepResult(NamedTuple):
    """What one step found, one entry per chunk in the order given."""

    tokens: Sequence[int | None]  # the sampled token; None where the chunk samples nothing
    logprobs: Sequence[TokenScore | None]  # the sampled token's score where its spec asks for logprobs
    prompt_scores: Sequence[list[TokenScore] | None]  # a score per prompt target where the chunk has any


def no_result(num_chunks: int) -> StepResult:
    """A step that sampled and scored nothing (a tensor-parallel worker's: rank 0 samples)."""
    return StepResult([None] * num_chunks, [None] * num_chunks, [None] * num_chunks)


def step_result(
    chunks: Sequence[SeqChunk],
    sampled: Sampled,
    prompt_scores: Sequence[list[TokenScore] | None] | None = None,
) -> StepResult:
    """Spread `sample`'s rows (one per sampling chunk, in order) over all the chunks."""
    tokens: Sequence[int | None] = sampled.tokens
    logprobs = sampled.logprobs
    if len(tokens) != len(chunks):  # some chunks (prompt chunks short of their end) sample nothing
        rows = iter(range(len(tokens)))
        at = [next(rows) if c.sample else None for c in chunks]
        tokens = [None if i is None else sampled.tokens[i] for i in at]
        logprobs = [None if i is None else sampled.logprobs[i] for i in at]
    return StepResult(tokens, logprobs, prompt_scores or [None] * len(chunks))


def kv_pool_shape(arch: ArchConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[layers, K and V, slots, kv_heads, head_dim]: the one allocation the KV cache ever makes."""
    return (arch.num_layers, 2, num_blocks * block_size, arch.num_kv_heads, arch.head_dim)


def kv_bytes_per_token(arch: ArchConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return arch.kv_bytes_per_token_per_element * torch.tensor([], dtype=dtype).element_size()


class DecodeGraphs(Protocol):
    """Captured decode steps (executor.cuda_graphs.DecodeGraphRunner) the runner routes to."""

    def can_run(self, chunks: Sequence[SeqChunk]) -> bool: ...
    def execute(self, chunks: list[SeqChunk]) -> StepResult: ...


class ModelRunner:
    """Runs steps of the transformer over a paged KV cache allocated once at construction."""

    def __init__(
        self,
        model: TransformerLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        backend: AttentionBackend | None = None,
        kv_dtype: torch.dtype | None = None,
        cpu_kernels: bool = True,
        kv_pool: torch.Tensor | None = None,
        tp: TensorParallel | None = None,
        num_threads: int | None = None,
    ) -> None:
        arch = model.arch
        # torch's thread count is per process: another engine, or the caller, may change it after this
        # one was built, and oneDNN's kernels (so a prompt row's rounding) depend on it. Each step
        # sets this runner's own first (None: whatever the process has).
        self.num_threads = num_threads  # under tensor parallelism, this rank's shard of heads and KV heads
        self.tp = tp
        # Seconds of the last step's forward in collectives vs the rest (0 without tensor parallelism).
        self.last_comm_s = 0.0
        self.last_compute_s = 0.0
        self.model = model
        self.arch = arch
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend: AttentionBackend = backend or TorchPagedAttention()
        dtype = kv_dtype or model.embed.dtype  # the KV cache may be narrower than the activations
        # One allocation for the whole pool; per-layer K/V are views. Nothing is allocated per request.
        shape = kv_pool_shape(arch, num_blocks, block_size)
        if kv_pool is not None and (kv_pool.shape != shape or kv_pool.dtype != dtype):
            raise ValueError(f"kv_pool must be {dtype} {shape}, got {kv_pool.dtype} {tuple(kv_pool.shape)}")
        self.kv_pool = kv_pool if kv_pool is not None else torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(arch.num_layers)]
        # On CPU with the torch backend, bf16 models run their layers through the fused kernels
        # (model.cpu_fused) where they build; `cpu_kernels=False` keeps the op-by-op torch path.
        if cpu_kernels and self.backend.name == "torch":
            cpu_fused.attach(model, dtype)
        self.decode_graphs: DecodeGraphs | None = None
        self.use_decode_graphs = False  # the explicit switch: decode-only steps replay CUDA graphs
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    def attach_decode_graphs(self, graphs: DecodeGraphs) -> None:
        """Route decode-only steps that fit through `graphs` from now on (switch with use_decode_graphs)."""
        self.decode_graphs = graphs
        self.use_decode_graphs = True

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], threads: int | None = None) -> StepResult:
        """Run one step; return the sampled token per chunk (None where the chunk samples nothing),
        its logprobs and the prompt scores where asked. `threads`: this step's CPU thread count on
        the calling thread (None: the runner's); steps may run on two threads at once, each with its
        own count, when their chunks write different KV blocks (the engine's prefill lane)."""
        if not chunks:
            return no_result(0)
        graphs = self.decode_graphs
        if self.use_decode_graphs and graphs is not None and graphs.can_run(chunks):
            self.num_graph_steps += 1
            return graphs.execute(chunks)
        self.num_eager_steps += 1
        return self.execute_eager(chunks, threads)

    @torch.inference_mode()
    def execute_eager(self, chunks: list[SeqChunk], threads: int | None = None) -> StepResult:
        """`execute` without CUDA graphs: one eager forward over the flattened batch."""
        if not chunks:
            return no_result(0)
        start = self._start_step("step", chunks, threads)
        input_ids, positions, meta, logits_rows = self._prepare(chunks)
        scored = _scored_rows(chunks)  # after the sampled rows, only for chunks that ask
        logits_indices = torch.tensor(logits_rows + scored, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, positions, self.kv_caches, meta, self.backend, logits_indices)
        self._end_step(start)
        if self.tp is not None and not self.tp.is_driver:
            return no_result(len(chunks))  # rank 0 samples
        prompt_scores = None
        if scored:
            prompt_scores = _score_prompts(logits[len(logits_rows) :], chunks)
            logits = logits[: len(logits_rows)]
        specs = [c.sampling for c in chunks if c.sample]
        return step_result(chunks, sample(logits, specs) if specs else Sampled([], []), prompt_scores)

    @torch.inference_mode()
    def logits_for(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Teacher-forced logits of every new token of every chunk, in order; KV written as in execute."""
        start = self._start_step("logits", chunks)
        input_ids, positions, meta, _ = self._prepare(chunks)
        rows = torch.arange(input_ids.shape[0], device=self.device)
        logits: torch.Tensor = self.model(input_ids, positions, self.kv_caches, meta, self.backend, rows)
        self._end_step(start)
        return logits

    def _start_step(self, kind: str, chunks: list[SeqChunk], threads: int | None = None) -> float:
        """Under tensor parallelism rank 0 sends the plan first: the workers unpack it while rank 0
        builds its own batch tensors (the one overlap of communication with work on this path)."""
        want = threads or self.num_threads
        if want is not None and torch.get_num_threads() != want:
            torch.set_num_threads(want)  # the calling thread's count (OpenMP's is per thread)
        tp = self.tp
        if tp is not None:
            if tp.is_driver:
                tp.send_plan((kind, plan_message(chunks)))
            tp.comm_s = 0.0
        return time.perf_counter()

    def _end_step(self, start: float) -> None:
        if self.tp is not None:
            self.last_comm_s = self.tp.comm_s
            self.last_compute_s = time.perf_counter() - start - self.tp.comm_s

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.tp is not None:
            self.tp.close()

    def _prepare(
        self, chunks: list[SeqChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        _check_order(chunks)
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        num_decodes = 0
        dev = self.device
        max_blocks = max(len(c.block_table) for c in chunks)
        for c in chunks:
            n = len(c.token_ids)
            q_start = len(ids)
            ids.extend(c.token_ids)
            positions = range(c.start_pos, c.start_pos + n)
            pos.extend(positions)
            table = c.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            if c.decode:
                num_decodes += 1
            elif c.start_pos == 0:
                prefills.append(PrefillSpan(q_start, n, 0, None))
            else:
                prefix_blocks = torch.tensor(table[: -(-c.start_pos // bs)], dtype=torch.long, device=dev)
                prefills.append(PrefillSpan(q_start, n, c.start_pos, prefix_blocks))
            if c.sample:
                logits_rows.append(q_start + n - 1)
        tables = torch.tensor(
            [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks], dtype=torch.long
        )
        lens = [c.start_pos + len(c.token_ids) for c in chunks]
        seq_lens = torch.tensor(lens, dtype=torch.long)
        dec_lens = seq_lens[:num_decodes]
        dec_blocks = -(-max(lens[:num_decodes]) // bs) if num_decodes else 0
        dec_tables = tables[:num_decodes, :dec_blocks]
        key_mask = None
        if len(set(lens[:num_decodes])) > 1:  # unequal lengths: mask each row's padding
            span = torch.arange(dec_blocks * bs)
            key_mask = (span[None, :] < dec_lens[:, None])[:, None, None, :].to(dev)
        qsl = [0]
        for c in chunks:
            qsl.append(qsl[-1] + len(c.token_ids))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=num_decodes,
            decode_block_tables=dec_tables.to(dev),
            decode_context_lens=dec_lens.to(dev),
            decode_key_mask=key_mask,
            prefills=prefills,
            block_size=bs,
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            seq_lens=seq_lens.to(dev),
            block_tables=tables.to(dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions_t = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions_t, meta, logits_rows


# token_ids, start_pos, block_table, sample, decode, number of prompt rows scored (echo)
PlanChunk = tuple[list[int], int, list[int], bool, bool, int]


def plan_message(chunks: list[SeqChunk]) -> list[PlanChunk]:
    """What a tensor-parallel worker needs of a step: everything but the sampling (rank 0 samples).
    The scored rows count too: every rank gathers the same logits rows."""
    return [
        (c.token_ids, c.start_pos, c.block_table, c.sample, c.decode, len(c.prompt_targets)) for c in chunks
    ]


def chunks_from_plan(plan: list[PlanChunk]) -> list[SeqChunk]:
    """A worker's chunks, rebuilt from `plan_message` (greedy sampling specs and prompt targets that
    are never used: rank 0 scores)."""
    unused = SamplingSpec()
    return [
        SeqChunk(ids, start, table, sample, unused, decode, prompt_targets=[0] * scored)
        for ids, start, table, sample, decode, scored in plan
    ]


def _scored_rows(chunks: list[SeqChunk]) -> list[int]:
    """Batch rows whose logits score a following prompt token: the first rows of each asking chunk."""
    rows: list[int] = []
    q_start = 0
    for c in chunks:
        rows.extend(range(q_start, q_start + len(c.prompt_targets)))
        q_start += len(c.token_ids)
    return rows


def _score_prompts(logits: torch.Tensor, chunks: list[SeqChunk]) -> list[list[TokenScore] | None]:
    """Each asking chunk's prompt scores from its rows of `logits` (in `_scored_rows` order); None
    for the others."""
    scores: list[list[TokenScore] | None] = []
    start = 0
    for c in chunks:
        if not (m := len(c.prompt_targets)):
            scores.append(None)
            continue
        targets = torch.tensor(c.prompt_targets, dtype=torch.long, device=logits.device)
        chosen, top = token_logprobs(logits[start : start + m], targets, c.prompt_top)
        scores.append(list(zip(chosen, top, strict=True)))
        start += m
    return scores


def _check_order(chunks: list[SeqChunk]) -> None:
    """Decodes first, each one token over a cached context: the batch layout every backend relies on."""
    seen_prompt = False
    for c in chunks:
        if not c.decode:
            seen_prompt = True
        elif seen_prompt or len(c.token_ids) != 1 or c.start_pos == 0:
            raise ValueError(
                "decode chunks must be single tokens over a cached context, before prompt chunks"
            )
