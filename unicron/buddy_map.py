"""Who keeps whose buddy copy (docs/trainer-library.md: Buddy copies): one pure function of the
placement, used by the coordinator to write the map into a job's assignment and by the
trainers to pick the same peers from what they are told of their nodes.

Under Megatron's distributed optimizer the ranks holding one (tensor, pipeline) slice form a
data-parallel group; Megatron numbers ranks tensor-fastest, then data-parallel, then pipeline
(its default ``tp-cp-ep-dp-pp`` order with no context or expert parallelism), so slice (t, p)'s
group is the ranks ``t + T x (d + D x p)`` for d = 0..D-1. In each group data-parallel rank d
sends its shard to rank ``d + shift``: ``shift`` is the smallest that puts every rank's copy in
another failure domain, where the nodes have domains that allow it, else on another node, else
there is none (every rank of the group on one node: no copy can survive that node).
"""

from __future__ import annotations

from collections.abc import Sequence

NO_KEEPER = -1
DOMAIN = "failure domain"
NODE = "node"


def smallest_shift(places: Sequence[str]) -> int:
    """The smallest shift s such that every rank d's buddy, d + s, is somewhere else than d
    (0: there is none)."""
    size = len(places)
    for shift in range(1, size):
        if all(places[(d + shift) % size] != places[d] for d in range(size)):
            return shift
    return 0


def choose_shift(nodes: Sequence[str], domains: Sequence[str]) -> tuple[int, str]:
    """The shift of one data-parallel group (its ranks' nodes and failure domains, by
    data-parallel rank) and what it separates: another failure domain, another node, or
    nothing (0, "")."""
    if all(domains) and len(set(domains)) > 1:
        shift = smallest_shift(domains)
        if shift:
            return shift, DOMAIN
    shift = smallest_shift(nodes)
    return (shift, NODE) if shift else (0, "")


def data_parallel_groups(world: int, tensor: int, pipeline: int) -> list[list[int]]:
    """Each (tensor, pipeline) slice's ranks in data-parallel order (module docstring)."""
    tensor, pipeline = max(tensor, 1), max(pipeline, 1)
    degree = world // (tensor * pipeline)
    return [[t + tensor * (d + degree * p) for d in range(degree)] for p in range(pipeline) for t in range(tensor)]


def keepers(nodes: Sequence[str], domains: Sequence[str], tensor: int, pipeline: int) -> tuple[list[int], str]:
    """Per global rank (``nodes`` and ``domains`` by rank), the rank that keeps its shard's
    buddy copy (NO_KEEPER: none), and a sentence saying where the copies are."""
    world = len(nodes)
    keeper = [NO_KEEPER] * world
    levels: set[str] = set()
    alone: list[str] = []
    for group in data_parallel_groups(world, tensor, pipeline):
        if len(group) < 2:
            alone.append("data-parallel degree 1")
            continue
        shift, level = choose_shift([nodes[r] for r in group], [domains[r] for r in group])
        levels.add(level)
        if not shift:
            degree = len(group)
            slice_ = (group[0] % max(tensor, 1), group[0] // (max(tensor, 1) * degree))
            alone.append(f"every data-parallel rank of slice {slice_} on node {nodes[group[0]]}")
            continue
        for d, rank in enumerate(group):
            keeper[rank] = group[(d + shift) % len(group)]
    if alone:
        return (
            keeper,
            f"no buddy copy for some shards ({alone[0]}): a lost rank's shard comes from a snapshot or the checkpoint",
        )
    where = "another failure domain" if levels == {DOMAIN} else "another node"
    return keeper, f"each optimizer shard's buddy copy in {where}"
