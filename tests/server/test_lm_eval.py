"""A third-party client nobody here wrote: lm-eval's `local-completions` model runs a loglikelihood
(multiple-choice) task that the test writes, against a real server. Its accuracy, and every
choice's loglikelihood, equal the same task scored in-process with teacher-forced logits."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tailserve.weights.loader import LoadedModel
from tests.server.reference import continuation_logprobs, fp32_llm

pytest.importorskip("lm_eval")

CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Norway", "Oslo"), ("Kenya", "Nairobi"),
]  # fmt: skip

RUN_LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

base_url, model, tokenizer, tasks = sys.argv[1:5]
args = f"model={model},base_url={base_url},tokenizer_backend=huggingface,tokenizer={tokenizer},batch_size=32,max_retries=1"
res = lm_eval.simple_evaluate(
    model="local-completions", model_args=args, tasks=["ts_mc"], task_manager=TaskManager(include_path=tasks, include_defaults=False),
    log_samples=True,
)
samples = [(s["doc_id"], [r[0][0] for r in s["resps"]]) for s in res["samples"]["ts_mc"]]
print("RESULT " + json.dumps({"acc": res["results"]["ts_mc"]["acc,none"], "samples": samples}))
"""


def _dataset() -> list[dict[str, object]]:
    """Capitals (mostly easy for the model) and products of two digits (mostly not): an accuracy
    strictly between 0 and 1, so equal accuracies mean something."""
    rng = random.Random(14)
    docs: list[dict[str, object]] = []
    for country, capital in CAPITALS:
        choices = [*rng.sample([c for _, c in CAPITALS if c != capital], 3), capital]
        rng.shuffle(choices)
        docs.append(
            {"question": f"The capital of {country} is", "choices": choices, "answer": choices.index(capital)}
        )
    for _ in range(len(CAPITALS)):
        a, b = rng.randint(3, 9), rng.randint(3, 9)
        wrong = rng.sample([x for x in range(9, 82) if x != a * b], 3)
        choices = [str(x) for x in [*wrong, a * b]]
        rng.shuffle(choices)
        docs.append(
            {"question": f"{a} times {b} equals", "choices": choices, "answer": choices.index(str(a * b))}
        )
    return docs


def _write_task(root: Path, docs: list[dict[str, object]]) -> None:
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "ts_mc.yaml").write_text(
        "task: ts_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )


def _encode_pair(encode: object, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens (trailing spaces move over)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)  # type: ignore[operator]
    return ctx, whole[len(ctx) :]


def test_lm_eval_local_completions_accuracy_equals_teacher_forced_scoring(
    smol_fp32: str, smol: LoadedModel, tmp_path: Path
) -> None:
    docs = _dataset()
    _write_task(tmp_path, docs)
    tok_dir = tmp_path / "tokenizer"  # the server's own tokenizer, as a local Hugging Face directory
    tok_dir.mkdir()
    smol.tokenizer.hf.backend.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    model = openai.OpenAI(base_url=f"{smol_fp32}/v1", api_key="unused").models.list().data[0].id
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env = {
        **os.environ,
        **offline,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(tmp_path / "ds"),
    }
    cmd = [
        sys.executable,
        "-c",
        RUN_LM_EVAL,
        f"{smol_fp32}/v1/completions",
        model,
        str(tok_dir),
        str(tmp_path),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT ") :])

    llm = fp32_llm(smol)
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    pairs = [_encode_pair(encode, str(d["question"]), " " + c) for d in docs for c in d["choices"]]  # type: ignore[attr-defined]
    flat = continuation_logprobs(llm, pairs)
    scores, k = {}, 0
    for i, doc in enumerate(docs):
        m = len(doc["choices"])  # type: ignore[arg-type]
        scores[i], k = flat[k : k + m], k + m
    correct = [max(range(len(s)), key=s.__getitem__) == docs[i]["answer"] for i, s in scores.items()]
    ours = sum(correct) / len(docs)
    assert 0 < ours < 1
    assert got["acc"] == pytest.approx(ours, abs=1e-9)
    assert len(got["samples"]) == len(docs)
    for doc_id, loglikelihoods in got["samples"]:
        assert loglikelihoods == pytest.approx(scores[doc_id], abs=1e-3)
