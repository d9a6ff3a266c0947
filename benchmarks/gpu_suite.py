"""GPU suite: copy bandwidth and the decode floor, decode step times against that floor, offline
throughput against transformers' continuous batching, and online P99s via `tailserve serve` + `bench`.

Sized to finish in 8 minutes on one H200 (a global time budget trims or skips what no longer fits).
Every section records its numbers or its error in one JSON (rewritten after each section); none
stops the others. Random weights with the model's real shapes: speed only, never quality.

    python benchmarks/gpu_suite.py --out gpu.json                        # dummy:llama-3.1-8b, bf16, CUDA
    python benchmarks/gpu_suite.py --device cpu --model dummy:tiny --quick --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("bandwidth", "decode", "offline", "transformers", "online")
GIB = 1 << 30
_RUN_OVERHEAD_S = 5.0  # bench start-up and result writing, per online run
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_suite {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ----- settings ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Every size the suite uses; `quick` shrinks them all for a CPU smoke run."""

    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    decode_context: int = 1024  # tokens of context per sequence in the decode timings
    decode_iters: int = 20
    graph_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
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
    graph_batches=(1, 2, 4),
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


# ----- the result document and the clock ------------------------------------------------------
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
        tmp.write_text(json.dumps(self.doc, indent=2, default=_json_default) + "\n")
        tmp.replace(self.out)

    def run(self, name: str, fn: Callable[[dict[str, Any]], None], min_s: float) -> bool:
        """Run one section into its own dict; record skip/error/time; never raise."""
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
        return rec["status"] == "ok"


def _json_default(o: object) -> object:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return str(o)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms_stats(times_s: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times_s)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "min_ms": round(ms[0], 4),
        "max_ms": round(ms[-1], 4),
        "iters": len(ms),
    }


def _time_calls(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


# ----- environment ----------------------------------------------------------------------------
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


# ----- section 1: bandwidth ---------------------------------------------------------------------
def section_bandwidth(rec: dict[str, Any], device: torch.device, plan: Plan) -> float:
    """Device-to-device copy of a large buffer: (bytes read + bytes written) / time."""
    n = plan.bandwidth_bytes // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = _time_calls(partial(dst.copy_, src), 10, device)
    best = min(times)
    bw = 2 * plan.bandwidth_bytes / best
    rec |= {
        "buffer_bytes": plan.bandwidth_bytes,
        "copy_times": _ms_stats(times),
        "copy_bandwidth_gb_s": round(bw / 1e9, 1),
        "note": "read+write bytes over the fastest of 10 copies; the decode floor divides bytes read by this",
    }
    return bw


# ----- building tailserve in-process --------------------------------------------------------
def make_loaded(spec: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The model's weights; dummy weights are drawn on the device directly (the CPU draw of 8B takes
    over a minute). Same shapes, names, scale and byte tokenizer as the dummy loader."""
    from tailserve.model.arch import ArchConfig, preset
    from tailserve.model.loader import LoadedModel, hf_weight_shapes, load_model
    from tailserve.model.tokenizer import ByteTokenizer, Tokenizer

    if not spec.startswith("dummy:"):
        return load_model(spec, dtype)
    start = time.perf_counter()
    name = spec.removeprefix("dummy:")
    arch = preset(name)
    gen = torch.Generator(device=device).manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    for wname, shape in hf_weight_shapes(arch).items():
        if wname.endswith("norm.weight"):
            weights[wname] = torch.ones(shape, dtype=dtype, device=device)
        else:
            std = 0.02 if wname.endswith("embed_tokens.weight") else (1.0 / shape[-1]) ** 0.5
            w = torch.empty(shape, dtype=dtype, device=device)
            w.normal_(0.0, std, generator=gen)
            weights[wname] = w
    eos = 2
    arch = ArchConfig(**{**arch.__dict__, "eos_token_ids": (eos,), "bos_token_id": 1})
    tok = Tokenizer(ByteTokenizer(arch.vocab_size), [eos], name)
    return LoadedModel(f"dummy-{name}", arch, weights, tok, time.perf_counter() - start)


def build_llm(args: argparse.Namespace, plan: Plan, device: torch.device) -> Any:
    from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tailserve.engine import LLM

    config = EngineConfig(
        model=ModelConfig(
            model=args.model, dtype=args.dtype, device=device.type, max_model_len=plan.max_model_len
        ),
        cache=CacheConfig(kv_cache_memory_bytes=plan.kv_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=plan.max_num_batched_tokens, max_num_seqs=plan.max_num_seqs
        ),
    )
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Passed straight through so no reference outlives the engine's fused copy.
    return LLM(config=config, loaded=make_loaded(args.model, dtype, device))


@dataclass
class InProcess:
    """The in-process engine and its decode graphs (None without CUDA or when capture failed)."""

    llm: Any
    graphs: Any
    eager_execute: Callable[[list[Any]], list[int | None]]
    info: dict[str, Any]

    def use_graphs(self, on: bool) -> None:
        runner = self.llm.engine.runner
        step = self.graphs.execute if on and self.graphs is not None else self.eager_execute
        # Shadow the bound method on this one instance (what an engine wiring of the graphs would do).
        setattr(runner, "execute", step)  # noqa: B010 - mypy refuses a plain assignment to a method


def build_in_process(args: argparse.Namespace, plan: Plan, device: torch.device) -> InProcess:
    """tailserve's LLM, checked with one tiny generation, plus decode graphs.

    On CPU (--quick) the graph runner runs its static padded path eagerly, so the smoke run covers
    the same code. If the Triton backend cannot run (e.g. no C compiler for its launcher), the
    portable backend takes over and the failure is recorded."""
    from tailserve.engine import SamplingParams
    from tailserve.model.attention import TorchPagedAttention
    from tailserve.model.cuda_graphs import DecodeGraphRunner

    start = time.perf_counter()
    llm = build_llm(args, plan, device)
    runner = llm.engine.runner
    gc.collect()
    info: dict[str, Any] = {
        "build_s": round(time.perf_counter() - start, 2),
        "attention_backend": runner.backend.name,
        "dtype": str(runner.model.embed.dtype),
        "kv_blocks": runner.num_blocks,
        "block_size": runner.block_size,
        "kv_bytes_per_token": llm.engine.kv_bytes_per_token,
    }
    smoke = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    try:
        llm.generate([[5, 6, 7, 8, 9]], smoke)
    except Exception as exc:
        if runner.backend.name != "triton":
            raise
        info["triton_error"] = f"{type(exc).__name__}: {exc}"
        info["triton_traceback"] = traceback.format_exc()[-3000:]
        log(f"Triton backend failed ({info['triton_error']}); continuing with the portable backend")
        runner.backend = TorchPagedAttention()
        info["attention_backend"] = runner.backend.name
        llm.generate([[5, 6, 7, 8, 9]], smoke)
    eager = runner.execute
    graphs = None
    try:
        graphs = DecodeGraphRunner(runner, batch_sizes=plan.graph_batches)
        info["graph_capture_s"] = round(graphs.capture(), 2)
        info["graph_batch_sizes"] = list(graphs.batch_sizes)
        info["graphs_captured"] = graphs.use_graphs
    except Exception as exc:  # noqa: BLE001 - eager still measures
        info["graph_error"] = f"{type(exc).__name__}: {exc}"
        info["graph_traceback"] = traceback.format_exc()[-3000:]
        graphs = None
        log(f"CUDA graph capture failed, eager only: {info['graph_error']}")
    if device.type == "cuda":
        info["gpu_allocated_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
    ip = InProcess(llm, graphs, eager, info)
    ip.use_graphs(True)
    return ip


def weight_bytes_read_per_step(model: Any) -> int:
    """Every weight is read once per decode step, except the embedding table (a few rows are)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed
    if model.lm_head is not embed:
        total -= embed.numel() * embed.element_size()
    return int(total)


# ----- section 2: decode step time vs the floor ------------------------------------------------
def section_decode(
    rec: dict[str, Any], ip: InProcess, bw: float | None, plan: Plan, device: torch.device
) -> None:
    from tailserve.model.runner import SeqChunk
    from tailserve.model.sampler import SamplingSpec

    runner = ip.llm.engine.runner
    rec["engine"] = ip.info
    weight_bytes = weight_bytes_read_per_step(runner.model)
    kv_per_token = ip.llm.engine.kv_bytes_per_token
    page = runner.block_size
    ctx = plan.decode_context
    blocks_per_seq = -(-ctx // page)
    rec |= {
        "context_tokens": ctx,
        "weight_bytes_read_per_step": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "bandwidth_gb_s": round(bw / 1e9, 1) if bw else None,
        "floor_formula": "(weight bytes + batch x context x KV bytes/token) / copy bandwidth",
        "batches": [],
    }
    for batch in plan.decode_batches:
        row: dict[str, Any] = {"batch": batch}
        rec["batches"].append(row)
        if batch * blocks_per_seq > runner.num_blocks:
            row["skipped"] = f"needs {batch * blocks_per_seq} KV blocks, the pool has {runner.num_blocks}"
            continue
        # Distinct blocks per sequence, so every sequence's KV is really read from memory.
        chunks = [
            SeqChunk(
                [7], ctx - 1, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True, SamplingSpec()
            )
            for i in range(batch)
        ]
        kv_read = batch * ctx * kv_per_token
        row["kv_bytes_read"] = kv_read
        if bw:
            row["floor_ms"] = round((weight_bytes + kv_read) / bw * 1e3, 4)
        try:
            row["eager_step"] = _ms_stats(
                _time_calls(partial(ip.eager_execute, chunks), plan.decode_iters, device)
            )
        except Exception as exc:  # noqa: BLE001
            row["eager_error"] = f"{type(exc).__name__}: {exc}"
        if ip.graphs is not None and ip.graphs.can_run(chunks):
            try:
                g = ip.graphs
                row["graph_step"] = _ms_stats(
                    _time_calls(partial(g.execute, chunks), plan.decode_iters, device)
                )
                row["graph_forward"] = _ms_stats(
                    _time_calls(partial(g.decode_logits, chunks), plan.decode_iters, device)
                )
                row["graph_padded_batch"] = g.padded_size(batch)
            except Exception as exc:  # noqa: BLE001
                row["graph_error"] = f"{type(exc).__name__}: {exc}"
        floor = row.get("floor_ms")
        for key in ("eager_step", "graph_step", "graph_forward"):
            if floor and key in row:
                row[f"{key}_over_floor"] = round(row[key]["median_ms"] / floor, 3)
        log(
            f"decode batch {batch}: floor {row.get('floor_ms')} ms, eager {row.get('eager_step', {}).get('median_ms')} ms, "
            f"graph {row.get('graph_step', {}).get('median_ms')} ms (forward {row.get('graph_forward', {}).get('median_ms')} ms)"
        )


# ----- section 3: offline throughput ------------------------------------------------------------
def offline_prompts(plan: Plan, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    lo, hi = plan.offline_input
    top = min(vocab, 256)  # byte-level ids: every dummy tokenizer can decode them
    return [[rng.randrange(3, top) for _ in range(rng.randint(lo, hi))] for _ in range(plan.offline_requests)]


def section_offline(rec: dict[str, Any], ip: InProcess, plan: Plan, suite: Suite, reserve_s: float) -> None:
    from tailserve.engine import SamplingParams

    llm = ip.llm
    prompts = offline_prompts(plan, llm.engine.arch.vocab_size)
    params = SamplingParams(max_tokens=plan.offline_output, ignore_eos=True, temperature=0.0)
    rec |= {
        "requests": len(prompts),
        "input_tokens": sum(map(len, prompts)),
        "input_len_range": list(plan.offline_input),
        "output_tokens_per_request": plan.offline_output,
        "scheduler": {
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
        },
        "runs": {},
    }
    # Warm-up (Triton compiles prefill shapes, cuBLAS picks kernels); not timed.
    ip.use_graphs(True)
    llm.generate(
        [p[:32] for p in prompts[:8]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    )
    modes = [("eager", False)]
    if ip.graphs is not None:  # graphs first: the eager comparison is the optional one
        modes.insert(0, ("cuda_graphs" if ip.graphs.use_graphs else "static_padded_no_graphs", True))
    for name, graphs_on in modes:
        if rec["runs"] and suite.remaining_s() < reserve_s + 60:  # the eager comparison is optional
            rec["runs"][name] = {"skipped": f"{suite.remaining_s():.0f} s of budget left"}
            continue
        ip.use_graphs(graphs_on)
        _sync(llm.engine.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(llm.engine.device)
        wall = time.perf_counter() - start
        out_tokens = sum(len(o.token_ids) for o in outs)
        rec["runs"][name] = {
            "total_s": round(wall, 3),
            "output_tokens": out_tokens,
            "output_tokens_per_s": round(out_tokens / wall, 1),
            "total_tokens_per_s": round((out_tokens + rec["input_tokens"]) / wall, 1),
            "requests_per_s": round(len(prompts) / wall, 3),
            "all_full_length": all(len(o.token_ids) == plan.offline_output for o in outs),
        }
        log(f"offline tailserve ({name}): {wall:.2f} s, {out_tokens / wall:.0f} output tok/s")
    ip.use_graphs(True)


def section_transformers(
    rec: dict[str, Any], args: argparse.Namespace, plan: Plan, suite: Suite, tmp: Path
) -> None:
    """transformers' continuous batching in a child process (killed at its timeout, memory freed)."""
    spec = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": plan.max_model_len,
        "requests": plan.offline_requests,
        "input": list(plan.offline_input),
        "output": plan.offline_output,
        "memory_fraction": plan.hf_memory_fraction,
        "max_batch_tokens": plan.max_num_batched_tokens,
        "attn": args.hf_attn,
    }
    spec_path, out_path = tmp / "hf_spec.json", tmp / "hf_out.json"
    spec_path.write_text(json.dumps(spec))
    timeout = max(30.0, min(plan.hf_timeout_s, suite.remaining_s() - plan.reserve_online_s))
    rec["timeout_s"] = round(timeout, 1)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--hf-worker",
        str(spec_path),
        "--out",
        str(out_path),
    ]
    log(f"transformers worker (timeout {timeout:.0f} s)")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc, grace_s=10)
        output = proc.communicate()[0] or ""
        rec["timed_out"] = True
    rec["returncode"] = proc.returncode
    rec["log_tail"] = (output or "")[-3000:]
    if out_path.exists():
        rec |= json.loads(out_path.read_text())
    if rec.get("timed_out") or proc.returncode != 0 or "error" in rec:
        raise RuntimeError(
            rec.get("error") or f"worker exited {proc.returncode} (timed out: {rec.get('timed_out', False)})"
        )


def hf_worker(spec_path: Path, out_path: Path) -> int:
    """Child process: build the same architecture in transformers, run generate_batch, write JSON."""
    spec = json.loads(spec_path.read_text())
    res: dict[str, Any] = {}

    def save() -> None:
        out_path.write_text(json.dumps(res, indent=2, default=_json_default))

    try:
        import inspect

        import transformers
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        from tailserve.model.arch import preset

        res["transformers"] = transformers.__version__
        device = torch.device(
            "cuda" if spec["device"] in ("cuda", "auto") and torch.cuda.is_available() else "cpu"
        )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if spec["dtype"] not in ("auto", None):
            dtype = getattr(torch, spec["dtype"])
        arch = preset(spec["model"].removeprefix("dummy:"))
        # Rope scaling is left at its default: it changes no shape and no cost.
        cfg = LlamaConfig(
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_hidden_layers=arch.num_layers,
            num_attention_heads=arch.num_heads,
            num_key_value_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            max_position_embeddings=max(spec["max_model_len"], 2048),
            rms_norm_eps=arch.rms_norm_eps,
            tie_word_embeddings=arch.tie_word_embeddings,
            attention_bias=arch.qkv_bias,
        )
        start = time.perf_counter()
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model: Any = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(previous)
        model = model.to(device=device, dtype=dtype).eval()
        attn = spec["attn"]
        attn_used = attn
        try:
            model.set_attn_implementation(attn)
        except Exception as exc:  # noqa: BLE001 - newer releases dropped the "paged|" prefix
            attn_used = attn.removeprefix("paged|")
            res["attn_note"] = f"{attn!r} refused ({exc}); used {attn_used!r}"
            model.set_attn_implementation(attn_used)
        res |= {"model_build_s": round(time.perf_counter() - start, 2), "attn_implementation": attn_used}
        res["dtype"] = str(dtype)

        rng = random.Random(0)
        lo, hi = spec["input"]
        top = min(arch.vocab_size, 256)
        prompts = [
            [rng.randrange(3, top) for _ in range(rng.randint(lo, hi))] for _ in range(spec["requests"])
        ]
        gen_cfg = GenerationConfig(
            max_new_tokens=spec["output"], do_sample=False, eos_token_id=None, pad_token_id=0
        )
        kwargs: dict[str, Any] = {"generation_config": gen_cfg, "record_timestamps": True}
        sig = inspect.signature(model.generate_batch).parameters
        cb_cls = getattr(transformers, "ContinuousBatchingConfig", None)
        if cb_cls is None:
            with contextlib.suppress(ImportError):
                from transformers.generation.configuration_utils import ContinuousBatchingConfig as cb_cls
        if cb_cls is not None and "continuous_batching_config" in sig:
            names = (
                {f.name for f in dataclasses.fields(cb_cls)} if dataclasses.is_dataclass(cb_cls) else set()
            )
            wanted = {
                "use_cuda_graph": device.type == "cuda",
                "max_memory_percent": spec["memory_fraction"],
                "max_batch_tokens": spec["max_batch_tokens"],  # the same per-step budget as tailserve's
                "allow_block_sharing": False,
            }
            cb_kwargs = {k: v for k, v in wanted.items() if k in names}
            kwargs["continuous_batching_config"] = cb_cls(**cb_kwargs)
            res["continuous_batching_config"] = cb_kwargs
        else:  # older releases read these from the generation config
            setattr(gen_cfg, "use_cuda_graph", device.type == "cuda")  # noqa: B010 - not a declared field
            res["continuous_batching_config"] = "generation_config.use_cuda_graph"
        if "warmup" in sig:
            kwargs["warmup"] = True
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        results = list(outputs.values())
        out_tokens = sum(len(r.generated_tokens) for r in results)
        created = [r.created_time for r in results if getattr(r, "created_time", None)]
        finished = [r.lifespan[1] for r in results if getattr(r, "lifespan", (-1, -1))[1] > 0]
        gen_s = (max(finished) - min(created)) if created and finished else None
        res |= {
            "requests": len(prompts),
            "completed": len(results),
            "failed": sum(1 for r in results if getattr(r, "error", None)),
            "input_tokens": sum(map(len, prompts)),
            "output_tokens": out_tokens,
            "all_full_length": all(len(r.generated_tokens) == spec["output"] for r in results),
            "total_s_with_warmup": round(wall, 3),
            "output_tokens_per_s_with_warmup": round(out_tokens / wall, 1),
        }
        if gen_s and gen_s > 0:
            res |= {
                "generation_s": round(gen_s, 3),
                "warmup_s": round(wall - gen_s, 3),
                "output_tokens_per_s": round(out_tokens / gen_s, 1),
                "total_tokens_per_s": round((out_tokens + res["input_tokens"]) / gen_s, 1),
                "timing_note": "generation_s: first request created -> last finished (after CUDA-graph warm-up)",
            }
        if len(results) < len(prompts):
            res["error"] = f"only {len(results)} of {len(prompts)} requests came back"
    except BaseException as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-4000:]
        save()
        return 1
    save()
    return 0


# ----- section 4: online ----------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    started_s: float
    ready_s: float | None = None


def start_server(args: argparse.Namespace, plan: Plan, log_path: Path) -> Server:
    cmd = [
        sys.executable, "-m", "tailserve.cli", "serve",
        "--model", args.model,
        "--device", args.device,
        "--dtype", args.dtype,
        "--port", str(args.port),
        "--kv-cache-memory", plan.server_kv,
        "--max-model-len", str(plan.server_max_model_len),
        "--max-num-seqs", str(plan.max_num_seqs),
        "--max-num-batched-tokens", str(plan.server_batched_tokens),
        "--log-level", "warning",
    ]  # fmt: skip
    log("starting: " + " ".join(cmd[3:]))
    handle = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{args.port}", log_path, time.perf_counter() - T0)


def wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}: {_tail(server.log_path)}")
        with contextlib.suppress(Exception), urllib.request.urlopen(server.url + "/ready", timeout=2) as resp:
            if resp.status == 200:
                server.ready_s = time.perf_counter() - T0
                return
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout_s:.0f} s: {_tail(server.log_path)}")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[Any], grace_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
    """Signal the child's own process group (it was started in a new session), then kill it if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def section_online(
    rec: dict[str, Any], server: Server | None, args: argparse.Namespace, plan: Plan, suite: Suite, tmp: Path
) -> Server:
    if server is None:
        server = start_server(args, plan, tmp / "server.log")
    rec["server_log"] = str(server.log_path)
    wait_ready(server, min(plan.server_start_timeout_s, max(10.0, suite.remaining_s() - 30)))
    rec |= {
        "server_started_at_s": round(server.started_s, 1),
        "server_ready_at_s": round(server.ready_s or 0.0, 1),
        "preset": plan.online_preset,
        "arrival": "poisson",
        "runs": [],
    }
    log(f"server ready ({(server.ready_s or 0) - server.started_s:.0f} s after start)")
    rates = list(plan.online_rates)
    # As many rates as fit with at least a third of the planned duration each, lowest rates first.
    min_duration = max(3.0, plan.online_duration_s / 3)
    fit = int((suite.remaining_s() - 10) // (min_duration + plan.online_tail_s + _RUN_OVERHEAD_S))
    fit = max(0, min(len(rates), fit))
    for i, rate in enumerate(rates):
        run: dict[str, Any] = {"rate_per_s": rate}
        rec["runs"].append(run)
        slot = (suite.remaining_s() - 10) / max(fit - i, 1) - _RUN_OVERHEAD_S
        duration = min(plan.online_duration_s, slot - plan.online_tail_s)
        if i >= fit or duration < min_duration:
            run["skipped"] = f"{suite.remaining_s():.0f} s of budget left"
            log(f"online rate {rate}: skipped")
            continue
        prefix = tmp / f"bench-rate{rate:g}"
        cmd = [
            sys.executable, "-m", "tailserve.cli", "bench", "run",
            "--base-url", server.url,
            "--endpoint", "chat",
            "--preset", plan.online_preset,
            "--arrival", "poisson", "--rate", str(rate),
            "--duration", f"{duration:.1f}", "--warmup", str(plan.online_warmup_s),
            "--tokenizer", "byte", "--seed", str(i),
            "--out", str(prefix), "--no-html", "--no-progress", "--label", f"poisson-{rate:g}",
            *plan.online_lengths,
        ]  # fmt: skip
        run["duration_s"] = round(duration, 1)
        log(f"online rate {rate}/s for {duration:.0f} s")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=duration + plan.online_tail_s + _RUN_OVERHEAD_S)
        except subprocess.TimeoutExpired:
            # Ctrl-C: bench stops, cancels what is in flight and still writes what it measured.
            run["interrupted"] = "in-flight requests outlived the run's time slot; cancelled"
            _stop(proc, grace_s=30, sig=signal.SIGINT)
            output = proc.communicate()[0] or ""
        run["returncode"] = proc.returncode
        result_path = prefix.with_suffix(".json")
        if not result_path.exists():
            run["error"] = "no result file"
            run["log_tail"] = output[-3000:]
            continue
        run |= bench_summary(json.loads(result_path.read_text()))
        run["result_file"] = str(result_path)
        suite.save()
        log(
            f"online rate {rate}/s: P99 TTFT {run.get('p99_ttft_s')} s, P99 TPOT {run.get('p99_tpot_ms')} ms, "
            f"SLOs {'pass' if run.get('slo_all_pass') else 'FAIL'}"
        )
    return server


def bench_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers a reader wants from a bench result document."""
    metrics = result.get("metrics") or {}

    def p(name: str, key: str, scale: float = 1.0) -> float | None:
        m = metrics.get(name) or {}
        v = m.get(key)
        return round(v * scale, 4) if isinstance(v, int | float) else None

    slo = result.get("slo") or {}
    return {
        "status": result.get("status"),
        "counts": result.get("counts"),
        "p50_ttft_s": p("ttft_s", "p50"),
        "p99_ttft_s": p("ttft_s", "p99"),
        "p50_tpot_ms": p("tpot_s", "p50", 1e3),
        "p99_tpot_ms": p("tpot_s", "p99", 1e3),
        "p99_e2e_s": p("e2e_s", "p99"),
        "p99_over_mean_ttft": p("ttft_s", "p99_over_mean"),
        "throughput": result.get("throughput"),
        "slo_verdicts": slo.get("verdicts"),
        "slo_all_pass": slo.get("all_pass"),
        "errors": (result.get("errors") or {}).get("by_kind"),
    }


# ----- main -------------------------------------------------------------------------------------
def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    s = doc["sections"]
    out: dict[str, Any] = {}
    bw = s.get("bandwidth", {})
    out["copy_bandwidth_gb_s"] = bw.get("copy_bandwidth_gb_s")
    for row in s.get("decode", {}).get("batches", []):
        out[f"decode_b{row['batch']}"] = {
            k: row.get(k)
            for k in (
                "floor_ms",
                "eager_step_over_floor",
                "graph_step_over_floor",
                "graph_forward_over_floor",
            )
        }
    runs = s.get("offline", {}).get("runs", {})
    ours: dict[str, Any] = next((r for r in runs.values() if "output_tokens_per_s" in r), {})
    theirs = s.get("transformers", {})
    out["offline_output_tok_s"] = {
        "tailserve": ours.get("output_tokens_per_s"),
        "transformers": theirs.get("output_tokens_per_s"),
    }
    if ours.get("output_tokens_per_s") and theirs.get("output_tokens_per_s"):
        out["offline_speedup_vs_transformers"] = round(
            ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2
        )
    out["online"] = [
        {k: r.get(k) for k in ("rate_per_s", "p99_ttft_s", "p99_tpot_ms", "slo_all_pass", "skipped", "error")}
        for r in s.get("online", {}).get("runs", [])
    ]
    return out


def in_process_sections(
    suite: Suite,
    args: argparse.Namespace,
    plan: Plan,
    device: torch.device,
    bw: float | None,
    wanted: set[str],
    reserve_s: float,
) -> None:
    """Build tailserve once (+ decode graphs), run the decode and offline sections, free the device."""
    holder: list[InProcess] = []

    def build(rec: dict[str, Any]) -> None:
        holder.append(build_in_process(args, plan, device))
        rec |= holder[0].info

    if suite.run("build", build, reserve_s + 30):
        ip = holder[0]
        if "decode" in wanted:
            suite.run("decode", lambda rec: section_decode(rec, ip, bw, plan, device), reserve_s + 20)
        if "offline" in wanted:
            suite.run("offline", lambda rec: section_offline(rec, ip, plan, suite, reserve_s), reserve_s + 20)
        del ip
    holder.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_suite.json", help="result JSON path")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="global time budget (default 7 min: stopping children and the server can add ~30 s)",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--hf-attn", default="paged|sdpa", help="transformers attn_implementation")
    ap.add_argument("--online-rates", help="comma list of Poisson rates (req/s) for the online section")
    ap.add_argument(
        "--online-output-len",
        help="bench --output-len for the online runs; 'preset' keeps the chat preset's 256-1024 "
        "(default uniform:128,384: chat inputs, outputs cut so three rates fit the budget)",
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="start the server only when the online section begins (default: at once, so its CPU-side "
        "weight draw overlaps the in-process sections)",
    )
    ap.add_argument("--hf-worker", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hf_worker is not None:
        return hf_worker(args.hf_worker, Path(args.out))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    plan = QUICK if args.quick else Plan()
    if args.online_rates:
        plan = dataclasses.replace(plan, online_rates=tuple(float(r) for r in args.online_rates.split(",")))
    if args.online_output_len:
        extra = () if args.online_output_len == "preset" else ("--output-len", args.online_output_len)
        plan = dataclasses.replace(plan, online_lengths=extra)
    wanted = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = wanted - set(SECTIONS)
    if unknown:
        print(f"unknown sections: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite-", dir=out.parent))
    suite = Suite(out, args.budget_s)
    suite.doc = {
        "suite": "tailserve-gpu-suite",
        "schema_version": 1,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": {k: v for k, v in vars(args).items() if k != "hf_worker"},
        "plan": plan.__dict__,
        "env": environment(device),
        "artifacts_dir": str(tmp),
        "sections": {},
    }
    suite.save()
    log(f"results -> {out}; env {suite.doc['env']}")

    server: Server | None = None
    if "online" in wanted and not args.no_overlap:
        try:
            server = start_server(args, plan, tmp / "server.log")
        except Exception as exc:  # noqa: BLE001 - the online section retries and records
            log(f"early server start failed: {exc}")
    try:
        bw: float | None = None
        if "bandwidth" in wanted:
            holder: dict[str, float] = {}
            suite.run(
                "bandwidth", lambda rec: holder.__setitem__("bw", section_bandwidth(rec, device, plan)), 10
            )
            bw = holder.get("bw")
        reserve = plan.reserve_online_s if "online" in wanted else 0.0
        if wanted & {"decode", "offline"}:
            in_process_sections(suite, args, plan, device, bw, wanted, reserve)
        if "transformers" in wanted:
            suite.run(
                "transformers", lambda rec: section_transformers(rec, args, plan, suite, tmp), reserve + 45
            )
        if "online" in wanted:

            def online(rec: dict[str, Any]) -> None:
                nonlocal server
                server = section_online(rec, server, args, plan, suite, tmp)

            suite.run("online", online, 30)
    finally:
        if server is not None:
            log("stopping the server")
            _stop(server.proc)
            suite.doc.setdefault("sections", {}).setdefault("online", {})["server_log_tail"] = _tail(
                server.log_path
            )
        suite.doc["summary"] = summarize(suite.doc)
        suite.save()
    log(f"done in {time.perf_counter() - T0:.0f} s -> {out}")
    print(json.dumps(suite.doc["summary"], indent=2, default=_json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
