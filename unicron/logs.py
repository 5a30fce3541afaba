"""Structured logs: one JSON object per line on stderr, with the service name on each."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, NoReturn

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Fields passed as logging's `extra=` become top-level keys, which keeps them greppable.
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str = "info") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return logging.getLogger(service)


def exit_flushed(code: int) -> NoReturn:
    """Ends the process with ``code`` once the logs are flushed, skipping the interpreter's
    own teardown. A service or trainer calls this after its clean shutdown: that teardown
    adds about 2 s per process (gRPC's finalization), which every stop, restart and
    finished job would wait for, and it holds nothing that still needs saving."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
