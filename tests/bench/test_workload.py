"""Workloads: length distributions, exact prompt cutting, shared prefixes, presets and traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tailserve.bench.corpus import PromptSource, load_corpus
from tailserve.bench.errors import BenchConfigError, TraceFileError
from tailserve.bench.lengths import parse_length_dist
from tailserve.bench.tokenizers import ApproxTokenizer, ByteTokenizer, HFTokenizer
from tailserve.bench.trace import load_trace
from tailserve.bench.workload import PRESETS, WorkloadGenerator, WorkloadSpec


@pytest.mark.parametrize(
    ("spec", "mean", "rel"),
    [
        ("fixed:128", 128, 0.0),
        ("uniform:32,128", 80, 0.02),
        ("normal:500,50", 500, 0.02),
        ("lognormal:200,0.5", 200 * np.exp(0.125), 0.03),
        ("longtail:500,8000,0.05", 0.95 * 500 * np.exp(0.045) + 0.05 * 8000, 0.04),
    ],
)
def test_length_distributions_have_their_means(spec: str, mean: float, rel: float) -> None:
    dist = parse_length_dist(spec)
    values = dist.sample(np.random.default_rng(0), 20000)
    assert min(values) >= 1
    assert np.mean(values) == pytest.approx(mean, rel=rel, abs=0.5)
    assert dist.mean() == pytest.approx(mean, rel=0.01)


def test_long_tail_puts_the_fraction_at_the_long_length() -> None:
    values = np.asarray(
        parse_length_dist("longtail:200,1500,0.05,0.5").sample(np.random.default_rng(1), 20000)
    )
    assert ((values > 1200) & (values < 1800)).mean() == pytest.approx(0.05, abs=0.006)
    assert np.median(values) == pytest.approx(200 * 1.03, rel=0.08)


@pytest.mark.parametrize(
    "spec", ["gauss:1,2", "uniform:5", "uniform:9,3", "fixed:x", "longtail:1,2,1.5", "abc"]
)
def test_bad_length_specs_are_refused(spec: str) -> None:
    with pytest.raises(BenchConfigError):
        parse_length_dist(spec)


def test_corpus_is_a_few_hundred_kb_of_prose() -> None:
    text = load_corpus()
    assert 200_000 < len(text) < 2_000_000
    assert "Alice" in text and text.isascii()


def test_byte_tokenizer_cuts_exact_lengths() -> None:
    source = PromptSource(ByteTokenizer())
    rng = np.random.default_rng(0)
    for n in (1, 7, 200, 1500, 300_000):  # the last wraps around the corpus
        assert len(source.cut(n, rng).encode()) == n


def test_hf_tokenizer_cuts_exact_lengths(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.train_from_iterator(
        [load_corpus()[:100_000]], trainers.BpeTrainer(vocab_size=600, special_tokens=["[UNK]"])
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = HFTokenizer(str(tmp_path))
    source = PromptSource(hf)
    rng = np.random.default_rng(0)
    for n in (5, 64, 512, 2048):
        assert hf.count(source.cut(n, rng)) == n


def test_approx_tokenizer_is_four_characters_a_token() -> None:
    source = PromptSource(ApproxTokenizer())
    prompt = source.cut(100, np.random.default_rng(0))
    assert len(prompt) == 400


def test_shared_prefix_goes_to_the_given_fraction() -> None:
    spec = WorkloadSpec(
        input_len=parse_length_dist("fixed:300"),
        output_len=parse_length_dist("fixed:10"),
        shared_prefix_tokens=100,
        shared_prefix_fraction=0.5,
        turns=2,
    )
    gen = WorkloadGenerator(spec, PromptSource(ByteTokenizer()), np.random.default_rng(0))
    convs = [gen.conversation(float(i)) for i in range(400)]
    with_prefix = [c for c in convs if c.turns[0].system_prefix]
    assert len(with_prefix) / len(convs) == pytest.approx(0.5, abs=0.07)
    prefixes = {t.system_prefix for c in with_prefix for t in c.turns}
    assert len(prefixes) == 1 and len(next(iter(prefixes)) or "") == 100
    turn = with_prefix[0].turns[0]
    assert turn.input_tokens == 300 and len(turn.prompt) == 200  # the prefix is part of the length
    assert [t.index for c in convs[:2] for t in c.turns] == [0, 1, 2, 3]


def test_presets_match_the_field_table() -> None:
    chat = PRESETS["chat"]
    assert chat.input_len == "uniform:512,2048" and chat.output_len == "uniform:256,1024"
    assert 50 <= chat.arrival.concurrency <= 200
    assert (
        PRESETS["code"].input_len == "uniform:1024,4096" and 10 <= PRESETS["code"].arrival.concurrency <= 50
    )
    assert (
        PRESETS["summarize"].input_len == "uniform:4096,8192"
        and PRESETS["summarize"].output_len == "uniform:256,512"
    )
    scaled = PRESETS["chat-scaled"]  # chat's prompts, shorter answers, open-loop arrivals
    assert scaled.input_len == chat.input_len and scaled.output_len == "uniform:64,256"
    assert scaled.arrival.kind == "poisson"
    cpu = PRESETS["cpu-chat"]
    assert cpu.arrival.kind == "poisson" and cpu.input_len.startswith("longtail:200,1500,0.05")
    # Offered decode load stays near what 2 cores sustain for a 135M model (about 20-30 tok/s).
    assert cpu.arrival.rate_per_s * parse_length_dist(cpu.output_len).mean() <= 25


def test_trace_replay_offsets_and_speed(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 100.0, "input_tokens": 20, "output_tokens": 5},
        {"timestamp": 104.0, "prompt": "Hello there", "output_tokens": 3},
        {"t": 102.0, "input_len": 7, "max_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n# comment\n")
    entries = load_trace(str(path), speed=2.0)
    assert [e.offset_s for e in entries] == [0.0, 1.0, 2.0]
    assert [e.output_tokens for e in entries] == [5, 2, 3]
    assert entries[2].prompt == "Hello there" and entries[0].input_tokens == 20


def test_trace_bad_lines_are_reported_with_numbers(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_tokens": 5, "output_tokens": 5}\n'
        "not json\n"
        '{"timestamp": 1, "output_tokens": 5}\n'
        '{"timestamp": "x", "input_tokens": 5, "output_tokens": 5}\n'
    )
    with pytest.raises(TraceFileError) as info:
        load_trace(str(path))
    message = str(info.value)
    assert "line 2" in message and "line 3" in message and "line 4" in message and "line 1:" not in message
    with pytest.raises(TraceFileError):
        load_trace(str(tmp_path / "missing.jsonl"))


def test_every_preset_can_be_asked_for_by_name() -> None:
    """The CLI names its presets without importing the workload module: the two lists are one."""
    from tailserve.bench import cli

    assert set(cli._PRESETS) == set(PRESETS)
