"""Who needs the API key, as a client meets it: real `tailserve serve` and `tailserve route` processes
with --api-key on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.bad_inputs import TINY
from tests.server.harness import ServerProcess, free_port, running_process, serve_process, tailserve_command

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A dummy:tiny server and a router in front of it, both with --api-key."""
    with serve_process(["--model", "dummy:tiny", "--api-key", KEY, "--no-warmup"]) as server:
        port = free_port()
        cmd = tailserve_command("route", "--replica", server.base, "--port", str(port), "--api-key", KEY)
        cmd += ["--health-interval", "0.2", "--log-level", "warning"]
        with running_process(cmd, port, ready_timeout_s=60) as router:
            yield server, router


def test_tokenize_and_detokenize_need_the_key_on_server_and_router(
    keyed: tuple[ServerProcess, ServerProcess],
) -> None:
    server, router = keyed
    calls = [
        ("/tokenize", {"model": TINY, "prompt": "hi!"}),
        ("/detokenize", {"model": TINY, "tokens": [107]}),
    ]
    for base in (server.base, router.base):
        for path, body in calls:
            refused = httpx.post(f"{base}{path}", json=body)
            assert refused.status_code == 401, (base, path, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
            assert httpx.get(f"{base}{path}").status_code == 200, (base, path)
    for path, body in calls:  # the router forwards what the server serves, answer for answer
        direct = httpx.post(f"{server.base}{path}", json=body, headers=AUTH)
        routed = httpx.post(f"{router.base}{path}", json=body, headers=AUTH)
        assert direct.status_code == routed.status_code == 200, (path, routed.text)
        assert routed.json() == direct.json()
