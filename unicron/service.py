"""The life of a service process, written once: configuration (flags > env > file >
defaults), structured logs, telemetry, a gRPC server, graceful SIGTERM, clean exit."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from unicron import redisutil, rpc, signals
from unicron.config import load_config
from unicron.errors import UnicronError
from unicron.logs import setup_logging
from unicron.security import ClientSecurity, ServerSecurity, TLSConfig, server_security
from unicron.telemetry import setup_telemetry, shutdown_telemetry


class ServiceConfig(Protocol):
    @property
    def bind(self) -> str: ...
    @property
    def max_workers(self) -> int: ...
    @property
    def log_level(self) -> str: ...


C = TypeVar("C", bound=ServiceConfig)
EXIT_CONFIG = 2
# A dependency unreachable at start (sysexits' EX_UNAVAILABLE): the supervisor restarts us.
EXIT_UNAVAILABLE = 69
# How long a starting service waits for its dependencies: long enough for a stack started
# all at once (compose, a Kubernetes rollout) to come up, short enough that a wrong address
# shows as a restarting container rather than one that looks started and does nothing.
DEPENDENCY_TIMEOUT_ENV = "UNICRON_DEPENDENCY_TIMEOUT_S"
DEFAULT_DEPENDENCY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Dependency:
    """Something a service cannot work without, checked before it binds its port."""

    name: str
    address: str
    reachable: Callable[[], bool]


def redis_dependency(url: str, tls: redisutil.RedisTLS | None = None) -> Dependency:
    return Dependency("redis", redisutil.redacted(url), lambda: redisutil.reachable(url, tls))


def grpc_dependency(name: str, address: str, security: ClientSecurity | None = None) -> Dependency:
    """A gRPC service answering health checks as SERVING (one of them, for a list)."""

    def reachable() -> bool:
        try:
            return rpc.wait_ready(address, timeout_s=1.0, security=security)
        except UnicronError:  # a listed host name that does not resolve (yet)
            return False

    return Dependency(name, address, reachable)


def dependency_timeout_s() -> float:
    raw = os.environ.get(DEPENDENCY_TIMEOUT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_DEPENDENCY_TIMEOUT_S
    except ValueError:
        return DEFAULT_DEPENDENCY_TIMEOUT_S


def wait_for(dependencies: Sequence[Dependency], timeout_s: float, stopping: threading.Event) -> Dependency | None:
    """The first dependency still unreachable after timeout_s (None when all answer, or
    when `stopping` is set meanwhile)."""
    deadline = time.monotonic() + timeout_s
    for dependency in dependencies:
        while not dependency.reachable():
            if stopping.is_set():
                return None
            if time.monotonic() >= deadline:
                return dependency
            stopping.wait(0.2)
    return None


# A full collection is considered after this many collections of the middle generation
# (Python's default: 10).
GC_FULL_EVERY = 100


def tune_garbage_collector() -> None:
    """Keeps the garbage collector's pauses rare. A full collection walks every object the
    process holds; under a thousand agents the coordinator holds a hundred thousand for their
    open streams alone, and with Python's defaults it paused 65-100 ms every 3-15 s, every
    heartbeat waiting behind it. What is alive once the server serves (modules, servicers,
    configuration) is frozen out of every collection, and full collections come ten times
    less often. The young generations are still collected as often as before: the garbage
    of each call dies there."""
    gc.collect()
    gc.freeze()
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, GC_FULL_EVERY)


def run_server(
    name: str,
    config_class: type[C],
    argv: Sequence[str],
    setup: Callable[[C, rpc.Server, logging.Logger], Callable[[], Any] | None],
    prepare: Callable[[C, logging.Logger, threading.Event], bool] | None = None,
    dependencies: Callable[[C], Sequence[Dependency]] | None = None,
    security: Callable[[C], ServerSecurity] | None = None,
    asyncio: bool = False,
) -> int:
    """Loads the config, then `setup` adds servicers to the server (and returns what to
    start once it serves, if anything); serves until SIGTERM or SIGINT.

    `dependencies`, when given, must all be reachable within UNICRON_DEPENDENCY_TIMEOUT_S
    (60 s) before anything else happens; otherwise one log line names the first that is
    not, and the process exits with EXIT_UNAVAILABLE without having served.

    `prepare`, when given, runs before the port is bound (a standby waits there for its
    lease); it gets an event set by SIGTERM or SIGINT meanwhile, and returning False ends
    the process cleanly without serving.

    `security` makes the server's ServerSecurity from the config (by default, for a config
    with TLSConfig's settings, its TLS and certificate authentication); what runs less than
    secure is said in WARNING lines before serving. `asyncio` serves coroutine servicers
    (unicron.rpc.Server)."""
    try:
        config = load_config(
            config_class, env_prefix=f"UNICRON_{name.upper()}", argv=argv, description=f"Unicron {name}"
        )
    except UnicronError as exc:
        print(f"unicron-{name}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    log = setup_logging(name, config.log_level)
    setup_telemetry(name)
    stopping = threading.Event()
    if prepare is not None or dependencies is not None:

        def stop_preparing(signum: int) -> None:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            stopping.set()

        signals.stop_on_signals(stop_preparing)
    if dependencies is not None:
        timeout_s = dependency_timeout_s()
        missing = wait_for(dependencies(config), timeout_s, stopping)
        if missing is not None:
            log.error(
                "%s unreachable at %s after %gs; exiting",
                missing.name,
                missing.address,
                timeout_s,
                extra={"dependency": missing.name, "exit_code": EXIT_UNAVAILABLE},
            )
            return EXIT_UNAVAILABLE
        if stopping.is_set():
            log.info("%s stopped before serving", name)
            return 0
    if prepare is not None:
        try:
            prepared = prepare(config, log, stopping)
        except UnicronError as exc:  # a mistake found while preparing (a Sentinel quorum, say)
            log.error(str(exc), extra={"exit_code": EXIT_CONFIG})
            return EXIT_CONFIG
        if not prepared:
            log.info("%s stopped before serving", name)
            return 0
    try:
        if security is not None:
            secured: ServerSecurity | None = security(config)
        else:
            secured = server_security(config) if isinstance(config, TLSConfig) else None
        for warning in secured.warnings(name) if secured is not None else []:
            log.warning(warning)
        server = rpc.Server(bind=config.bind, max_workers=config.max_workers, security=secured, asyncio=asyncio)
        after_start = setup(config, server, log)
    except UnicronError as exc:
        log.error(str(exc))
        return 1
    server.install_signal_handlers()
    server.start()
    if after_start is not None:
        after_start()
    tune_garbage_collector()
    log.info("%s serving", name, extra={"address": server.address})
    if stopping.is_set():  # a signal arrived between prepare and serving
        server.stop()
    server.wait()
    shutdown_telemetry()
    log.info("%s stopped", name)
    return 0
