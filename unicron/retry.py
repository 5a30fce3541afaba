"""The one retry/backoff helper every service uses."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter, so reconnecting agents do not stampede."""

    initial_s: float = 0.1
    maximum_s: float = 2.0
    multiplier: float = 2.0
    jitter: bool = True

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield random.uniform(0, delay) if self.jitter else delay
            delay = min(self.maximum_s, delay * self.multiplier)


def retry(
    fn: Callable[[], T],
    *,
    retry_on: tuple[type[BaseException], ...],
    attempts: int | None = 5,
    deadline_s: float | None = None,
    backoff: Backoff = Backoff(),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    should_stop: Callable[[], bool] = lambda: False,
) -> T:
    """Calls fn until it returns, retrying on `retry_on` exceptions.

    Gives up (re-raising the last error) after `attempts` calls or past `deadline_s`,
    whichever comes first; None disables that bound.
    """
    start = clock()
    delays = backoff.delays()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except retry_on:
            delay = next(delays)
            out_of_attempts = attempts is not None and attempt >= attempts
            out_of_time = deadline_s is not None and clock() - start + delay > deadline_s
            if out_of_attempts or out_of_time or should_stop():
                raise
            sleep(delay)
