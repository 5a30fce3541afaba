"""The data-parallel degrees an HSDP job can run at, one rule for the spec's check, the planner
and the trainer's mesh (unicron/trainer/fsdp.py: make_mesh).

HSDP arranges a job's ranks as ``replicate`` x ``shard``: groups of ``shard_degree`` ranks, each
group a whole copy of the sharded state. A world of whole groups works, and so does a world
smaller than one group (a job shrunk below it is sharded whole, as plain FSDP); any other size
cannot be laid out. A shard degree of 0 or 1 constrains nothing."""

from __future__ import annotations


def fits(data_parallel: int, shard_degree: int) -> bool:
    """Whether ``data_parallel`` ranks can be laid out for HSDP with ``shard_degree``."""
    if shard_degree <= 1 or data_parallel <= shard_degree:
        return True
    return data_parallel % shard_degree == 0
