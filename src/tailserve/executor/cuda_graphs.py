"""CUDA graphs for decode-only steps: one graph per batch size of a ladder, captured once at start.

A graph replays the whole forward pass over static input buffers padded to its batch size; a step
with prefills or more decodes than the largest graph runs eagerly. Replays never allocate, and the
KV pool is never written outside the slots the real sequences own (padding repeats a real row).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tailserve.executor.runner import ModelRunner, SeqChunk, StepResult, step_result
from tailserve.model.attention import AttentionMetadata
from tailserve.model.sampler import sample

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphRunner:
    """Wraps a ModelRunner's decode-only forward with static buffers and (on CUDA) captured graphs.

    Without graphs (CPU, or `use_graphs=False`) it runs the same padded static-shape forward eagerly,
    which is how the padding and metadata are tested without a GPU. The runner routes decode-only
    steps here once attached (`ModelRunner.attach_decode_graphs`); what `execute` cannot replay goes
    to the runner's eager path.
    """

    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        max_context: int | None = None,
        use_graphs: bool | None = None,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError("batch_sizes must be positive")
        self.runner = runner
        self.use_graphs = runner.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch = self.batch_sizes[-1]
        page = runner.block_size
        positions = int(runner.model.cos_table.shape[0])
        self.max_context = min(max_context or positions, positions)
        # Fixed table width: the decode kernels' split plan depends on shapes only, so it stays valid.
        self.max_blocks = -(-self.max_context // page)
        n, dev, long = self.max_batch, runner.device, torch.long
        self.input_ids = torch.zeros(n, dtype=long, device=dev)
        self.positions = torch.zeros(n, dtype=long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=long, device=dev)
        self.context_lens = torch.ones(n, dtype=long, device=dev)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=long, device=dev)
        self.logits_indices = torch.arange(n, dtype=long, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=long, device=dev)
        width = self.max_blocks * page
        self.key_positions = torch.arange(width, dtype=long, device=dev)
        # What the portable backend reads; the Triton one walks the block tables instead.
        self.key_mask = torch.zeros((n, 1, 1, width), dtype=torch.bool, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0

    # ----- capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per batch size (largest first, one shared memory pool); returns seconds.

        The warm-up runs write K/V into slot 0; its contents are saved and restored, so capturing
        is safe even with a live prefix cache. Without graphs this does nothing.
        """
        if not self.use_graphs or self.graphs:
            return self.capture_s
        start = time.perf_counter()
        pool_kv = self.runner.kv_pool
        saved_slot0 = pool_kv[:, :, 0].clone()
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.zero_()
        self.block_tables.zero_()
        self.context_lens.fill_(1)
        mem_pool = None
        for b in reversed(self.batch_sizes):
            # Warm up on a side stream (compiles Triton kernels, sets up cuBLAS), then capture.
            side = torch.cuda.Stream(device=self.runner.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mem_pool):
                self.graph_logits[b] = self._forward(b)
            mem_pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.runner.device)
        pool_kv[:, :, 0].copy_(saved_slot0)
        self.capture_s = time.perf_counter() - start
        log.info(
            "captured %d decode CUDA graphs (batch %d..%d, context <= %d) in %.2f s",
            len(self.graphs),
            self.batch_sizes[0],
            self.max_batch,
            self.max_context,
            self.capture_s,
        )
        return self.capture_s

    # ----- steps -----------------------------------------------------------------------------
    def can_run(self, chunks: Sequence[SeqChunk]) -> bool:
        """A decode-only batch that fits the largest graph and the fixed table width."""
        return (
            0 < len(chunks) <= self.max_batch
            and all(c.decode for c in chunks)
            and all(len(c.block_table) <= self.max_blocks and c.start_pos < self.max_context for c in chunks)
        )

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> StepResult:
        """Like ModelRunner.execute: replay a graph for a decode-only batch, else run eagerly."""
        if not self.can_run(chunks):
            return self.runner.execute_eager(chunks)
        logits = self.decode_logits(chunks)
        rows = [i for i, c in enumerate(chunks) if c.sample]
        if len(rows) < len(chunks):
            logits = logits[rows]
        return step_result(chunks, sample(logits, [chunks[i].sampling for i in rows]))

    @torch.inference_mode()
    def decode_logits(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Next-token logits [len(chunks), vocab] of a decode-only batch (a view of a static buffer:
        valid until the next call). Writes each chunk's K/V like ModelRunner."""
        if not self.can_run(chunks):
            raise ValueError("decode_logits takes a decode-only batch within the captured sizes")
        n = len(chunks)
        b = self.padded_size(n)
        self._fill(chunks, b)
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self.graph_logits[b][:n]

    def padded_size(self, n: int) -> int:
        """The smallest batch size of the ladder that holds n decodes."""
        return next(b for b in self.batch_sizes if b >= n)

    def _fill(self, chunks: Sequence[SeqChunk], b: int) -> None:
        """Copy the batch into the static buffers; rows n..b-1 repeat the last real row (same slot,
        same values), so padding writes nothing a real sequence does not write itself."""
        page = self.runner.block_size
        width = max(len(c.block_table) for c in chunks)
        ids, pos, slots, lens, tables = [], [], [], [], []
        for c in chunks:
            p = c.start_pos
            ids.append(c.token_ids[0])
            pos.append(p)
            slots.append(c.block_table[p // page] * page + p % page)
            lens.append(p + 1)
            tables.append(c.block_table + [0] * (width - len(c.block_table)))
        pad = b - len(chunks)
        host = torch.tensor([ids, pos, slots, lens], dtype=torch.long)
        if pad:
            host = torch.cat([host, host[:, -1:].expand(4, pad)], dim=1)
        table = torch.tensor(tables, dtype=torch.long)
        if pad:
            table = torch.cat([table, table[-1:].expand(pad, width)])
        dev = self.runner.device
        host, table = host.to(dev, non_blocking=True), table.to(dev, non_blocking=True)
        self.input_ids[:b].copy_(host[0])
        self.positions[:b].copy_(host[1])
        self.slot_mapping[:b].copy_(host[2])
        self.context_lens[:b].copy_(host[3])
        # Columns past `width` keep stale block ids: never read (beyond every context length).
        self.block_tables[:b, :width].copy_(table)

    def _forward(self, b: int) -> torch.Tensor:
        """The captured work: the key mask (for the portable backend), then the model over b rows."""
        page = self.runner.block_size
        torch.lt(self.key_positions[None, :], self.context_lens[:b, None], out=self.key_mask[:b, 0, 0])
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            num_decodes=b,
            decode_block_tables=self.block_tables[:b],
            decode_context_lens=self.context_lens[:b],
            decode_key_mask=self.key_mask[:b],
            prefills=[],
            block_size=page,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b],
        )
        runner = self.runner
        logits: torch.Tensor = runner.model(
            self.input_ids[:b],
            self.positions[:b],
            runner.kv_caches,
            meta,
            runner.backend,
            self.logits_indices[:b],
        )
        return logits
