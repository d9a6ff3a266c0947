"""Fixtures: fake replicas and routers on loopback, each in its own uvicorn thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tailserve.router.app import create_app
from tailserve.router.config import RouterConfig
from tests.router.fake_replica import FakeBehavior, ThreadedServer, create_fake_app

# Short intervals keep the tests quick; timing assertions derive their bounds from these.
FAST = {
    "health_interval_s": 0.2,
    "health_timeout_s": 0.5,
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


@pytest.fixture
def fakes() -> Iterator[list[Fake]]:
    """Three healthy fake replicas."""
    started = []
    for i in range(3):
        behavior = FakeBehavior()
        name = f"r{i}"
        started.append(Fake(name, behavior, ThreadedServer(create_fake_app(behavior, name)).start()))
    yield started
    for fake in started:
        fake.server.stop()


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
