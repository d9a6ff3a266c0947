"""Tensor parallelism: the process group, the sharding of weights at load, and the step's collectives.

Rank 0 lives in the serving process and owns scheduling; ranks 1..N-1 are worker processes
(`model.tp_worker`) started here. Each step rank 0 sends the plan down a pipe to every worker, every
rank runs the same forward over its shard (column-parallel q|k|v and gate|up, row-parallel o and
down with one all-reduce each, a vocab-parallel embedding and LM head), and rank 0 gathers the
sampled rows' logits. gloo on CPU (tested), NCCL on CUDA (written, untested: no GPU here).
Never schedules and never samples.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tailserve.errors import ConfigError, TailserveError
from tailserve.model.sharding import (
    local_arch,
    shard_int4,
    shard_int8_rows,
    shard_range,
    shard_tensor,
    vocab_range,
)
from tailserve.model.tp_split import TensorParallelSplit
from tailserve.weights.arch import ArchConfig
from tailserve.weights.formats import Int4Groups, Int8Groups

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60  # a step's collectives; between steps workers wait on the pipe, unbounded
JOIN_TIMEOUT_S = 300  # workers load their shard before they join the group
WORKER_DEATH_GRACE_S = 2.0  # time for error responses to reach clients before the server exits
EXIT_WORKER_DIED = 70  # the serving process's exit status when a worker died


class TensorParallelError(TailserveError):
    """A tensor-parallel rank is gone or a collective failed: the engine cannot run another step."""


class TensorParallel:
    """One rank's handle on the group: its split, its vocabulary rows, the collectives of a step.

    `comm_s` adds up the seconds this rank spent in collectives; the runner reads and resets it
    per step to report communication against compute.
    """

    def __init__(self, rank: int, arch: ArchConfig, split: TensorParallelSplit, device: torch.device) -> None:
        self.rank = rank
        self.size = split.size
        self.split = split
        self.arch = arch  # the whole model's shapes; `local_arch` is this rank's
        self.local_arch = local_arch(arch, split, rank)
        self.port = 0  # the group's TCP rendezvous port on the loopback
        self.device = device
        self.vocab_size = arch.vocab_size
        self.vocab_start, self.vocab_stop = vocab_range(arch.vocab_size, split.size, rank)
        self.vocab_per_rank = -(-arch.vocab_size // split.size)
        self.comm_s = 0.0
        # NCCL collectives are asynchronous: without a device sync around each, comm_s counts only
        # their launch. Off by default (a sync per collective costs decode time); benchmarks set it.
        self.sync_timing = False
        self.workers: list[BaseProcess] = []  # rank 0 only
        self.plan_pipes: list[Connection] = []  # rank 0 only: one per worker
        self.loaded: list[Any] = []  # rank 0 only: each worker's "shard loaded" multiprocessing Event
        self.dead: str | None = None  # why the group cannot run another step
        self.closing = False
        self._on_death: list[Callable[[str], None]] = []
        self._notified = False
        self.group: Any = None  # the steps' process group (its own, shorter timeout)

    def join(self, port: int) -> None:
        """Meet the other ranks over TCP on the loopback (one node). The rendezvous waits up to
        JOIN_TIMEOUT_S for the slowest rank to load; the steps' collectives then run on a group of
        their own that gives up after COLLECTIVE_TIMEOUT_S, so a hung rank cannot hang the server."""
        backend = backend_for(self.device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        )
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, sends plans, samples."""
        return self.rank == 0

    # ----- this rank's shard of each weight (applied as the weights load) -----------------------
    def keep(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a Hugging Face-named dense tensor (all of it if replicated)."""
        return shard_tensor(t, shard_range(name, self.arch, self.split, self.rank))

    def keep_int4(self, name: str, groups: Int4Groups) -> Int4Groups:
        """This rank's int4 groups of a weight, cut on group boundaries."""
        return shard_int4(groups, shard_range(name, self.arch, self.split, self.rank))

    def keep_int8_rows(self, name: str, groups: Int8Groups) -> Int8Groups:
        """This rank's vocabulary rows of the LM head's Q8_0 groups."""
        return shard_int8_rows(groups, shard_range(name, self.arch, self.split, self.rank))

    # ----- collectives of a step --------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The float32 sum over ranks of `t` (row-parallel partial sums)."""
        x = t.contiguous() if t.dtype == torch.float32 else t.float()
        self._collective(lambda: dist.all_reduce(x, group=self.group))
        return x

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up the ids it holds, zeros elsewhere, summed."""
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < table.shape[0])
        rows = F.embedding(local.clamp(0, table.shape[0] - 1), table).float()
        rows.mul_(inside.unsqueeze(1))
        return self.all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's vocabulary columns of the sampled rows, concatenated on rank 0 (others: their own)."""
        x = logits.float()
        pad = self.vocab_per_rank - x.shape[1]
        if pad:
            x = F.pad(x, (0, pad), value=float("-inf"))
        x = x.contiguous()
        if not self.is_driver:
            self._collective(lambda: dist.gather(x, None, dst=0, group=self.group))
            return logits
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._collective(lambda: dist.gather(x, parts, dst=0, group=self.group))
        return torch.cat(parts, dim=1)[:, : self.vocab_size]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (the KV pool's block count must agree)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        self._collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group))
        return int(t.item())

    def _collective(self, op: Callable[[], object]) -> None:
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        if self.sync_timing:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            op()
            if self.sync_timing:
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # gloo / NCCL report a lost peer as RuntimeError or DistBackendError
            raise TensorParallelError(self._fail(f"tensor-parallel collective failed: {exc}")) from exc
        finally:
            self.comm_s += time.perf_counter() - start

    # ----- the plan (rank 0 -> workers) -------------------------------------------------------
    def send_plan(self, message: tuple[Any, ...]) -> None:
        """Hand every worker this step's plan; returns once written, so rank 0 prepares meanwhile."""
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        try:
            for pipe in self.plan_pipes:
                pipe.send(message)
        except OSError as exc:
            raise TensorParallelError(self._fail(f"a tensor-parallel worker is gone: {exc}")) from exc

    # ----- lifecycle (rank 0) -----------------------------------------------------------------
    def on_worker_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, on a thread of its own, when the group dies (a worker exits,
        a collective fails or times out, a plan cannot be written)."""
        self._on_death.append(callback)

    def exit_process_on_worker_death(self) -> None:
        """The serving process's policy: fail what is in flight, then exit non-zero for a restart."""

        def exit_soon(reason: str) -> None:
            time.sleep(WORKER_DEATH_GRACE_S)
            log.critical(
                "%s; exiting with status %d so the orchestrator restarts the server", reason, EXIT_WORKER_DIED
            )
            logging.shutdown()
            os._exit(EXIT_WORKER_DIED)

        self.on_worker_death(exit_soon)

    def _watch(self) -> None:
        """Watchdog: a worker that exits while the group is up makes the group dead."""
        sentinels = {p.sentinel: p for p in self.workers}
        wait(list(sentinels))
        if self.closing:
            return
        gone = [p for p in self.workers if not p.is_alive()]
        reason = "tensor-parallel worker died ({})".format(
            ", ".join(f"{p.name} exited with status {p.exitcode}" for p in gone)
        )
        log.error("%s: failing in-flight requests", reason)
        self._fail(reason)

    def _fail(self, reason: str) -> str:
        """The group is dead (a worker exited, hung past the timeout, or its pipe broke): remember the
        first reason, run the death callbacks once on a thread of their own, return the reason."""
        if self.dead is None:
            self.dead = reason
        if not self._notified and not self.closing:
            self._notified = True
            callbacks = list(self._on_death)
            threading.Thread(target=lambda: [cb(reason) for cb in callbacks], daemon=True).start()
        return self.dead

    def close(self) -> None:
        """Stop the workers (they finish the message in hand) and leave the group. Idempotent."""
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self.close)  # registered by start_workers; nothing left for exit to stop
        for pipe in self.plan_pipes:
            try:
                pipe.send(("stop",))
                pipe.close()
            except OSError:
                pass
        for p in self.workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


def start_workers(
    arch: ArchConfig,
    split: TensorParallelSplit,
    device: torch.device,
    worker_main: Callable[..., None],
    worker_args: tuple[Any, ...],
) -> TensorParallel:
    """Rank 0: start N-1 worker processes (spawned); they load their shards while rank 0 loads its
    own, then everyone meets in `join_workers`."""
    if dist.is_initialized():
        raise ConfigError("a tensor-parallel engine is already running in this process; close it first")
    ctx = mp.get_context("spawn")
    port = _free_port()
    tp = TensorParallel(0, arch, split, device)
    tp.port = port
    # Before multiprocessing's own exit hook joins the (non-daemon) workers, which would wait forever
    # on a plan pipe this process still holds open: a script that never calls close() still exits.
    atexit.register(tp.close)
    for rank in range(1, split.size):
        child, parent = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        loaded = ctx.Event()  # set by the worker once its shard is loaded, before it joins the group
        proc = ctx.Process(
            target=worker_main,
            args=(rank, split.size, port, child, loaded, *worker_args),
            name=f"tp-worker-{rank}",
            daemon=False,  # stopped by TensorParallel.close, never by multiprocessing's atexit
        )
        proc.start()
        child.close()
        tp.workers.append(proc)
        tp.plan_pipes.append(parent)
        tp.loaded.append(loaded)
        log.info("started tensor-parallel worker rank %d (pid %d)", rank, proc.pid)
    return tp


def join_workers(tp: TensorParallel) -> None:
    """Rank 0: wait until every worker has loaded its shard, watching them meanwhile, then form the
    group and watch them for the rest of its life. A worker that dies while loading (out of memory, a
    bad file, a missing device) ends the start-up at once, naming it, instead of leaving rank 0 in
    the rendezvous for JOIN_TIMEOUT_S waiting for a rank that will never come."""
    sentinels = [p.sentinel for p in tp.workers]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not all(event.is_set() for event in tp.loaded):
        gone = [p for p in tp.workers if p.exitcode is not None]
        if gone:
            raise TensorParallelError(
                "tensor-parallel worker died while starting ({})".format(
                    ", ".join(f"{p.name} exited with status {p.exitcode}" for p in gone)
                )
            )
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel workers did not load within {JOIN_TIMEOUT_S:.0f} s")
        wait(sentinels, timeout=0.1)
    tp.join(tp.port)
    threading.Thread(target=tp._watch, name="tp-watchdog", daemon=True).start()
