"""A service whose dependency does not answer at start says which, in one line, and exits
non-zero without having served (unicron.service: `dependencies`), so that an orchestrator
restarts it instead of keeping a half-started service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from unicron import service
from unicron.redisutil import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_wait_for_names_the_first_dependency_that_does_not_answer() -> None:
    calls: list[str] = []

    def up(name: str) -> service.Dependency:
        def reachable() -> bool:
            calls.append(name)
            return True

        return service.Dependency(name, "a:1", reachable)

    down = service.Dependency("redis", "b:2", lambda: False)
    stopping = threading.Event()
    assert service.wait_for([up("x"), up("y")], 1.0, stopping) is None
    assert calls == ["x", "y"]
    start = time.monotonic()
    assert service.wait_for([up("x"), down], 0.3, stopping) is down
    assert 0.3 <= time.monotonic() - start < 2.0


def test_wait_for_gives_up_at_once_when_stopping() -> None:
    stopping = threading.Event()
    stopping.set()
    start = time.monotonic()
    assert service.wait_for([service.Dependency("redis", "b:2", lambda: False)], 30.0, stopping) is None
    assert time.monotonic() - start < 1.0


def test_dependency_addresses_hide_passwords() -> None:
    assert service.redis_dependency("redis://:s3cret@redis:6379/0").address == "redis://:***@redis:6379/0"
    assert service.redis_dependency("redis://redis:6379/0").address == "redis://redis:6379/0"


def test_an_unresolvable_coordinator_list_is_unreachable_not_a_crash() -> None:
    dependency = service.grpc_dependency("coordinator", "no-such-host.invalid:1,no-such-host.invalid:2")
    assert dependency.reachable() is False


def test_dependency_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(service.DEPENDENCY_TIMEOUT_ENV, "2.5")
    assert service.dependency_timeout_s() == 2.5
    monkeypatch.setenv(service.DEPENDENCY_TIMEOUT_ENV, "soon")
    assert service.dependency_timeout_s() == service.DEFAULT_DEPENDENCY_TIMEOUT_S


@pytest.mark.parametrize(
    ("module", "args", "dependency"),
    [
        ("services.coordinator", ["--redis-url", "redis://127.0.0.1:{port}/0"], "redis"),
        ("services.agent", ["--coordinator", "127.0.0.1:{port}", "--warm-spares", "0"], "coordinator"),
    ],
)
def test_a_service_without_its_dependency_exits_in_one_line(
    module: str, args: list[str], dependency: str, tmp_path: Path
) -> None:
    port = free_port()
    bind = f"127.0.0.1:{free_port()}"
    prefix = "UNICRON_" + module.split(".")[1].upper()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("UNICRON_", "OTEL_"))},
        service.DEPENDENCY_TIMEOUT_ENV: "1",
        # Plain gRPC, where the service knows TLS settings: this test is about dependencies.
        f"{prefix}_PLAINTEXT": "true",
    }
    argv = [sys.executable, "-m", module, "--bind", bind, *[a.format(port=port) for a in args]]
    if module == "services.agent":
        argv += ["--work-dir", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == service.EXIT_UNAVAILABLE, done.stderr
    errors = [json.loads(line) for line in done.stderr.splitlines() if '"level": "error"' in line]
    assert len(errors) == 1, done.stderr
    assert errors[0]["msg"].startswith(f"{dependency} unreachable at ")
    assert str(port) in errors[0]["msg"]
    assert errors[0]["dependency"] == dependency
    assert f"{module.split('.')[1]} serving" not in done.stderr  # never bound its port
