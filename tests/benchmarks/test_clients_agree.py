"""benchmarks/clients_agree.py: one request written the way each client saves it (tailserve bench's
JSONL, vLLM's --save-detailed result, aiperf's profile_export.jsonl, guidellm's JSON) reads back as
the same TTFT / E2E / TPOT; the shared schedule is vLLM's; a guidellm run's real sends become a trace.
No server and no timing: constructed files only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import clients_agree  # noqa: E402

# One request: sent at t=100 s, first token 70 ms later, 32 tokens, the last at 600 ms.
SENT, TTFT, E2E, TOKENS = 100.0, 0.070, 0.600, 32
GAPS = [(E2E - TTFT) / (TOKENS - 1)] * (TOKENS - 1)


def write_tailserve(path: Path) -> None:
    row = {"ok": True, "sent_s": SENT, "ttft_s": TTFT, "e2e_s": E2E, "output_tokens": TOKENS}
    row["tpot_s"] = (E2E - TTFT) / (TOKENS - 1)
    path.with_suffix(".jsonl").write_text(
        json.dumps(row) + "\n" + json.dumps({"ok": False, "sent_s": 101}) + "\n"
    )


def write_vllm(path: Path) -> None:
    doc = {"start_times": [SENT], "ttfts": [TTFT], "itls": [GAPS], "output_lens": [TOKENS]}
    path.with_suffix(".json").write_text(json.dumps(doc))


def write_aiperf(path: Path) -> None:
    metrics = {
        "time_to_first_token": {"value": TTFT * 1e3, "unit": "ms"},
        "request_latency": {"value": E2E * 1e3, "unit": "ms"},
        "output_sequence_length": {"value": TOKENS, "unit": "tokens"},
        "inter_token_latency": {"value": (E2E - TTFT) / (TOKENS - 1) * 1e3, "unit": "ms"},
    }
    record = {"metadata": {"request_start_ns": int(SENT * 1e9)}, "metrics": metrics}
    (path / "run").mkdir(parents=True)
    (path / "run" / "profile_export.jsonl").write_text(json.dumps(record) + "\n")


def guidellm_doc(starts: list[float]) -> dict[str, object]:
    def request(start: float, i: int) -> dict[str, object]:
        body = {"prompt": f"prompt {i}", "max_tokens": TOKENS, "ignore_eos": True}
        return {
            "request_start_time": start,
            "request_latency": E2E,
            "time_to_first_token_ms": TTFT * 1e3,
            "output_tokens": TOKENS,
            "request_args": json.dumps({"body": body}),
        }

    requests = [request(start, i) for i, start in enumerate(starts)]
    return {"benchmarks": [{"requests": {"successful": requests, "errored": [], "incomplete": []}}]}


def write_guidellm(path: Path) -> None:
    path.with_suffix(".json").write_text(json.dumps(guidellm_doc([SENT])))


@pytest.mark.parametrize(
    ("client", "write"),
    [
        ("tailserve", write_tailserve),
        ("vllm", write_vllm),
        ("aiperf", write_aiperf),
        ("guidellm", write_guidellm),
    ],
)
def test_each_clients_saved_request_reads_back_as_the_same_ttft_e2e_and_tpot(
    client: str, write, tmp_path: Path
) -> None:
    path = tmp_path / client
    write(path)
    [request] = clients_agree.READERS[client](path)
    assert request.sent_s == 0.0
    assert request.ttft_s == pytest.approx(TTFT)
    assert request.e2e_s == pytest.approx(E2E)
    assert request.output_tokens == TOKENS
    assert request.tpot_s == pytest.approx((E2E - TTFT) / (TOKENS - 1))


def test_aiperfs_tokens_are_the_servers_count_not_its_own_re_tokenized_one(tmp_path: Path) -> None:
    write_aiperf(tmp_path / "a")
    export = tmp_path / "a" / "run" / "profile_export.jsonl"
    record = json.loads(export.read_text())
    record["metrics"]["output_sequence_length"]["value"] = TOKENS - 1  # the text re-encoded one token short
    record["metrics"]["usage_completion_tokens"] = {"value": TOKENS, "unit": "tokens"}
    export.write_text(json.dumps(record) + "\n")
    [request] = clients_agree.read_aiperf(tmp_path / "a")
    assert request.output_tokens == TOKENS
    assert request.tpot_s == pytest.approx((E2E - TTFT) / (TOKENS - 1))


def test_guidellms_own_tpot_is_e2e_over_all_output_tokens_ttft_included(tmp_path: Path) -> None:
    write_guidellm(tmp_path / "g")
    [request] = clients_agree.read_guidellm(tmp_path / "g")
    assert request.tool_tpot_s == pytest.approx(E2E / TOKENS)
    assert request.tool_tpot_s != pytest.approx(request.tpot_s)


def test_the_shared_schedule_is_vllms_poisson_draw_for_the_seed_starting_at_zero() -> None:
    offsets = clients_agree.vllm_poisson_offsets(200, 2.0, seed=0)
    np.random.seed(0)
    raw = np.cumsum(np.random.gamma(1.0, 0.5, size=200))  # vLLM: gaps cumulated, the last scaled to n / rate
    expected = raw * (100.0 / raw[-1])
    assert offsets == pytest.approx(list(expected - expected[0]))
    assert offsets[0] == 0.0 and all(b > a for a, b in zip(offsets, offsets[1:], strict=False))


def test_a_guidellm_runs_real_sends_become_a_trace_of_its_times_and_prompts(tmp_path: Path) -> None:
    (tmp_path / "g.json").write_text(json.dumps(guidellm_doc([5.25, 5.0, 7.5])))
    trace = clients_agree.trace_from_guidellm(tmp_path, "g", output_len=TOKENS)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["timestamp"] for line in lines] == [5.0, 5.25, 7.5]
    assert [line["prompt"] for line in lines] == ["prompt 1", "prompt 0", "prompt 2"]
    assert {line["output_tokens"] for line in lines} == {TOKENS}
