"""transformers' continuous batching (`generate_batch`) on the same architecture and workload as the
offline section, in a child process so its memory is freed and a hang is killed at its timeout.
The child is `gpu_suite.py --hf-worker SPEC.json --out OUT.json` (run by the suite, not by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from proc import stop_process_group

from gpu.suite import Plan, Suite, json_default, log

ENTRY = Path(__file__).resolve().parents[1] / "gpu_suite.py"  # runs hf_worker() with --hf-worker


def section_transformers(
    rec: dict[str, Any], args: argparse.Namespace, plan: Plan, suite: Suite, tmp: Path
) -> None:
    """transformers' continuous batching in a child process (killed at its timeout, memory freed)."""
    spec = {
        "model": args.model,
        "device": args.device,
        "dtype": "float32" if args.weight_format == "fp32" else "auto",  # int formats: bf16 here
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
    cmd = [sys.executable, str(ENTRY), "--hf-worker", str(spec_path), "--out", str(out_path)]
    log(f"transformers worker (timeout {timeout:.0f} s)")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process_group(proc, grace_s=10)
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
        out_path.write_text(json.dumps(res, indent=2, default=json_default))

    try:
        import inspect

        import transformers
        from hf_models import llama_config
        from transformers import GenerationConfig, LlamaForCausalLM

        from tailserve.weights.arch import preset

        res["transformers"] = transformers.__version__
        device = torch.device(
            "cuda" if spec["device"] in ("cuda", "auto") and torch.cuda.is_available() else "cpu"
        )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if spec["dtype"] not in ("auto", None):
            dtype = getattr(torch, spec["dtype"])
        arch = preset(spec["model"].removeprefix("dummy:"))
        # Rope scaling changes no shape and no cost; the rest is the model's own config.
        cfg = llama_config(arch, max_position_embeddings=max(spec["max_model_len"], 2048))
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
        gen_cfg = GenerationConfig(  # type: ignore[no-untyped-call]
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
