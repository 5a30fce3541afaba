"""Shared fixtures: a real redis-server per test session, flushed between tests."""

from __future__ import annotations

from collections.abc import Iterator
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
