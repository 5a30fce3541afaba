"""Randomness keyed by the data, not by the rank (docs/architecture.md: Sharded state): a seed
that is a function of what a micro-batch computes, so that a restarted rank, a reattempt and a
job at another data-parallel degree draw the same dropout masks for the same samples. Both
levels use it: the Megatron-Core engine per micro-batch, Session's ``step.micro_batches()``."""

from __future__ import annotations

import hashlib


def keyed_seed(seed: int, iteration: int, first_sample: int, pipeline_stage: int = 0) -> int:
    """A generator seed that is a function of the key alone: what a micro-batch's forward pass
    draws (dropout's masks) then depends on the samples it computes, not on the rank or on what
    was drawn before. 62 bits, so that Megatron's per-rank offsets stay within a seed's range."""
    key = f"{seed}:{iteration}:{first_sample}:{pipeline_stage}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 62) - 1)
