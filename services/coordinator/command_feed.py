"""Wakes the coordinator's command streams when their node gets a command.

Every agent holds a command stream open for its life. Each stream used to block in its own
Redis read, a second at a time: with a thousand agents, a thousand reads a second for nothing.
Here one thread blocks in one read over every listening node's command log and bumps that
node's version; a stream reads the log only when its node's version moved."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services.coordinator.store import Store
from unicron.errors import UnicronError

log = logging.getLogger(__name__)

BLOCK_MS = 1000
RETRY_S = 0.5


class CommandFeed:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._changed = threading.Condition()
        self._versions: dict[str, int] = {}
        self._listeners: dict[str, int] = {}
        # node -> the newest command id the feed has seen (where its next read starts)
        self._cursors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="command-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    def listen(self, node_id: str) -> int:
        """Registers a stream of `node_id`; returns the version to wait from. Commands
        appended from now on bump the version; older ones are the stream's own first read."""
        last = self._store.last_command_id(node_id)
        with self._changed:
            if self._thread is None and not self._stop.is_set():
                self.start()  # on first use: a coordinator that never serves a stream needs none
            self._listeners[node_id] = self._listeners.get(node_id, 0) + 1
            self._cursors.setdefault(node_id, last)
            return self._versions.get(node_id, 0)

    def leave(self, node_id: str) -> None:
        with self._changed:
            self._listeners[node_id] -= 1
            if not self._listeners[node_id]:
                del self._listeners[node_id]
                self._cursors.pop(node_id, None)

    def wait(self, node_id: str, seen: int, timeout_s: float, stop: Callable[[], bool]) -> int:
        """Waits until the node's version passes `seen`, or `timeout_s`; returns the version."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._versions.get(node_id, 0) != seen or self._stop.is_set() or stop(), timeout_s
            )
            return self._versions.get(node_id, 0)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._changed:
                cursors = dict(self._cursors)
            if not cursors:
                self._stop.wait(0.05)
                continue
            try:
                newest = self._store.wait_for_commands(cursors, BLOCK_MS)
            except UnicronError as exc:
                log.warning("command feed cannot read Redis", extra={"error": str(exc)})
                self._stop.wait(RETRY_S)
                continue
            if not newest:
                continue
            with self._changed:
                for node_id, command_id in newest.items():
                    self._versions[node_id] = self._versions.get(node_id, 0) + 1
                    if node_id in self._cursors:
                        self._cursors[node_id] = command_id
                self._changed.notify_all()
