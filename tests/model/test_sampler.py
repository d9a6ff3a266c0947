"""The sampler against a plain sort-based reference: same support, same distribution, same penalties,
and a row's token independent of the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from tailserve.model.sampler import SamplingSpec, adjust_logits, sample

VOCAB = 700  # not a multiple of the sampler's block: the padded tail is exercised


def _logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _reference_probs(row: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The textbook pipeline: temperature, top-k mask, softmax, sort, top-p prefix, min-p cut."""
    row = row / spec.temperature
    if 0 < spec.top_k < row.shape[-1]:
        kth = torch.topk(row, spec.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row.double(), dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = (sorted_probs.cumsum(-1) - sorted_probs) < spec.top_p
    keep &= sorted_probs >= spec.min_p * sorted_probs[0]
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


SPECS = {
    "temperature": SamplingSpec(0.7),
    "top_k": SamplingSpec(1.0, top_k=20),
    "top_p": SamplingSpec(1.0, top_p=0.8),
    "min_p": SamplingSpec(1.2, min_p=0.1),
    "top_k_top_p": SamplingSpec(1.0, top_p=0.6, top_k=40),
    "all": SamplingSpec(0.9, top_p=0.9, top_k=100, min_p=0.02),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_draws_follow_the_reference_distribution(name: str) -> None:
    base = SPECS[name]
    n = 3000
    logits = _logits(1).expand(n, VOCAB).contiguous()
    specs = [
        SamplingSpec(
            base.temperature,
            base.top_p,
            base.top_k,
            generator=torch.Generator().manual_seed(i),
            min_p=base.min_p,
        )
        for i in range(n)
    ]
    tokens = torch.tensor(sample(logits, specs).tokens)
    expected = _reference_probs(logits[0], base)
    assert bool((expected[tokens] > 0).all()), "a token outside the kept set was drawn"
    observed = torch.bincount(tokens, minlength=VOCAB).double() / n
    total_variation = 0.5 * (observed - expected).abs().sum().item()
    assert total_variation < 0.08


def _mixed_specs(seed: int) -> list[SamplingSpec]:
    out = []
    for i, base in enumerate([*SPECS.values(), SamplingSpec(temperature=0.0)]):
        out.append(
            SamplingSpec(
                base.temperature,
                base.top_p,
                base.top_k,
                generator=torch.Generator().manual_seed(seed + i),
                min_p=base.min_p,
                presence_penalty=0.5 if i % 2 else 0.0,
                frequency_penalty=0.3 if i % 3 == 0 else 0.0,
                repetition_penalty=1.3 if i % 2 == 0 else 1.0,
                logit_bias=((3, 5.0), (11, -2.0)) if i % 3 == 1 else (),
                token_ids=[1, 2, 3, 3, 9, 9, 9, 50 + i],
                num_prompt_tokens=3,
            )
        )
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_tokens_do_not_depend_on_the_batch(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(5):
            logits = _logits(7, seed, scale=2.0)
            batched = [sample(logits, _mixed_specs(seed)).tokens for _ in range(1)][0]
            alone = [sample(logits[i : i + 1], [_mixed_specs(seed)[i]]).tokens[0] for i in range(7)]
            assert batched == alone
            reordered = sample(logits.flip(0), _mixed_specs(seed)[::-1]).tokens
            assert reordered[::-1] == batched
    finally:
        torch.set_num_threads(before)


def test_same_generator_state_same_tokens_over_many_steps() -> None:
    def run() -> list[int]:
        g = torch.Generator().manual_seed(42)
        return [
            sample(_logits(1, step), [SamplingSpec(1.0, top_p=0.9, generator=g)]).tokens[0]
            for step in range(30)
        ]

    assert run() == run()
    assert len(set(run())) > 5


def test_top_k_one_is_greedy() -> None:
    logits = _logits(4)
    specs = [SamplingSpec(1.5, top_k=1, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    assert sample(logits, specs).tokens == logits.argmax(-1).tolist()


def test_penalties_match_a_dense_reference() -> None:
    logits = _logits(2)
    ids = [4, 4, 4, 8, 15, 15, 16]  # prompt 4, 4, 4; output 8, 15, 15, 16
    spec = SamplingSpec(
        presence_penalty=0.4,
        frequency_penalty=0.25,
        repetition_penalty=1.5,
        token_ids=ids,
        num_prompt_tokens=3,
    )
    got = adjust_logits(logits, [SamplingSpec(temperature=0.0), spec])
    assert torch.equal(got[0], logits[0])  # the row without penalties is untouched
    want = logits[1].clone()
    for t in set(ids):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    counts = torch.bincount(torch.tensor(ids[3:]), minlength=VOCAB).float()
    want = want - 0.25 * counts - 0.4 * (counts > 0).float()
    torch.testing.assert_close(got[1], want)
    assert not torch.equal(logits[1], got[1])  # and the caller's logits are left alone


def test_logit_bias_and_banned_tokens() -> None:
    logits = _logits(3)
    best = int(logits[0].argmax())
    specs = [
        SamplingSpec(temperature=0.0, logit_bias=((best, -100.0),)),
        SamplingSpec(temperature=0.0, logit_bias=((5, 100.0),)),
        SamplingSpec(
            1.0, generator=torch.Generator().manual_seed(0), banned_token_ids=[int(logits[2].argmax())]
        ),
    ]
    tokens = sample(logits, specs).tokens
    assert tokens[0] != best
    assert tokens[1] == 5
    banned_spec = specs[2]
    for seed in range(200):
        banned_spec.generator = torch.Generator().manual_seed(seed)
        assert sample(logits[2:], [banned_spec]).tokens[0] not in banned_spec.banned_token_ids


def test_the_sort_fallback_draws_from_the_same_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from tailserve.model import sampler

    monkeypatch.setattr(sampler, "_MAX_REJECTIONS", 0)  # every nucleus row takes the exact sort
    base = SPECS["min_p"]
    logits = _logits(1).expand(500, VOCAB).contiguous()
    specs = [SamplingSpec(1.2, min_p=0.1, generator=torch.Generator().manual_seed(i)) for i in range(500)]
    tokens = torch.tensor(sample(logits, specs).tokens)
    assert bool((_reference_probs(logits[0], base)[tokens] > 0).all())


def test_logprobs_come_from_the_logits_before_any_adjustment() -> None:
    logits = _logits(3)
    raw = torch.log_softmax(logits, dim=-1)
    specs = [
        SamplingSpec(temperature=0.0, logprobs=3, repetition_penalty=2.0, token_ids=[1, 2, 3]),
        SamplingSpec(
            0.5, top_k=4, generator=torch.Generator().manual_seed(1), logprobs=0, logit_bias=((9, 50.0),)
        ),
        SamplingSpec(temperature=0.0),
    ]
    tokens, (first, second, third) = sample(logits, specs)
    assert first is not None and second is not None and third is None
    assert first[0] == pytest.approx(float(raw[0, tokens[0]]), abs=1e-6)
    assert [t for t, _ in first[1]] == raw[0].topk(3).indices.tolist()
    assert second[0] == pytest.approx(float(raw[1, tokens[1]]), abs=1e-6) and second[1] == []


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_grammar_bitmasks_ban_exactly_the_unset_tokens(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel (CPU) and the torch unpack ban the same tokens: unset bits and ids past the mask."""
    from tailserve.kernels import cpu as cpu_kernels

    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, kernels)
    cpu_kernels.load.cache_clear()
    try:
        if kernels == "1" and cpu_kernels.load() is None:
            pytest.skip("no C compiler: the kernels cannot be built here")
        g = torch.Generator().manual_seed(7)
        vocab, words_per_row = 300, 9  # the masks cover 288 ids: 288..299 are banned everywhere
        logits = torch.randn(5, vocab, generator=g)
        masks = torch.randint(-(2**31), 2**31 - 1, (5, words_per_row), dtype=torch.int32, generator=g)
        masks[1, 2:5] = -1  # whole words allowed
        masks[3, :4] = 0  # whole words banned
        specs = [
            SamplingSpec(token_bitmask=masks[i]) if i in (1, 3, 4) else SamplingSpec(temperature=0.0)
            for i in range(5)
        ]
        out = adjust_logits(logits, specs)
        for i in range(5):
            bits = [(int(masks[i, t // 32]) >> (t % 32)) & 1 if t < 288 else 0 for t in range(vocab)]
            want = (
                logits[i].clone()
                if specs[i].token_bitmask is None
                else logits[i].masked_fill(torch.tensor(bits) == 0, float("-inf"))
            )
            assert torch.equal(out[i], want), i
    finally:
        cpu_kernels.load.cache_clear()
