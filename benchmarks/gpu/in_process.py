"""The in-process sections: copy bandwidth (the decode floor's denominator), decode step times of
the engine against that floor, and offline throughput, once with CUDA graphs and once eager.

Only public APIs: the engine is `LLM(config=EngineConfig(...))`, eager vs graphs is
`ModelConfig.enforce_eager`, and a decode step is timed as `LLMEngine.step()` with every request
past its prefill. Random (dummy) weights with the model's real shapes: speed only, never quality.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from functools import partial
from typing import Any

import torch

from gpu.suite import GIB, Plan, Suite, log, ms_stats, sync
from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.model.plans import activation_dtype
from tailserve.weights.loader import LoadedModel, load_model

MODES = ("default", "enforce_eager")  # default: CUDA graphs where the engine can; eager runs second


def time_calls(fn: Any, iters: int, device: torch.device, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def section_bandwidth(rec: dict[str, Any], device: torch.device, plan: Plan) -> float:
    """Device-to-device copy of a large buffer: (bytes read + bytes written) / time."""
    n = plan.bandwidth_bytes // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = time_calls(partial(dst.copy_, src), 10, device)
    bw = 2 * plan.bandwidth_bytes / min(times)
    rec |= {
        "buffer_bytes": plan.bandwidth_bytes,
        "copy_times": ms_stats(times),
        "copy_bandwidth_gb_s": round(bw / 1e9, 1),
        "note": "read+write bytes over the fastest of 10 copies; the decode floor divides bytes read by this",
    }
    return bw


def load_weights(args: argparse.Namespace, device: torch.device) -> LoadedModel:
    """The weights once, on the CPU, shared by both engine builds (each copies them to the device)."""
    return load_model(args.model, activation_dtype(args.weight_format, device))


def build_llm(
    args: argparse.Namespace, plan: Plan, device: torch.device, loaded: LoadedModel, eager: bool
) -> LLM:
    config = EngineConfig(
        model=ModelConfig(
            model=args.model,
            weight_format=args.weight_format,
            device=device.type,
            max_model_len=plan.max_model_len,
            enforce_eager=eager,
        ),
        cache=CacheConfig(kv_cache_memory_bytes=plan.kv_bytes, enable_prefix_caching=False),
        # fcfs: prefill takes whatever the decodes leave of the budget (no SLO pacing to time here).
        scheduler=SchedulerConfig(
            max_num_batched_tokens=plan.max_num_batched_tokens, max_num_seqs=plan.max_num_seqs, policy="fcfs"
        ),
    )
    return LLM(config=config, loaded=loaded)


def engine_info(llm: LLM, build_s: float, device: torch.device) -> dict[str, Any]:
    runner = llm.engine.runner
    info: dict[str, Any] = {
        "build_s": round(build_s, 2),
        "attention_backend": runner.backend.name,
        "decode_graphs": runner.use_decode_graphs,
        "dtype": str(runner.model.embed.dtype),
        "kv_blocks": runner.num_blocks,
        "block_size": runner.block_size,
        "kv_bytes_per_token": llm.engine.kv_bytes_per_token,
    }
    if device.type == "cuda":
        info["gpu_allocated_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
    return info


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Every weight is read once per decode step, except an untied embedding table (a few rows are)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    head_ptrs = {p.data_ptr() for p in head.parameters()} if isinstance(head, torch.nn.Module) else set()
    if isinstance(embed, torch.Tensor) and embed.data_ptr() not in head_ptrs:
        total -= embed.numel() * embed.element_size()
    return int(total)


def decode_step_times(llm: LLM, batch: int, context: int, iters: int) -> list[float]:
    """`batch` requests with `context - 1` prompt tokens, stepped past their prefill; then the wall
    time of `iters` engine steps, each a decode of every request (tokens come back as ints, so each
    step is synchronized). Distinct prompts, prefix caching off: every sequence's KV is its own."""
    engine = llm.engine
    warmup = 3
    # Nobody may finish while timed: the first requests decode while later ones still prefill.
    params = SamplingParams(max_tokens=engine.max_model_len - context, ignore_eos=True, temperature=0.0)
    rng = random.Random(batch)
    top = min(engine.arch.vocab_size, 256)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}", [rng.randrange(3, top) for _ in range(context - 1)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (and whatever decodes ride along) until all have a token
        started.update(out.request_id for out in engine.step())
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outputs) == batch, f"a decode step advanced {len(outputs)} of {batch} requests"
    engine.abort_all()
    return times


def measure_decode(rec: dict[str, Any], llm: LLM, bw: float | None, plan: Plan) -> None:
    runner = llm.engine.runner
    weight_bytes = weight_bytes_read_per_step(runner.model)
    kv_per_token = llm.engine.kv_bytes_per_token
    ctx = plan.decode_context
    prefill_steps = -(-max(plan.decode_batches) * ctx // plan.max_num_batched_tokens) + 1
    blocks_per_seq = -(-(ctx + prefill_steps + plan.decode_iters + 5) // runner.block_size)  # an upper bound
    rec |= {
        "context_tokens": ctx,
        "weight_bytes_read_per_step": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "bandwidth_gb_s": round(bw / 1e9, 1) if bw else None,
        "floor_formula": "(weight bytes + batch x context x KV bytes/token) / copy bandwidth",
        "step": "LLMEngine.step() of a decode-only batch: scheduling + forward + sampling",
        "batches": [],
    }
    for batch in plan.decode_batches:
        row: dict[str, Any] = {"batch": batch}
        rec["batches"].append(row)
        if batch * blocks_per_seq > runner.num_blocks or batch > plan.max_num_seqs:
            row["skipped"] = f"needs {batch * blocks_per_seq} KV blocks, the pool has {runner.num_blocks}"
            continue
        kv_read = batch * ctx * kv_per_token
        row["kv_bytes_read"] = kv_read
        if bw:
            row["floor_ms"] = round((weight_bytes + kv_read) / bw * 1e3, 4)
        row["step"] = ms_stats(decode_step_times(llm, batch, ctx, plan.decode_iters))
        if row.get("floor_ms"):
            row["step_over_floor"] = round(row["step"]["median_ms"] / row["floor_ms"], 3)
        log(f"decode batch {batch}: floor {row.get('floor_ms')} ms, step {row['step']['median_ms']} ms")


def offline_prompts(plan: Plan, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    lo, hi = plan.offline_input
    top = min(vocab, 256)  # byte-level ids: every dummy tokenizer can decode them
    return [[rng.randrange(3, top) for _ in range(rng.randint(lo, hi))] for _ in range(plan.offline_requests)]


def measure_offline(rec: dict[str, Any], llm: LLM, plan: Plan) -> None:
    prompts = offline_prompts(plan, llm.engine.arch.vocab_size)
    params = SamplingParams(max_tokens=plan.offline_output, ignore_eos=True, temperature=0.0)
    input_tokens = sum(map(len, prompts))
    # Warm-up (Triton compiles prefill shapes, cuBLAS picks kernels); not timed.
    llm.generate(
        [p[:32] for p in prompts[:8]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    )
    device = llm.engine.runner.device
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in outs)
    rec |= {
        "requests": len(prompts),
        "input_tokens": input_tokens,
        "input_len_range": list(plan.offline_input),
        "output_tokens_per_request": plan.offline_output,
        "scheduler": {
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
        },
        "total_s": round(wall, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "total_tokens_per_s": round((out_tokens + input_tokens) / wall, 1),
        "requests_per_s": round(len(prompts) / wall, 3),
        "all_full_length": all(len(o.token_ids) == plan.offline_output for o in outs),
    }
    log(f"offline: {wall:.2f} s, {out_tokens / wall:.0f} output tok/s")


def engine_sections(
    suite: Suite,
    args: argparse.Namespace,
    plan: Plan,
    device: torch.device,
    bw: float | None,
    wanted: set[str],
    reserve_s: float,
) -> None:
    """Per mode (default: decode graphs where the engine can; then enforce_eager): build the engine,
    time decode steps and offline throughput, free the device. The eager run is skipped when graphs
    never came on in the default build (it would run the same path twice)."""
    holder: dict[str, LoadedModel] = {}

    def weights(rec: dict[str, Any]) -> None:
        start = time.perf_counter()
        holder["loaded"] = load_weights(args, device)
        rec["load_s"] = round(time.perf_counter() - start, 2)

    if not suite.run("weights", weights, reserve_s + 30):
        return
    graphs_ran = False
    for mode in MODES:
        eager = mode == "enforce_eager"
        if eager and not graphs_ran:
            suite.doc["sections"][mode] = {
                "status": "skipped",
                "reason": "decode graphs were not on in the first build (no CUDA/Triton, or capture failed), "
                "so an eager run would repeat the same path",
            }
            continue

        def measure(rec: dict[str, Any], eager: bool = eager) -> None:
            nonlocal graphs_ran
            start = time.perf_counter()
            llm = build_llm(args, plan, device, holder["loaded"], eager)
            rec["engine"] = engine_info(llm, time.perf_counter() - start, device)
            graphs_ran = graphs_ran or bool(rec["engine"]["decode_graphs"])
            try:
                if "decode" in wanted:
                    rec["decode"] = {}
                    measure_decode(rec["decode"], llm, bw, plan)
                if "offline" in wanted:
                    rec["offline"] = {}
                    measure_offline(rec["offline"], llm, plan)
            finally:
                del llm
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()

        suite.run(mode, measure, reserve_s + (60 if eager else 20))
    holder.clear()
    gc.collect()
