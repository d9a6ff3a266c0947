"""benchmarks/engine_steps.py: the step timers leave the engine empty and time what they say, the
threads table reads medians of per-round medians, the offline count stops at the first EOS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_steps  # noqa: E402


def test_useful_tokens_end_at_the_first_eos() -> None:
    eos = frozenset({2, 7})
    assert engine_steps.useful_tokens([5, 9, 7, 3, 2], eos) == 3
    assert engine_steps.useful_tokens([2, 5], eos) == 1
    assert engine_steps.useful_tokens([5, 9, 4], eos) == 3  # no EOS: every token counts


def test_the_threads_table_gives_medians_of_round_medians_and_their_ratio() -> None:
    rounds = {
        (1, "decode step, 1 stream"): [20.0, 18.0, 30.0],
        (2, "decode step, 1 stream"): [10.0, 12.0, 9.0],
        (1, "prefill step, 512 tokens"): [400.0, 420.0, 410.0],
        (2, "prefill step, 512 tokens"): [200.0, 205.0, 210.0],
    }
    lines = engine_steps.threads_table(rounds, [1, 2])
    assert lines[0] == "| figure | 1 thread(s) ms | 2 thread(s) ms | 1/2 |"
    assert lines[2] == "| decode step, 1 stream | 20.0 (20.0, 18.0, 30.0) | 10.0 (10.0, 12.0, 9.0) | 2.00x |"
    assert lines[3] == (
        "| prefill step, 512 tokens | 410.0 (400.0, 420.0, 410.0) | 205.0 (200.0, 205.0, 210.0) | 2.00x |"
    )


def test_the_commits_table_gives_the_ratio_and_the_base_spread() -> None:
    rounds = {
        ("4845155", "decode step, 1 stream"): [10.0, 12.0, 11.0],
        ("HEAD", "decode step, 1 stream"): [11.0, 11.0, 12.1],
    }
    lines = engine_steps.commits_table(rounds, ["4845155", "HEAD"])
    assert lines[0] == "| figure | 4845155 ms | HEAD ms | HEAD / 4845155 | 4845155 spread (max/min) |"
    assert (
        lines[2]
        == "| decode step, 1 stream | 11.0 (10.0, 12.0, 11.0) | 11.0 (11.0, 11.0, 12.1) | 1.000 | 1.200 |"
    )


def test_the_step_timers_time_the_steps_asked_and_leave_the_engine_empty() -> None:
    engine = engine_steps.engine_for("dummy:tiny", rows=3, step_tokens=64, threads=1)
    decode = engine_steps.decode_steps_ms(engine, rows=3, steps=4, warmup=1)
    assert len(decode) == 4 and all(ms > 0 for ms in decode)
    assert not engine.has_unfinished()
    prefill = engine_steps.prefill_step_ms(engine, tokens=40, repeats=2)
    assert len(prefill) == 2 and all(ms > 0 for ms in prefill)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "argv",
    [
        ["threads", "--rounds", "0"],
        ["threads", "--threads", "1", "0"],
        ["features", "--rows", "0"],
        ["offline", "--batches", "8", "0"],
        ["commits", "--base", "HEAD", "--context", "0"],
    ],
)
def test_counts_below_one_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        engine_steps.parse_args(argv)


def test_a_base_that_is_no_commit_is_refused_before_any_worktree(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_steps.parse_args(["commits", "--base", "no-such-rev-xyz"])
    assert exit_info.value.code == 2
    assert "--base 'no-such-rev-xyz' is not a commit of this repository" in capsys.readouterr().err
