"""A stop signal must reach a process whose main thread is inside `Event.wait`."""

import signal
import threading

from unicron import signals


def test_the_handler_sets_the_event_while_its_lock_is_held() -> None:
    # What a signal arriving inside `event.wait()` looks like to the handler: the main thread
    # holds the event's (non-reentrant) lock. Setting it there would hang this test forever.
    event = threading.Event()
    called: list[int] = []

    def action(signum: int) -> None:
        called.append(signum)
        event.set()

    handle = signals.handler(action)
    with event._cond:  # type: ignore[attr-defined]
        handle(signal.SIGTERM, None)
        assert not event.is_set()
    assert event.wait(5.0)
    assert called == [signal.SIGTERM]


def test_sigterm_and_sigint_both_stop() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            event = threading.Event()
            signals.stop_on_signals(lambda _signum: event.set())  # noqa: B023 (waited for below)
            signal.raise_signal(signum)
            assert event.wait(5.0)
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
