"""The life of a service process, written once: configuration (flags > env > file >
defaults), structured logs, telemetry, a gRPC server, graceful SIGTERM, clean exit."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from unicron import rpc
from unicron.config import load_config
from unicron.errors import UnicronError
from unicron.logs import setup_logging
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


def run_server(
    name: str,
    config_class: type[C],
    argv: Sequence[str],
    setup: Callable[[C, rpc.Server, logging.Logger], Callable[[], Any] | None],
    prepare: Callable[[C, logging.Logger, threading.Event], bool] | None = None,
) -> int:
    """Loads the config, then `setup` adds servicers to the server (and returns what to
    start once it serves, if anything); serves until SIGTERM or SIGINT.

    `prepare`, when given, runs before the port is bound (a standby waits there for its
    lease); it gets an event set by SIGTERM or SIGINT meanwhile, and returning False ends
    the process cleanly without serving."""
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
    if prepare is not None:

        def stop_preparing(signum: int, _frame: Any) -> None:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            stopping.set()

        signal.signal(signal.SIGTERM, stop_preparing)
        signal.signal(signal.SIGINT, stop_preparing)
        if not prepare(config, log, stopping):
            log.info("%s stopped before serving", name)
            return 0
    try:
        server = rpc.Server(bind=config.bind, max_workers=config.max_workers)
        after_start = setup(config, server, log)
    except UnicronError as exc:
        log.error(str(exc))
        return 1
    server.install_signal_handlers()
    server.start()
    if after_start is not None:
        after_start()
    log.info("%s serving", name, extra={"address": server.address})
    if stopping.is_set():  # a signal arrived between prepare and serving
        server.stop()
    server.wait()
    shutdown_telemetry()
    log.info("%s stopped", name)
    return 0
