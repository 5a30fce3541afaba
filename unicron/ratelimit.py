"""A token bucket, so one misbehaving peer cannot flood a server with reports."""

from __future__ import annotations

import threading
from collections.abc import Callable
from time import monotonic


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = monotonic) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be positive and burst at least 1")
        self._rate = rate_per_s
        self._burst = burst
        self._tokens = burst
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()

    def allow(self, cost: float = 1.0) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
            self._last = now
            if self._tokens >= cost:
                self._tokens -= cost
                return True
            return False


class KeyedLimiter:
    """One bucket per key (a node, a worker), created on first use."""

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = monotonic) -> None:
        self._rate = rate_per_s
        self._burst = burst
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, cost: float = 1.0) -> bool:
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket(self._rate, self._burst, self._clock)
        return bucket.allow(cost)

    def forget(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)
