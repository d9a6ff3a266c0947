"""Int8 x int8 prompt rows (the int4-w8a8 format): prefill speed against int4's bf16 prompt rows,
and what 8-bit activations cost in quality under the gate, in four variants.

- Speed: the one step that prefills a fresh 50- and 412-token prompt, int4 against int4-w8a8,
  interleaved round by round (median of each round's 5).
- Quality (the gate's measurement, `QualityGate._measure`, against the cached fp32 reference):
  per-row activation scales as the format runs them; each linear alone on int8; SmoothQuant-style
  per-channel smoothing (alpha 0.5, channel maxima from a calibration text that is not the gate's
  corpus); and per-group activation scales of 32 / 64 inputs (llama.cpp's Q8 activation blocks),
  fake-quantized with float weights (the best any int8-activation kernel could do).

`python benchmarks/w8a8_prefill.py` (~6 min on a 2-core Zen 4). Never run beside another measurement.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_threads import prefill_step_ms
from machine import git_commit, machine_line

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.model import quality
from tailserve.model.linear import Linear
from tailserve.model.quality import EvalPlan, HeldOutText, trace_model
from tailserve.model.quality_gate import QualityGate, build_format_model
from tailserve.model.transformer import TransformerLM
from tailserve.model.weight_formats import pack_w8a8, quantize_rows

CALIBRATION = Path(__file__).with_name("w8a8_calibration.txt")
LINEARS = ("qkv", "o", "gate_up", "down")


def engine(fmt: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model="default", weight_format=fmt, force_weight_format=True, num_threads=2),
            cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        )
    )


def speed(rounds: int = 3) -> None:
    engines = {f: engine(f) for f in ("int4", "int4-w8a8")}
    figures: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, e in engines.items():
            for n in (50, 412):
                figures.setdefault((name, n), []).append(statistics.median(prefill_step_ms(e, n, 5)))
    for (name, n), ms in figures.items():
        print(
            f"prefill {n:3d} tokens  {name:10s} {statistics.median(ms):6.1f} ms  rounds {[round(m) for m in ms]}"
        )


def channel_maxima(gate: QualityGate, model: TransformerLM) -> dict[int, torch.Tensor]:
    """Each layer linear's largest |input| per channel over the calibration text (prompt rows)."""
    loaded = gate._fp32()
    ids = loaded.tokenizer.encode(CALIBRATION.read_text(encoding="utf-8"))
    text = HeldOutText([ids[i : i + 129] for i in range(0, len(ids) - 129, 64)], [])
    plan = EvalPlan(tokens=128 * len(text.windows), greedy_prompts=0)
    maxima: dict[int, torch.Tensor] = {}
    plain = Linear.prefill_matmul

    def record(self: Linear, x: torch.Tensor) -> torch.Tensor:
        v = x.float().abs().amax(0)
        maxima[id(self)] = torch.maximum(maxima.get(id(self), torch.zeros_like(v)), v)
        return plain(self, x)

    greedy = quality._greedy
    with_patch(Linear, "prefill_matmul", record)
    quality._greedy = lambda *a, **k: []  # type: ignore[assignment]
    try:
        trace_model(model, text, plan, torch.device("cpu"))
    finally:
        quality._greedy = greedy
        with_patch(Linear, "prefill_matmul", plain)
    return maxima


def with_patch(owner: object, name: str, fn: Callable[..., torch.Tensor]) -> None:
    setattr(owner, name, fn)


def per_row(linear: Linear, smooth: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    assert linear.weight is not None
    w = linear.weight.float()
    if smooth is not None:
        w = w * smooth
    packed = pack_w8a8(w, None, None)

    def run(x: torch.Tensor) -> torch.Tensor:
        xs = x.float() if smooth is None else x.float() / smooth
        q, scale = quantize_rows(xs)
        return (torch._int_mm(q, packed.codes).float() * scale[:, None] * packed.scale).to(torch.bfloat16)

    return run


def per_group(linear: Linear, group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    assert linear.weight is not None
    w = linear.weight.float()

    def run(x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        xg = x.float().view(m, k // group, group)
        s = xg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return F.linear(((xg / s).round() * s).view(m, k), w).to(torch.bfloat16)

    return run


def quality_variants() -> None:
    gate = QualityGate("default", torch.device("cpu"))
    loaded = gate._fp32()
    model = build_format_model(loaded, "int4", "bf16", gate.plan.max_positions, torch.device("cpu"))
    maxima = channel_maxima(gate, model)

    def measure(
        label: str,
        make: Callable[[Linear], Callable[[torch.Tensor], torch.Tensor]] | None,
        names: tuple[str, ...],
    ) -> None:
        for layer in model.layers:
            for n in LINEARS:
                linear = getattr(layer, n)
                linear.__dict__.pop("prefill_matmul", None)
                if make is not None and n in names:
                    linear.prefill_matmul = make(linear)
        gate.build = lambda *_a, **_k: model
        a, _ = gate._measure("int4", "bf16")
        print(
            f"{label:34s} top-1 prefill {a.prefill_top1:6.1%} decode {a.decode_top1:6.1%}  "
            f"ppl ratio prefill {a.prefill_ppl_ratio:.4f} decode {a.decode_ppl_ratio:.4f}",
            flush=True,
        )

    def smoothed(linear: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        assert linear.weight is not None
        xa = maxima[id(linear)].clamp_min(1e-5)
        wa = linear.weight.float().abs().amax(0).clamp_min(1e-5)
        return per_row(linear, (xa.sqrt() / wa.sqrt()).clamp_min(1e-5))

    measure("bf16 prompt rows (int4 as it serves)", None, ())
    measure("per-row int8, every linear", lambda lin: per_row(lin, None), LINEARS)
    for n in LINEARS:
        measure(f"per-row int8, {n} alone", lambda lin: per_row(lin, None), (n,))
    measure("smoothed (alpha 0.5), every linear", smoothed, LINEARS)
    measure("smoothed (alpha 0.5), qkv alone", smoothed, ("qkv",))
    for group in (32, 64):
        measure(
            f"groups of {group} (fake-quant), every linear",
            functools.partial(per_group, group=group),
            LINEARS,
        )


def main() -> int:
    torch.set_num_threads(2)
    print(machine_line())
    print(f"tailserve {git_commit()}")
    if "--quality-only" not in sys.argv:
        speed()
    quality_variants()
    return 0


if __name__ == "__main__":
    sys.exit(main())
