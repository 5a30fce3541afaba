from __future__ import annotations

import pytest

from unicron.retry import Backoff, retry


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("down")
        return "up"


def test_retries_until_success_with_growing_delays() -> None:
    slept: list[float] = []
    flaky = Flaky(3)
    assert (
        retry(flaky, retry_on=(ConnectionError,), backoff=Backoff(0.1, 1.0, jitter=False), sleep=slept.append) == "up"
    )
    assert slept == [0.1, 0.2, 0.4]


def test_gives_up_after_attempts() -> None:
    flaky = Flaky(10)
    with pytest.raises(ConnectionError):
        retry(flaky, retry_on=(ConnectionError,), attempts=3, sleep=lambda _: None)
    assert flaky.calls == 3


def test_gives_up_past_deadline() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    flaky = Flaky(100)
    with pytest.raises(ConnectionError):
        retry(
            flaky,
            retry_on=(ConnectionError,),
            attempts=None,
            deadline_s=1.0,
            backoff=Backoff(0.3, 0.3, jitter=False),
            sleep=sleep,
            clock=lambda: now[0],
        )
    assert now[0] <= 1.0


def test_other_errors_are_not_retried() -> None:
    def broken() -> None:
        raise ValueError("bug")

    with pytest.raises(ValueError):
        retry(broken, retry_on=(ConnectionError,), sleep=lambda _: None)


def test_jitter_stays_within_the_delay() -> None:
    delays = Backoff(0.5, 0.5).delays()
    assert all(0 <= next(delays) <= 0.5 for _ in range(100))
