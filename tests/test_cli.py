"""`tailserve COMMAND --help` shows each option's default, with the value a run really gets (read
here from the config objects and the parsers, never restated)."""

from __future__ import annotations

import argparse

import pytest

from tailserve.cli import build_parser
from tailserve.config import CacheConfig, SchedulerConfig
from tailserve.plan.capacity import TPOT_SLO_S
from tailserve.router.config import RouterConfig
from tailserve.server.config import ServerConfig

COMMANDS = ("serve", "generate", "bench", "route", "plan", "doctor", "eval")


def _help(command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _option_blocks(text: str) -> dict[str, str]:
    """--flag -> its help, whitespace collapsed (an option's block runs until the next option)."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -") and not line.startswith("   "):
            current = stripped.split()[0].rstrip(",")
            blocks[current] = ""
        elif not line.startswith(" "):
            current = None  # a group heading or blank line
        if current is not None:
            blocks[current] = " ".join(f"{blocks[current]} {stripped}".split())
    return blocks


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = subs.choices[command]
    assert isinstance(sub, argparse.ArgumentParser)
    return sub


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_with_a_default_shows_it(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = _option_blocks(_help(command, capsys, monkeypatch))
    for action in _subparser(command)._actions:
        meaningful = action.default not in (None, False, True, argparse.SUPPRESS)
        if not action.option_strings or not meaningful or action.help is argparse.SUPPRESS:
            continue
        block = blocks[action.option_strings[0]]
        if "(env " in block:
            continue  # a default from the environment may be a secret: not printed
        # Either the formatter's "(default: VALUE)" or the help's own words about it.
        assert "default" in block, f"{command} {action.option_strings[0]}: {block!r}"


def test_serve_shows_the_step_budget_and_targets(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = _option_blocks(_help("serve", capsys, monkeypatch))
    sched, cache, server = SchedulerConfig(), CacheConfig(), ServerConfig()
    expected = {
        "--max-num-batched-tokens": sched.max_num_batched_tokens,
        "--slo-tpot": sched.slo_tpot_s,
        "--slo-ttft": sched.slo_ttft_s,
        "--max-num-seqs": sched.max_num_seqs,
        "--max-waiting": sched.max_waiting,
        "--gpu-memory-utilization": cache.gpu_memory_utilization,
        "--block-size": cache.block_size,
        "--port": server.port,
        "--max-tokens-default": server.max_tokens_default,
        "--drain-timeout": server.drain_timeout_s,
    }
    for flag, value in expected.items():
        assert f"(default: {value})" in blocks[flag], (flag, blocks[flag])


def test_route_and_plan_show_their_config_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    route = _option_blocks(_help("route", capsys, monkeypatch))
    router = RouterConfig(replicas=("http://placeholder",))
    assert f"(default: {router.health_interval_s})" in route["--health-interval"]
    assert f"(default: {router.max_attempts})" in route["--max-attempts"]
    plan = _option_blocks(_help("plan", capsys, monkeypatch))
    assert f"(default: {TPOT_SLO_S * 1e3})" in plan["--tpot-slo-ms"]


def test_a_key_from_the_environment_is_not_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAILSERVE_API_KEY", "sk-secret-in-env")
    monkeypatch.setenv("VLLM_API_KEY", "sk-secret-in-env")
    for command in ("serve", "route"):
        assert "sk-secret-in-env" not in _help(command, capsys, monkeypatch)
