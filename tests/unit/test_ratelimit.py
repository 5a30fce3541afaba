from __future__ import annotations

from unicron.ratelimit import KeyedLimiter, TokenBucket


def test_bucket_allows_a_burst_then_the_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(rate_per_s=10, burst=5, clock=lambda: now[0])
    assert [bucket.allow() for _ in range(6)] == [True] * 5 + [False]
    now[0] += 0.1  # one token back
    assert bucket.allow() and not bucket.allow()
    now[0] += 100  # never more than the burst
    assert sum(bucket.allow() for _ in range(20)) == 5


def test_keys_have_their_own_buckets() -> None:
    limiter = KeyedLimiter(rate_per_s=1, burst=1, clock=lambda: 0.0)
    assert limiter.allow("a") and not limiter.allow("a")
    assert limiter.allow("b")


def test_the_least_recently_used_key_goes_past_max_keys() -> None:
    limiter = KeyedLimiter(rate_per_s=1, burst=1, clock=lambda: 0.0, max_keys=2)
    assert limiter.allow("a") and limiter.allow("b")
    assert not limiter.allow("a")  # a is now the most recently used
    assert limiter.allow("c")  # b goes
    assert len(limiter) == 2
    assert not limiter.allow("a")  # a kept its empty bucket
    assert limiter.allow("b")  # b starts again
