"""Shared fixtures: a real redis-server per test session, flushed between tests."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import redis

from unicron.redisutil import LocalRedis, connect


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = LocalRedis(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: LocalRedis) -> Iterator[redis.Redis]:
    client = connect(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test on a LocalCluster reports the tail of each service's log: CI keeps only
    what pytest prints, and a failure there is otherwise a bare assertion about a job."""
    report: pytest.TestReport = yield
    if report.failed and call.when == "call":
        from unicron_dev.localcluster import LocalCluster

        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, LocalCluster):
                for service in value.services:
                    report.sections.append((f"{service.name} log (tail)", _tail(service.log_path, LOG_TAIL_LINES)))
    return report


LOG_TAIL_LINES = 30


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"
