"""The suite's sizes, its result document and its clock: every section runs into its own dict,
the document is rewritten after each, and a global time budget skips what no longer fits.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_suite {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class Plan:
    """Every size the suite uses; `QUICK` shrinks them all for a CPU smoke run."""

    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    decode_context: int = 1024  # tokens of context per sequence in the decode timings
    decode_iters: int = 20
    bandwidth_bytes: int = 4 * GIB
    kv_bytes: int = 34 * GIB  # in-process pool: 256 x 1024 tokens x 128 KiB fits
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    offline_requests: int = 256
    offline_input: tuple[int, int] = (128, 1024)
    offline_output: int = 128
    server_kv: str = "40GiB"
    server_max_model_len: int = 4096
    server_batched_tokens: int = 2048
    online_rates: tuple[float, ...] = (1.0, 3.0, 6.0)
    online_preset: str = "chat"
    # Chat inputs (512-2048); outputs cut from the preset's 256-1024 so three rates fit the budget.
    online_lengths: tuple[str, ...] = ("--output-len", "uniform:128,384")
    online_duration_s: float = 30.0
    online_warmup_s: float = 5.0
    online_tail_s: float = 25.0  # after the last send: the longest output still decoding
    server_start_timeout_s: float = 240.0
    hf_timeout_s: float = 240.0
    reserve_online_s: float = 160.0
    hf_memory_fraction: float = 0.5


QUICK = Plan(
    decode_batches=(1, 2, 4),
    decode_context=40,
    decode_iters=3,
    bandwidth_bytes=64 << 20,
    kv_bytes=64 << 20,
    max_model_len=256,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    offline_requests=12,
    offline_input=(16, 64),
    offline_output=8,
    server_kv="64MiB",
    server_max_model_len=512,
    server_batched_tokens=256,
    online_rates=(1.0, 2.0, 4.0),
    online_preset="chat",
    online_lengths=("--input-len", "uniform:32,64", "--output-len", "uniform:8,16"),
    online_duration_s=4.0,
    online_warmup_s=1.0,
    online_tail_s=10.0,
    server_start_timeout_s=120.0,
    hf_timeout_s=240.0,
    reserve_online_s=60.0,
)


@dataclass
class Suite:
    """Holds the result document, writes it after every section, and owns the time budget."""

    out: Path
    budget_s: float
    doc: dict[str, Any] = field(default_factory=dict)

    def remaining_s(self) -> float:
        return self.budget_s - (time.perf_counter() - T0)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - T0, 2)
        tmp = self.out.with_suffix(self.out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=json_default) + "\n")
        tmp.replace(self.out)

    def run(self, name: str, fn: Callable[[dict[str, Any]], None], min_s: float) -> bool:
        """Run one section into its own dict; record skip/error/time; never raise (but Ctrl-C)."""
        rec: dict[str, Any] = {"status": "running", "started_at_s": round(time.perf_counter() - T0, 2)}
        self.doc["sections"][name] = rec
        if self.remaining_s() < min_s:
            rec["status"] = "skipped"
            rec["reason"] = f"{self.remaining_s():.0f} s of the budget left, section needs >= {min_s:.0f} s"
            log(f"{name}: skipped ({rec['reason']})")
            self.save()
            return False
        log(f"{name}: start ({self.remaining_s():.0f} s of budget left)")
        start = time.perf_counter()
        try:
            fn(rec)
            rec["status"] = "ok"
        except BaseException as exc:  # noqa: BLE001 - a section must never stop the suite
            rec["status"] = "error"
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()[-4000:]
            log(f"{name}: ERROR {rec['error']}")
            if isinstance(exc, KeyboardInterrupt):
                raise
        rec["seconds"] = round(time.perf_counter() - start, 2)
        log(f"{name}: {rec['status']} in {rec['seconds']:.1f} s")
        self.save()
        return bool(rec["status"] == "ok")


def json_default(o: object) -> object:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_stats(times_s: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times_s)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "min_ms": round(ms[0], 4),
        "max_ms": round(ms[-1], 4),
        "iters": len(ms),
    }


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            env[mod] = f"unavailable: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        env |= {
            "gpu": props.name,
            "gpu_sms": props.multi_processor_count,
            "gpu_memory_gib": round(total / GIB, 1),
            "gpu_free_gib_at_start": round(free / GIB, 1),
            "gpu_capability": f"{props.major}.{props.minor}",
        }
    return env
