"""Calibration of a w8a8 plan: which input channels of each int8 prompt-row linear stay in float.

A few channels of this model family's layer inputs run 10-200x above the rest of a row (the same
channels of the residual stream in most layers). With one int8 scale per row they set the scale and
leave a typical value a handful of the 127 levels: the gate measured 85% top-1 for plain per-row
int8. Kept apart in float32, the rest quantize well (docs/ENGINE.md, "int8 prompt rows").

The channels are found once, when the model is built: a prompt-row forward over a bundled text
(not the quality gate's corpus) records each linear's largest |input| per channel, and the
OUTLIER_CHANNELS largest of each become its float channels. The choice depends on the weights and
that text only, so every start of the same model picks the same channels, and a row's result still
never depends on its batch.
"""

from __future__ import annotations

import logging
import time
from importlib import resources
from typing import cast

import torch

from tailserve.model.linear import Linear
from tailserve.model.transformer import DecoderLayer, TransformerLM

log = logging.getLogger(__name__)

OUTLIER_CHANNELS = 32  # per linear input; 16 cost ~0.7 point of top-1, 8 ~2 points (docs/ENGINE.md)
CHUNK_TOKENS = 128  # prompt rows per calibration step
MAX_TOKENS = 1024  # of the bundled text
_BLOCK_SIZE = 16


def calibration_ids(model: TransformerLM, encode: object | None) -> list[int]:
    """The bundled calibration text as token ids (`encode`: the model's tokenizer.encode); a model
    without a tokenizer (dummy weights) gets a fixed spread of ids over its vocabulary."""
    vocab = model.arch.vocab_size
    if callable(encode):
        text = resources.files("tailserve.model").joinpath("w8a8_calibration.txt").read_text(encoding="utf-8")
        ids = [int(i) for i in encode(text) if 0 <= int(i) < vocab]
    else:
        ids = [(i * 7919 + 13) % vocab for i in range(512)]
    return ids[:MAX_TOKENS]


def w8a8_linears(model: TransformerLM) -> list[Linear]:
    return [
        linear
        for layer in model.layers
        for linear in cast(DecoderLayer, layer).linears()
        if linear.prefill_kernel == "w8a8"
    ]


def calibrate(model: TransformerLM, ids: list[int], outlier_channels: int = OUTLIER_CHANNELS) -> None:
    """Run `ids` as one prompt through `model` (its w8a8 linears still on their bf16 copies), then
    switch each w8a8 linear to int8 prompt rows with its `outlier_channels` largest inputs in float."""
    from tailserve.model.runner import ModelRunner, SeqChunk
    from tailserve.model.sampler import SamplingSpec

    linears = w8a8_linears(model)
    if not linears:
        return
    if not ids:
        raise ValueError("w8a8 calibration needs at least one token")
    start = time.perf_counter()
    device = model.embed.device
    # The text as prompts of at most CHUNK_TOKENS, each from position 0: within any model's
    # positions (the gate builds with few), one step each.
    window = min(CHUNK_TOKENS, int(model.cos_table.shape[0]))
    num_blocks = -(-window // _BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks, _BLOCK_SIZE, device)
    table = list(range(num_blocks))
    for linear in linears:
        linear.input_amax = torch.zeros(linear.in_features, dtype=torch.float32, device=device)
    try:
        spec = SamplingSpec()
        with torch.inference_mode():
            for pos in range(0, len(ids), window):
                runner.logits_for([SeqChunk(ids[pos : pos + window], 0, table, False, spec)])
        for linear in linears:
            amax = linear.input_amax
            assert amax is not None
            k = min(outlier_channels, linear.in_features - 1)
            linear.use_w8a8(amax.topk(k).indices.sort().values.cpu())
    finally:
        for linear in linears:
            linear.input_amax = None
    log.info(
        "w8a8: %d linears calibrated on %d tokens (%d float channels each) in %.2fs",
        len(linears),
        len(ids),
        outlier_channels,
        time.perf_counter() - start,
    )
