"""Int8 prompt rows with each input's outlier channels kept apart: what quality they keep under the
gate's own measurement, fake-quantized (float weights; WQ=1 also rounds them to per-row int8).

Variants, named on the command line: `base` (bf16 prompt rows), `sK` (static top-K outlier channels
by the calibration text's channel maxima, every linear), `aK:qkv,o,gate_up` (the same on the named
linears only), `dK` (top-K chosen per call from the rows themselves), `mA:...` (SmoothQuant-style
smoothing with alpha A instead of outliers). ~10-15 s a variant on a 2-core Zen 4.

`WQ=1 .venv/bin/python benchmarks/w8a8_outliers.py a32:qkv,o,gate_up` (see docs/BENCHMARKS.md).
"""

# ruff: noqa: B023  (each lambda runs at once inside measure(), within its loop turn)

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tailserve.model import quality
from tailserve.model.linear import Linear
from tailserve.model.quality import EvalPlan, HeldOutText, trace_model
from tailserve.model.quality_gate import QualityGate, build_format_model

LINEARS = ("qkv", "o", "gate_up", "down")
WQ = os.environ.get("WQ") == "1"
torch.set_num_threads(2)
gate = QualityGate("default", torch.device("cpu"))
loaded = gate._fp32()
model = build_format_model(loaded, "int4", "bf16", gate.plan.max_positions, torch.device("cpu"))
plain = Linear.prefill_matmul


def channel_maxima():
    ids = loaded.tokenizer.encode(
        (Path(__file__).parents[1] / "src/tailserve/model/w8a8_calibration.txt").read_text()
    )
    text = HeldOutText([ids[i : i + 129] for i in range(0, len(ids) - 129, 64)], [])
    plan = EvalPlan(tokens=128 * len(text.windows), greedy_prompts=0)
    maxima = {}

    def record(self, x):
        v = x.float().abs().amax(0)
        maxima[id(self)] = torch.maximum(maxima.get(id(self), torch.zeros_like(v)), v)
        return plain(self, x)

    greedy = quality._greedy
    Linear.prefill_matmul = record
    quality._greedy = lambda *a, **k: []
    try:
        trace_model(model, text, plan, torch.device("cpu"))
    finally:
        quality._greedy = greedy
        Linear.prefill_matmul = plain
    return maxima


def fq_rows(x):
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return (x / s).round().clamp(-127, 127) * s


def static(lin, idx):
    w = lin.weight.float()
    keep = torch.ones(w.shape[1], dtype=torch.bool)
    keep[idx] = False
    wk, wo = w[:, keep], w[:, idx]
    if WQ:
        sw = wk.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        wk = (wk / sw).round().clamp(-127, 127) * sw

    def run(x):
        xs = x.float()
        y = F.linear(fq_rows(xs[:, keep]), wk) + F.linear(xs[:, idx], wo)
        if lin.bias is not None:
            y = y + lin.bias.float()
        return y.to(torch.bfloat16)

    return run


def smooth(lin, xa, al):
    w = lin.weight.float()
    wa = w.abs().amax(0).clamp_min(1e-5)
    f = (xa.clamp_min(1e-5) ** al / wa ** (1 - al)).clamp_min(1e-5)
    ws = w * f
    sw = ws.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    ws = (ws / sw).round().clamp(-127, 127) * sw

    def run(x):
        y = F.linear(fq_rows(x.float() / f), ws)
        if lin.bias is not None:
            y = y + lin.bias.float()
        return y.to(torch.bfloat16)

    return run


def dynamic(lin, k):
    w = lin.weight.float()

    def run(x):
        xs = x.float()
        idx = xs.abs().amax(0).topk(k).indices
        keep = torch.ones(w.shape[1], dtype=torch.bool)
        keep[idx] = False
        y = F.linear(fq_rows(xs[:, keep]), w[:, keep]) + F.linear(xs[:, idx], w[:, idx])
        if lin.bias is not None:
            y = y + lin.bias.float()
        return y.to(torch.bfloat16)

    return run


def measure(label, make, names=LINEARS):
    t = time.time()
    for layer in model.layers:
        for n in LINEARS:
            lin = getattr(layer, n)
            lin.__dict__.pop("prefill_matmul", None)
            if make is not None and n in names:
                lin.prefill_matmul = make(lin)
    gate.build = lambda *_a, **_k: model
    a, _ = gate._measure("int4", "bf16")
    print(
        f"{label:40s} top-1 prefill {a.prefill_top1:6.1%} decode {a.decode_top1:6.1%}  ppl prefill {a.prefill_ppl_ratio:.4f} decode {a.decode_ppl_ratio:.4f}  ({time.time() - t:.0f}s)",
        flush=True,
    )


variants = sys.argv[1:] or ["base", "s8", "s16", "s32", "d16"]
maxima = None
for v in variants:
    if v == "base":
        measure("bf16 prompt rows", None)
    elif v.startswith("s"):
        k = int(v[1:])
        if maxima is None:
            maxima = channel_maxima()
        measure(
            f"static top-{k} outliers float, rest int8/row",
            lambda lin: static(lin, maxima[id(lin)].topk(k).indices),
        )
    elif v.startswith("a"):  # a32:qkv  static top-k on one linear alone
        k, n = v[1:].split(":")
        k = int(k)
        names = tuple(n.split(","))
        if maxima is None:
            maxima = channel_maxima()
        measure(f"static top-{k}, {n}", lambda lin: static(lin, maxima[id(lin)].topk(k).indices), names)
    elif v.startswith("m"):  # m0.5:qkv,o,gate_up smoothing alpha on those linears
        al, n = v[1:].split(":")
        al = float(al)
        names = tuple(n.split(","))
        if maxima is None:
            maxima = channel_maxima()
        measure(f"smoothed alpha {al}, {n}", lambda lin: smooth(lin, maxima[id(lin)], al), names)
    elif v.startswith("d"):
        k = int(v[1:])
        measure(f"dynamic top-{k} outliers float, rest int8/row", lambda lin: dynamic(lin, k))
