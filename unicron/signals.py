"""Signal handlers that stop a process waiting on a `threading.Event`.

Python runs a handler on the main thread between bytecodes, possibly while that thread is
inside `event.wait()` holding the event's lock. Calling `event.set()` from the handler then
deadlocks: a standby coordinator once ignored SIGTERM that way. These handlers hand the work
to a short-lived thread, which takes the lock once the main thread lets go of it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


def setting(event: threading.Event, before: Callable[[int], None] | None = None) -> Callable[[int, Any], None]:
    """A handler that sets `event` (after calling `before` with the signal number) off the
    main thread."""

    def handle(signum: int, _frame: Any) -> None:
        def run() -> None:
            if before is not None:
                before(signum)
            event.set()

        threading.Thread(target=run, name=f"on-{signal.Signals(signum).name}", daemon=True).start()

    return handle


def stop_on_signals(event: threading.Event, before: Callable[[int], None] | None = None) -> None:
    """SIGTERM and SIGINT set `event` (see `setting`)."""
    handler = setting(event, before)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
