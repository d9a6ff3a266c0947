"""Token sampling over the batch: penalties, logit bias, banned tokens, temperature, top-k/top-p/min-p.

Every transform is a row-wise tensor op over only the rows that asked for it; no Python loop runs
over the vocabulary. A row's draw depends only on its own logits and generator (one uniform per
row, then an inverse-CDF pick), so the same seed gives the same tokens whatever shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple

import torch

from tailserve.kernels import cpu as cpu_kernels


@dataclass
class SamplingSpec:
    """The per-row sampling settings the model runner needs (no stop logic: that is the engine's).

    The engine builds it from a request's SamplingParams (`engine.chunks.sampling_spec`): the
    settings both have carry the same names and defaults (so a bare spec samples at temperature 1,
    as a bare SamplingParams does; greedy callers say temperature=0.0). `logit_bias` holds (token id,
    added logit) pairs, each token once.
    `token_ids` is the sequence so far (prompt then output; the first `num_prompt_tokens` are the
    prompt): presence and frequency penalties count the output, the repetition penalty both.
    `banned_token_ids` get -inf this step (the engine bans end tokens until `min_tokens`).
    With `logprobs` set (0-20), `sample` also returns the row's `TokenScore`, under the model's own
    distribution (log_softmax of the logits as they came in: before penalties, bias, temperature or
    any truncation).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Sequence[tuple[int, float]] = ()
    logprobs: int | None = None
    # The engine's own, by keyword, after the settings SamplingParams has (those go in by position).
    _: KW_ONLY
    generator: torch.Generator | None = None
    banned_token_ids: Sequence[int] = ()
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    # Structured outputs: int32 [ceil(vocab / 32)], bit t % 32 of word t // 32 set where token t is
    # allowed (the engine's grammar matcher fills it); every other token gets -inf.
    token_bitmask: torch.Tensor | None = None

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


# A token's log-probability and the k most likely (token id, log-probability) pairs, best first.
TokenScore = tuple[float, list[tuple[int, float]]]


class Sampled(NamedTuple):
    """`sample`'s answer, one entry per row."""

    tokens: list[int]
    logprobs: Sequence[TokenScore | None]  # the drawn token's score where the row's spec asks (else None)


def sample(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> Sampled:
    """One token id per row of `logits` [R, vocab] (float32); `logits` itself is never modified."""
    raw = logits
    logits = adjust_logits(logits, specs)
    tokens = torch.empty(len(specs), dtype=torch.long, device=logits.device)
    greedy = [i for i, s in enumerate(specs) if s.temperature == 0.0]
    drawn = [i for i, s in enumerate(specs) if s.temperature != 0.0]
    if greedy:
        tokens[greedy] = _rows(logits, greedy).argmax(dim=-1)
    if drawn:
        tokens[drawn] = _draw(_rows(logits, drawn), [specs[i] for i in drawn])
    wanted = [i for i, s in enumerate(specs) if s.logprobs is not None]
    scores = _score_drawn(raw, tokens, wanted, specs) if wanted else [None] * len(specs)
    return Sampled([int(t) for t in tokens.tolist()], scores)


def _score_drawn(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], specs: Sequence[SamplingSpec]
) -> list[TokenScore | None]:
    """log_softmax of the unadjusted logits: the drawn token's value and the top few, per asking row
    (None for the others)."""
    most = max(specs[i].logprobs or 0 for i in rows)
    chosen, top = token_logprobs(_rows(logits, rows), tokens[rows], most)
    scores: list[TokenScore | None] = [None] * len(specs)
    for j, i in enumerate(rows):
        scores[i] = (chosen[j], top[j][: specs[i].logprobs or 0])
    return scores


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per row of `logits` [R, vocab]: log_softmax at `tokens[row]` and the k most likely (token,
    log-probability) pairs, best first. Generated tokens and prompt tokens (echo) alike."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    if not k:
        return chosen, [[] for _ in chosen]
    vals, ids = torch.topk(logp, k, dim=-1)
    return chosen, [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]


def _rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """t[rows], without a copy when the rows are all of t in order (the common case)."""
    return t if len(rows) == t.shape[0] and list(rows) == list(range(len(rows))) else t[list(rows)]


def adjust_logits(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """Penalties, logit bias, banned tokens and grammar masks on the rows that have them (a copy;
    `logits` if none)."""
    pen = [i for i, s in enumerate(specs) if s.penalised]
    bias = [i for i, s in enumerate(specs) if s.logit_bias or s.banned_token_ids]
    masked = [i for i, s in enumerate(specs) if s.token_bitmask is not None]
    if not pen and not bias and not masked:
        return logits
    out = logits.clone()
    if masked:
        _apply_bitmasks(out, masked, specs)
    vocab = out.shape[-1]
    flat = out.view(-1)
    if pen:
        _penalise(flat, vocab, pen, specs)
    rows = [i for i in bias for _ in specs[i].logit_bias]
    if rows:
        cols = [t for i in bias for t, _ in specs[i].logit_bias]
        vals = [b for i in bias for _, b in specs[i].logit_bias]
        idx = torch.tensor(rows, device=out.device) * vocab + torch.tensor(cols, device=out.device)
        flat.index_add_(0, idx, torch.tensor(vals, dtype=out.dtype, device=out.device))
    banned = [i * vocab + t for i in bias for t in specs[i].banned_token_ids]
    if banned:
        flat[torch.tensor(banned, device=out.device)] = float("-inf")
    return out


_BIT = torch.arange(32, dtype=torch.int32)


def _apply_bitmasks(logits: torch.Tensor, rows: list[int], specs: Sequence[SamplingSpec]) -> None:
    """-inf, in place, on every token a row's bitmask leaves unset: one unpack for all masked rows
    (one C call on CPU, where the unpack below costs ~0.5 ms a row at a 49k vocabulary)."""
    words = torch.stack([m for i in rows if (m := specs[i].token_bitmask) is not None])
    words = words.to(logits.device)
    vocab = logits.shape[-1]
    lib = cpu_kernels.load() if logits.device.type == "cpu" else None
    if lib is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        words = words.to(torch.int32).contiguous()
        index = torch.tensor(rows, dtype=torch.int64)
        lib.ts_apply_token_bitmask(
            cpu_kernels.ptr(logits), logits.stride(0), cpu_kernels.ptr(words), words.shape[1],
            cpu_kernels.ptr(index), len(rows), vocab,
        )  # fmt: skip
        return
    allowed = ((words[:, :, None] >> _BIT.to(logits.device)) & 1).view(len(rows), -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # a mask narrower than the logits allows none of the extra ids
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _penalise(flat: torch.Tensor, vocab: int, rows: Sequence[int], specs: Sequence[SamplingSpec]) -> None:
    """vLLM's penalties, in place on the flattened logits, touching only tokens a row has seen:
    repetition over prompt+output (divide positive, multiply negative logits), then frequency x
    output count and presence x (count > 0) subtracted."""
    seen: list[torch.Tensor] = []  # flat indices (row x vocab + token), one tensor per row
    outs: list[torch.Tensor] = []
    for i in rows:
        s = specs[i]
        ids = (
            torch.tensor(s.token_ids, dtype=torch.long, device=flat.device) + i * vocab
        )  # one C-level conversion per row
        if s.repetition_penalty != 1.0:
            seen.append(ids)
        if s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
            outs.append(ids[s.num_prompt_tokens :])
    rep = torch.tensor([s.repetition_penalty for s in specs], dtype=flat.dtype, device=flat.device)
    freq = torch.tensor([s.frequency_penalty for s in specs], dtype=flat.dtype, device=flat.device)
    pres = torch.tensor([s.presence_penalty for s in specs], dtype=flat.dtype, device=flat.device)
    if seen:
        idx = torch.unique(torch.cat(seen))
        vals = flat[idx]
        r = rep[idx // vocab]
        flat[idx] = torch.where(vals > 0, vals / r, vals * r)
    if outs and (out_ids := torch.cat(outs)).numel():
        idx, counts = torch.unique(out_ids, return_counts=True)
        row = idx // vocab
        flat.index_add_(0, idx, -(freq[row] * counts.to(flat.dtype) + pres[row]))


def _draw(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """One token per sampled row: temperature, then top-k / top-p / min-p, each from its own generator.

    Only row-wise ops touch a row (softmax, block sums, prefix sums, gathers), so a row's numbers,
    and so its token, are the same whatever else is in the batch.
    """
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype, device=logits.device)[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    vocab = probs.shape[-1]
    tokens = torch.empty(len(specs), dtype=torch.long, device=logits.device)
    groups: dict[str, list[int]] = {"plain": [], "top_k": [], "nucleus": []}
    for i, s in enumerate(specs):
        kind = "top_k" if 0 < s.top_k < vocab else "nucleus" if s.top_p < 1.0 or s.min_p > 0.0 else "plain"
        groups[kind].append(i)
    if rows := groups["plain"]:
        tokens[rows] = _pick(_rows(probs, rows), _uniforms(specs, rows, probs.device))
    if rows := groups["top_k"]:
        tokens[rows] = _draw_top_k(_rows(logits, rows), _rows(probs, rows), [specs[i] for i in rows])
    if rows := groups["nucleus"]:
        tokens[rows] = _draw_nucleus(_rows(probs, rows), [specs[i] for i in rows])
    return tokens


def _uniforms(specs: Sequence[SamplingSpec], rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """One draw in (0, 1] per row from the row's own generator (never 0: no zero-mass token is picked)."""
    u = torch.cat([1.0 - torch.rand(1, generator=specs[i].generator) for i in rows])[:, None]
    return u.to(device)  # drawn where the (CPU) generators live


_BLOCK = 256  # tokens per block of the two-level inverse CDF


def _blocks(weights: torch.Tensor) -> torch.Tensor:
    """[R, vocab] -> [R, blocks, _BLOCK], zero-padded at the end of the vocabulary."""
    n, vocab = weights.shape
    pad = -vocab % _BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    return weights.view(n, -1, _BLOCK)


def _total(weights: torch.Tensor) -> torch.Tensor:
    """[R, 1] row sums in a fixed order (block sums, then their prefix sum), whatever the batch."""
    return _blocks(weights).sum(-1).cumsum(-1)[:, -1:]


def _pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where u x (row mass) falls in the cumulative weights: a draw from `weights`.

    Two levels (a prefix sum over block sums, then one over the chosen block) instead of a prefix
    sum over the whole vocabulary, which is a serial loop per row. Never picks a zero weight.
    """
    blocks = _blocks(weights)
    block_cdf = blocks.sum(-1).cumsum(-1)
    target = u * block_cdf[:, -1:]
    b = torch.searchsorted(block_cdf, target).clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, b[:, :, None].expand(-1, 1, _BLOCK))[:, 0]
    j = torch.searchsorted(inner.cumsum(-1), target - before)
    # Rounding may leave the block's own sum a hair under the target: take its last nonzero token.
    last_nonzero = torch.where(inner > 0, torch.arange(_BLOCK, device=inner.device), 0).amax(-1, keepdim=True)
    return (b * _BLOCK + torch.minimum(j, last_nonzero))[:, 0]


def _draw_top_k(logits: torch.Tensor, probs: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """Top-k rows: the k best (one topk for the batch), then top-p / min-p on their renormalised mass.

    The draw is an exponential race over the kept tokens (argmax p / E, E ~ Exp(1)) whose noise is
    a hash of (one draw from the row's generator, token id): a token keeps its noise when a
    rounding-level change of the logits (a prefix-cache hit) swaps which near-equal tokens make the
    top k, so the winner usually stays the winner.
    """
    ks = torch.tensor([s.top_k for s in specs], device=logits.device)[:, None]
    order = torch.topk(logits, int(ks.max()), dim=-1).indices  # sorted best first
    sorted_probs = probs.gather(1, order)
    ranks = torch.arange(order.shape[1], device=order.device)[None, :]
    sorted_probs = sorted_probs.masked_fill(ranks >= ks, 0.0)
    cdf = sorted_probs.cumsum(-1)  # prefix sums: entries past a row's k never change its first k
    keep = _nucleus_len(sorted_probs, cdf, cdf.gather(1, ks - 1), specs).clamp(max=ks)
    kept = sorted_probs.masked_fill(ranks >= keep, 0.0)
    keys = torch.cat([torch.randint(0, 2**62, (1,), generator=s.generator) for s in specs])[:, None]
    keys = keys.to(order.device)
    race = kept / _hashed_exponentials(order, keys)
    return order.gather(1, race.argmax(-1, keepdim=True))[:, 0]


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _hashed_exponentials(ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise per (row key, token id): splitmix64 of key + id x golden, wrapping int64 math."""
    x = keys + ids * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    u = (_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)  # in (0, 1)
    return (-torch.log(u)).to(torch.float32)


def _nucleus_len(
    sorted_probs: torch.Tensor, cdf: torch.Tensor, mass: torch.Tensor, specs: Sequence[SamplingSpec]
) -> torch.Tensor:
    """[R, 1] length of the kept prefix of best-first `sorted_probs`: the smallest prefix reaching
    top_p of `mass`, cut to tokens of at least min_p x the best one; never empty."""
    top_p = torch.tensor([s.top_p for s in specs], dtype=cdf.dtype, device=cdf.device)[:, None]
    min_p = torch.tensor([s.min_p for s in specs], dtype=cdf.dtype, device=cdf.device)[:, None]
    n_top_p = ((cdf - sorted_probs) < top_p * mass).sum(-1, keepdim=True)
    n_min_p = (sorted_probs >= min_p * sorted_probs[:, :1]).sum(-1, keepdim=True)
    return torch.minimum(n_top_p, n_min_p).clamp(min=1)


_MAX_REJECTIONS = 32


def _draw_nucleus(probs: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """Top-p / min-p without sorting the vocabulary: draw from the candidates, accept if the token is
    in the nucleus, else keep only the tokens ranked above it and draw again.

    Every candidate set holds the whole nucleus, so an accepted token is an exact draw from it; the
    first draw is accepted with probability >= top_p. Ranks break ties by token id, as a stable sort.
    """
    n, vocab = probs.shape
    dev = probs.device
    top_p = torch.tensor([s.top_p for s in specs], dtype=probs.dtype, device=dev)[:, None] * _total(probs)
    min_kept = torch.tensor([s.min_p for s in specs], dtype=probs.dtype, device=dev)[:, None] * probs.amax(
        -1, keepdim=True
    )
    ids = torch.arange(vocab, device=dev)[None, :]
    tokens = torch.empty(n, dtype=torch.long, device=dev)
    active = list(range(n))
    candidates = probs  # the active rows' candidate weights, aligned with `active`
    for _ in range(_MAX_REJECTIONS):
        pick = _pick(candidates, _uniforms(specs, active, dev))[:, None]
        row_probs = _rows(probs, active)
        p_pick = row_probs.gather(1, pick)
        above = (row_probs > p_pick) | ((row_probs == p_pick) & (ids < pick))
        kept = torch.where(above, row_probs, 0.0)
        ok = (_total(kept) < top_p[active]) & (p_pick >= min_kept[active])
        accepted = ok[:, 0].tolist()
        tokens[[row for row, a in zip(active, accepted, strict=True) if a]] = pick[ok]
        rejected = [j for j, a in enumerate(accepted) if not a]
        if not rejected:
            return tokens
        candidates = torch.where(above[rejected], candidates[rejected], 0.0)
        active = [active[j] for j in rejected]
    # Pathological rows (rare: a long tail of rejections) fall back to an exact sort.
    sorted_probs, order = torch.sort(_rows(probs, active), dim=-1, descending=True, stable=True)
    cdf = sorted_probs.cumsum(-1)
    last = _nucleus_len(sorted_probs, cdf, cdf[:, -1:], [specs[i] for i in active]) - 1
    target = _uniforms(specs, active, dev) * cdf.gather(1, last)
    picked = torch.minimum(torch.searchsorted(cdf, target), last)
    tokens[active] = order.gather(1, picked)[:, 0]
    return tokens
