"""A token bucket, so one misbehaving peer cannot flood a server with reports."""

from __future__ import annotations

import threading
from collections import OrderedDict
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
    """One bucket per key (a node, a worker, a connection), created on first use. At most
    `max_keys` are kept: past that the least recently used goes (keys that come and go, such
    as connections, must not grow the table forever); it starts again with a full bucket."""

    def __init__(
        self, rate_per_s: float, burst: float, clock: Callable[[], float] = monotonic, max_keys: int = 100_000
    ) -> None:
        self._rate = rate_per_s
        self._burst = burst
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, key: str, cost: float = 1.0) -> bool:
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket(self._rate, self._burst, self._clock)
                if len(self._buckets) > self._max_keys:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
        return bucket.allow(cost)

    def __len__(self) -> int:
        return len(self._buckets)

    def forget(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)
