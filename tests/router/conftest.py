"""Fixtures: fake replicas and routers on loopback, each in its own uvicorn thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tailserve.router.app import create_app
from tailserve.router.config import RouterConfig
from tests.router.fake_replica import FakeBehavior, ThreadedServer, create_fake_app

# Short intervals keep the tests quick; timing assertions derive their bounds from these. The check
# timeout is long next to the interval: a fake answers /ready at once, so only a busy machine (CI's 2
# cores under the suite) makes a check slow, and two slow checks in a row at 0.5 s took a healthy
# replica out mid-test (seen once, 2026-12-07). No test waits on a check timing out: an unready fake
# answers 503 and a stopped one refuses the connection, both at once.
FAST = {
    "health_interval_s": 0.2,
    "health_timeout_s": 2.0,
    "unhealthy_threshold": 2,
    "healthy_threshold": 2,
    "load_interval_s": 0.1,
    "retry_backoff_s": 0.01,
}


@dataclass
class Fake:
    """A running fake replica and the handle that steers it."""

    name: str
    behavior: FakeBehavior
    server: ThreadedServer

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def module_fakes() -> Iterator[list[Fake]]:
    """Three fake replicas shared by a module's tests (starting servers is the slow part)."""
    started = []
    for i in range(3):
        behavior = FakeBehavior()
        name = f"r{i}"
        started.append(Fake(name, behavior, ThreadedServer(create_fake_app(behavior, name)).start()))
    yield started
    for fake in started:
        fake.server.stop()


@pytest.fixture
def fakes(module_fakes: list[Fake]) -> list[Fake]:
    """Three healthy fake replicas with fresh behaviour (restarted if a test stopped one)."""
    for fake in module_fakes:
        fake.behavior.reset()
        if not fake.server.running:
            fake.server.start()
    return module_fakes


RouterFactory = Callable[..., ThreadedServer]


@pytest.fixture
def make_router() -> Iterator[RouterFactory]:
    """Start a router over given replica URLs (config overrides as keywords); stopped at teardown."""
    routers: list[ThreadedServer] = []

    def start(urls: list[str], **overrides: object) -> ThreadedServer:
        config = RouterConfig(replicas=tuple(urls), **(FAST | overrides))  # type: ignore[arg-type]
        server = ThreadedServer(create_app(config)).start()
        routers.append(server)
        return server

    yield start
    for server in routers:
        server.stop()
