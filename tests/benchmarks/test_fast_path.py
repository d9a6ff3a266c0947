"""benchmarks/compare/fast_path.py (`compare_engines.py fast-path`): a bench result read into the
figures the targets need, each target's ratio and verdict from known figures, the markdown table,
and the subcommand's dispatch. No server is started.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from compare import cli, fast_path  # noqa: E402
from compare.fast_path import ServerResult, Workload  # noqa: E402


def bench_result(ttft_mean_s: float, tpot_mean_s: float, tok_s: float) -> dict[str, Any]:
    return {
        "counts": {"ok": 4, "failed": 0},
        "errors": {"by_kind": {}},
        "metrics": {"ttft_s": {"mean": ttft_mean_s}, "tpot_s": {"mean": tpot_mean_s}},
        "throughput": {"output_tokens_per_s": tok_s},
    }


def server(key: str, tpot1: float, tok16: float, prefill_ttft: float | None = None) -> ServerResult:
    runs = {
        "one_stream": {"tpot_mean_s": tpot1},
        "streams_16": {"output_tokens_per_s": tok16, "requests_failed": 0},
    }
    if prefill_ttft is not None:
        runs["prefill_1600"] = {"ttft_mean_s": prefill_ttft, "prefill_tokens_per_s": 1600 / prefill_ttft}
    return ServerResult(key, key, "cmd", {}, "notes", cold_start_s=[4.0, 6.0, 4.5], runs=runs)


def test_a_bench_result_gives_prefill_speed_from_the_mean_ttft() -> None:
    work = Workload("prefill_1600", 1, 2, 1600, 1)
    got = fast_path.summarize_run(bench_result(0.8, 0.0, 1.2), work)
    assert got["prefill_tokens_per_s"] == pytest.approx(2000.0)
    assert got["requests_ok"] == 4 and got["ttft_mean_s"] == 0.8
    assert fast_path.summarize_run(None, work) == {"error": "no result file"}


def test_targets_are_ratios_to_the_peer_measured_in_the_same_run() -> None:
    by_key = {
        "tailserve": server("tailserve", tpot1=0.010, tok16=700.0, prefill_ttft=0.8),
        "vllm": server("vllm", tpot1=0.030, tok16=400.0),
        "llamacpp": server("llamacpp", tpot1=0.011, tok16=130.0, prefill_ttft=8.0),
    }
    got = {(t.name, t.reference_label): t for t in fast_path.targets(by_key)}
    vs_vllm = got[("one-stream TPOT", "vLLM")]
    assert vs_vllm.ratio == pytest.approx(1 / 3) and vs_vllm.verdict == "MET"  # <= 0.6x
    vs_llama = got[("one-stream TPOT", "llama.cpp")]
    assert vs_llama.ratio == pytest.approx(10 / 11) and vs_llama.verdict == "MISSED"  # > 0.8x
    assert got[("16-stream output tok/s", "vLLM")].verdict == "MET"  # 1.75x >= 1.2x
    assert got[("prefill tok/s, 1600 tokens", "llama.cpp")].ratio == pytest.approx(10.0)
    assert got[("TPOT at 4k context", "tailserve at 64 tokens")].verdict == "not measured"
    cold = got[("cold start s (process start -> first answer)", "")]
    assert cold.ratio == 4.5 and cold.verdict == "MET"  # the median of three starts, <= 5 s


def test_the_markdown_table_shows_a_dash_for_what_a_server_did_not_measure() -> None:
    ours, peer = server("tailserve", 0.0098, 722.0, 0.759), server("vllm", 0.0314, 383.0)
    doc = {
        "date": "2026-12-04",
        "machine": "box",
        "threads": 1,
        "command": "benchmarks/compare_engines.py fast-path",
        "load_start": [0.1],
        "load_end": [0.2],
        "servers": [vars(ours), vars(peer)],
    }
    text = fast_path.markdown(doc)
    assert "| one stream: TPOT ms | 9.8 | 31.4 |" in text
    assert "| 1600-token prompt: TTFT ms | 759.0 | - |" in text
    assert "| cold start s (median) | 4.50 | 4.50 |" in text


def test_fast_path_is_a_subcommand_of_compare_engines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="unknown peers: bogus"):
        cli.main(["fast-path", "--peers", "bogus"])
    with pytest.raises(SystemExit) as done:
        cli.main(["fast-path", "--help"])
    assert done.value.code == 0
    assert "compare_engines.py fast-path" in capsys.readouterr().out
