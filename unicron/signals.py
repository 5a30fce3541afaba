"""Signal handlers that act off the main thread.

Python runs a handler on the main thread between bytecodes, possibly while that thread is
inside `event.wait()` holding the event's lock, or inside a log handler's write. Setting the
event, or logging, from the handler then deadlocks: a standby coordinator once ignored SIGTERM
that way. These handlers hand the work to a short-lived thread, which takes the lock once the
main thread lets go of it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


def handler(action: Callable[[int], None]) -> Callable[[int, Any], None]:
    """A signal handler that runs `action(signal number)` on a thread of its own."""

    def handle(signum: int, _frame: Any) -> None:
        threading.Thread(target=action, args=(signum,), name=f"on-{signal.Signals(signum).name}", daemon=True).start()

    return handle


def stop_on_signals(action: Callable[[int], None]) -> None:
    """SIGTERM and SIGINT run `action` (see `handler`)."""
    handle = handler(action)
    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
