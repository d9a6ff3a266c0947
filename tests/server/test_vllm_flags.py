"""vLLM's `vllm serve` command line on `tailserve serve`: every vLLM flag in the table is the same,
mapped, accepted with no effect (logged) or refused (exit 2 naming it); docs/SERVER.md shows the same
table; and KServe's LLMInferenceServiceConfig arguments, TLS included, serve the default model over
HTTPS to the official openai client."""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tailserve.cli import build_parser, main
from tailserve.errors import ConfigError
from tailserve.server import vllm_flags
from tailserve.server.cli import configs_from_args, generation_defaults, read_chat_template
from tailserve.weights.loader import LoadedModel, default_model_path
from tailserve.weights.tokenizer import Tokenizer
from tests.server.harness import REPO, free_port, tailserve_command

SERVER_MD = REPO / "docs" / "SERVER.md"


def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def _names(flag: vllm_flags.VllmFlag) -> list[str]:
    return [name for name in flag.flag.split(" / ") if name.startswith("--")]


def test_docs_show_the_table_the_code_holds() -> None:
    text = SERVER_MD.read_text()
    begin, end = "<!-- vllm-flags:begin -->\n", "\n<!-- vllm-flags:end -->"
    shown = text[text.index(begin) + len(begin) : text.index(end)]
    assert shown == vllm_flags.markdown_table()


def test_every_flag_in_the_table_parses() -> None:
    serve_options = set(build_parser()._subparsers._group_actions[0].choices["serve"]._option_string_actions)  # type: ignore[union-attr]
    for flag in vllm_flags.FLAGS:
        for name in _names(flag):
            assert name in serve_options, name
    assert len({f.flag for f in vllm_flags.FLAGS}) == len(vllm_flags.FLAGS)


@pytest.mark.parametrize("flag", [f for f in vllm_flags.FLAGS if f.kind == "no effect"], ids=lambda f: f.flag)
def test_a_flag_with_no_effect_is_accepted_and_named_in_the_log(flag: vllm_flags.VllmFlag) -> None:
    value = sorted(flag.ok_values)[0] if flag.ok_values else "7"
    args = _args(flag.flag, value) if flag.takes_value else _args(flag.flag)
    configs_from_args(args)
    (note,) = vllm_flags.check(args)
    assert note.startswith(flag.flag) and "no effect" in note


@pytest.mark.parametrize("flag", [f for f in vllm_flags.FLAGS if f.kind == "refused"], ids=lambda f: f.flag)
def test_a_refused_flag_exits_2_naming_it(
    flag: vllm_flags.VllmFlag, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", "dummy:tiny", flag.flag, *(["x"] if flag.takes_value else [])]
    assert main(argv) == 2
    assert f"{flag.flag} (vLLM's) is refused" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--pipeline-parallel-size", "2"],
        ["--tool-call-parser", "mistral"],
        ["--dtype", "half"],
        ["--scheduling-policy", "priority"],
        ["--no-enable-chunked-prefill"],
        ["--data-parallel-size", "2"],
    ],
)
def test_a_value_tailserve_cannot_honour_exits_2_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", "dummy:tiny", *argv]) == 2
    assert argv[0] in capsys.readouterr().err


def test_an_unknown_flag_is_an_error_not_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "/mnt/models", "--no-such-vllm-flag"])
    assert exit_info.value.code == 2
    assert "--no-such-vllm-flag" in capsys.readouterr().err


def test_mapped_flags_reach_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, server = configs_from_args(_args("dummy:tiny"))
    assert engine.model.model == "dummy:tiny" and engine.cache.enable_prefix_caching
    assert server.openapi and server.access_log and server.tls is None
    engine, server = configs_from_args(
        _args(
            "dummy:tiny",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes",
            "1048576",
            "--scheduling-policy",
            "fcfs",
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
        )
    )
    assert not engine.cache.enable_prefix_caching
    assert engine.cache.kv_cache_memory_bytes == 2**20 and engine.scheduler.policy == "fcfs"
    assert not server.openapi and not server.access_log
    assert configs_from_args(_args("--enable-prefix-caching"))[0].cache.enable_prefix_caching
    with pytest.raises(ConfigError, match="two models"):
        configs_from_args(_args("dummy:tiny", "--model", "default"))
    monkeypatch.delenv("TAILSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-vllm-env")
    assert configs_from_args(_args())[1].api_key == "sk-from-vllm-env"


@pytest.mark.parametrize(
    ("dtype", "weight_format", "served"),
    [
        ("auto", "auto", "auto"),
        ("float32", "auto", "fp32"),
        ("float", "auto", "fp32"),
        ("bfloat16", "auto", "bf16"),
        ("bfloat16", "int4", "int4"),  # bf16 activations over int4 weights, as vLLM with a quantization
        ("bfloat16", "int8", "int8"),
    ],
)
def test_dtype_is_vllms_compute_dtype(dtype: str, weight_format: str, served: str) -> None:
    engine, _ = configs_from_args(_args("--dtype", dtype, "--weight-format", weight_format))
    assert engine.model.weight_format == served


@pytest.mark.parametrize(("dtype", "weight_format"), [("float32", "int4"), ("bfloat16", "fp32")])
def test_a_dtype_that_contradicts_the_weight_format_is_refused(dtype: str, weight_format: str) -> None:
    with pytest.raises(ConfigError, match="--dtype"):
        configs_from_args(_args("--dtype", dtype, "--weight-format", weight_format))


def test_chat_template_and_generation_config(tmp_path: Path) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template
    assert read_chat_template(template) == template
    with pytest.raises(ConfigError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    assert generation_defaults("vllm", "default").describe() == "none"
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_p": 0.8}')
    assert generation_defaults(str(tmp_path), "default").describe() == "temperature=0.3 top_p=0.8"
    with pytest.raises(ConfigError, match="--generation-config"):
        generation_defaults(str(tmp_path / "nowhere"), "default")


def test_a_chat_template_replaces_the_models(smol: LoadedModel) -> None:
    """What --chat-template does to the served model's tokenizer (a copy of the session's: shallow,
    since a tokenizer that has rendered a chat holds a compiled jinja template, which deepcopy cannot
    copy; setting the template rebinds the copy's own attribute)."""
    tokenizer = Tokenizer(copy.copy(smol.tokenizer.hf), smol.tokenizer.eos_token_ids)
    messages = [{"role": "user", "content": "hi"}]
    assert "<user>hi<assistant>" not in tokenizer.decode(tokenizer.apply_chat_template(messages))
    tokenizer.set_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    assert tokenizer.decode(tokenizer.apply_chat_template(messages)) == "<user>hi<assistant>"
    assert "<user>hi<assistant>" not in smol.tokenizer.decode(smol.tokenizer.apply_chat_template(messages))


def test_tls_flags_are_checked_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--ssl-certfile"):
        configs_from_args(_args("--ssl-certfile", str(tmp_path / "missing.pem")))
    with pytest.raises(ConfigError, match="need --ssl-certfile"):
        configs_from_args(_args("--enable-ssl-refresh"))


# --- KServe's template, end to end -------------------------------------------------------------

OPENSSL = shutil.which("openssl")


def _self_signed(cert: Path, key: Path, name: str) -> None:
    subprocess.run(
        [OPENSSL or "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _tls_context(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@contextmanager
def _https_server(
    argv: list[str], port: int, cert: Path, log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(verify=_tls_context(cert), timeout=2.0) as client:
            while True:
                assert proc.poll() is None, log_path.read_text(errors="replace")
                try:
                    if client.get(f"https://127.0.0.1:{port}/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")
                time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command to make a certificate")
def test_kserve_template_arguments_serve_the_default_model_over_https(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _self_signed(cert, key, "first")
    port = free_port()
    # KServe's LLMInferenceServiceConfig (kserve-config-llm-template): `vllm serve` + the model path +
    # these arguments, verbatim; then only what keeps the test cheap (fp32 skips the quality gate).
    kserve = [str(default_model_path()), "--served-model-name", "my-llm", "--port", str(port)]
    kserve += ["--disable-log-requests", "--enable-ssl-refresh"]
    kserve += ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    cheap = [
        "--weight-format",
        "fp32",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "64MiB",
        "--slo-ttft",
        "60",
    ]
    log_path = tmp_path / "server.log"
    with _https_server(tailserve_command("serve", *kserve, *cheap), port, cert, log_path):
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key="unused",
            http_client=httpx.Client(verify=_tls_context(cert)),
        )
        assert [m.id for m in client.models.list()] == ["my-llm"]
        chat = client.chat.completions.create(
            model="my-llm", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content and chat.usage is not None
        assert chat.usage.completion_tokens > 0
        with pytest.raises(openai.APIConnectionError):  # plain HTTP on the TLS port gets no answer
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0).models.list()
        # --enable-ssl-refresh: a rotated certificate is served to new connections without a restart.
        _self_signed(tmp_path / "new.crt", tmp_path / "new.key", "second")
        os.replace(tmp_path / "new.key", key)
        os.replace(tmp_path / "new.crt", cert)
        deadline = time.monotonic() + 60
        expected = cert.read_text()
        while ssl.get_server_certificate(("127.0.0.1", port)).strip() != expected.strip():
            assert time.monotonic() < deadline, "the rotated certificate was never served"
            time.sleep(0.2)
        fresh = openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key="unused",
            http_client=httpx.Client(verify=_tls_context(cert)),
        )
        assert [m.id for m in fresh.models.list()] == ["my-llm"]
    log = log_path.read_text(errors="replace")
    assert "--disable-log-requests (vLLM's) has no effect" in log
