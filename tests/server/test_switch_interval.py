"""`tailserve serve --switch-interval-ms`: the server process's GIL switch interval (docs/ENGINE.md,
"The GIL between the HTTP and engine threads"); a bad value is refused before anything loads."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tailserve.cli import build_parser
from tailserve.errors import ConfigError
from tailserve.server import lifecycle
from tailserve.server.cli import configs_from_args
from tailserve.server.config import ServerConfig


def test_the_flag_reaches_the_config_and_bad_values_name_it() -> None:
    _, server = configs_from_args(build_parser().parse_args(["serve"]))
    assert server.switch_interval_s == 0.005  # Python's own
    _, server = configs_from_args(build_parser().parse_args(["serve", "--switch-interval-ms", "2"]))
    assert server.switch_interval_s == 0.002
    for bad in ("0", "-1", "1000"):
        with pytest.raises(ConfigError, match="--switch-interval-ms"):
            configs_from_args(build_parser().parse_args(["serve", "--switch-interval-ms", bad]))


def test_the_command_exits_2_on_a_bad_interval_before_loading_anything() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tailserve.cli", "serve", "--switch-interval-ms", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--switch-interval-ms must be in [0.001, 100], got 0" in done.stderr


def test_run_server_sets_the_interval_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []

    def fake_serve(app: Any, drain: Any, **kwargs: Any) -> int:
        seen.append(sys.getswitchinterval())
        return 0

    class State:
        class tailserve:  # noqa: N801 - the attribute path run_server reads
            class admission:  # noqa: N801
                drain = None

    class App:
        state = State

    monkeypatch.setattr(lifecycle, "serve_until_drained", fake_serve)
    before = sys.getswitchinterval()
    try:
        assert lifecycle.run_server(App(), ServerConfig(switch_interval_s=0.0003)) == 0  # type: ignore[arg-type]
    finally:
        sys.setswitchinterval(before)
    assert seen and abs(seen[0] - 0.0003) < 1e-9
