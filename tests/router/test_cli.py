"""`tailserve route` flags become a RouterConfig; bad flags exit 2 with a message."""

from __future__ import annotations

import pytest

from tailserve.cli import build_parser, main
from tailserve.router.cli import config_from_args


def test_route_flags_to_config() -> None:
    args = build_parser().parse_args(
        [
            "route",
            "--replica",
            "http://a:1",
            "--replica",
            "http://b:2/",
            "--policy",
            "least_load",
            "--port",
            "9",
        ]
    )
    config = config_from_args(args, args.replica)
    assert config.replicas == ("http://a:1", "http://b:2")
    assert (config.policy, config.port, config.host) == ("least_load", 9, "127.0.0.1")
    assert build_parser().parse_args(["route", "--replica", "http://a"]).policy == "prefix"


def test_route_rejects_bad_replica_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--replica", "localhost:8000"]) == 2
    assert "http(s) URL" in capsys.readouterr().out
