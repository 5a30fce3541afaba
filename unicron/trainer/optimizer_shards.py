"""The distributed optimizer's state as named pieces (docs/architecture.md: Sharded state).

Under Megatron's distributed optimizer each data-parallel rank owns a contiguous range of every
parameter's flattened elements (possibly empty), and only it holds the fp32 main parameters and
the Adam moments of that range. A rank's *optimizer shard* is therefore a set of pieces, one
per parameter it owns part of::

    {"data_parallel": [rank, size],
     "pieces": {name: {"numel": N, "start": s, "end": e,
                       "tensors": {"param": 1-D, "exp_avg": 1-D, "exp_avg_sq": 1-D}}}}

named by the model's parameter names, so that a shard means the same under any data-parallel
degree. Nothing here knows Megatron: the engine says which ranges a rank owns and loads what
``cut`` assembles. ``cut`` is the whole of resharding: given the shards at hand (this rank's
own, its peers', a checkpoint's) and the ranges a rank must own, it copies each range together
from the pieces that overlap it, and names what no piece covers. A state copy is checked with
``missing`` before anything is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

SHARD_KEY = "optimizer_shard"  # a rank's own shard in its state dict
SHARDS_KEY = "optimizer_shards"  # several ranks' shards, gathered to reshard from

Ranges = dict[str, tuple[int, int, int]]  # parameter name -> (numel, start, end)


class ShardError(Exception):
    """Optimizer shards that cannot give a rank what it must own, and why."""


def shard_state(
    rank: int, size: int, pieces: dict[str, tuple[int, int, int, dict[str, torch.Tensor]]]
) -> dict[str, Any]:
    """A shard in its state-dict form from ``name -> (numel, start, end, tensors)``."""
    return {
        "data_parallel": [rank, size],
        "pieces": {
            name: {"numel": numel, "start": start, "end": end, "tensors": tensors}
            for name, (numel, start, end, tensors) in pieces.items()
        },
    }


def data_parallel_of(shard: dict[str, Any]) -> tuple[int, int]:
    """(rank, size) of the data-parallel layout ``shard`` was taken under."""
    rank, size = shard["data_parallel"]
    return int(rank), int(size)


def ranges_of(shard: dict[str, Any]) -> Ranges:
    """What ``shard`` holds, as the ranges ``cut`` takes."""
    return {name: (int(p["numel"]), int(p["start"]), int(p["end"])) for name, p in shard["pieces"].items()}


def shards_of(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The optimizer shards a state copy carries: several gathered ones, its own, or none (a
    replicated optimizer's state)."""
    if SHARDS_KEY in state:
        return list(state[SHARDS_KEY])
    if SHARD_KEY in state:
        return [state[SHARD_KEY]]
    return []


def _pieces(shards: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for shard in shards:
        pieces = shard.get("pieces") if isinstance(shard, dict) else None
        if not isinstance(pieces, dict):
            raise ShardError("an optimizer shard holds no pieces")
        for name, piece in pieces.items():
            out.setdefault(name, []).append(piece)
    return out


def _gaps(start: int, end: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) that no range in ``covered`` reaches."""
    gaps = []
    at = start
    for lo, hi in sorted(covered):
        if lo > at:
            gaps.append((at, min(lo, end)))
        at = max(at, hi)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return [(lo, hi) for lo, hi in gaps if lo < hi]


def missing(shards: list[dict[str, Any]], wanted: Ranges) -> list[str]:
    """Why ``shards`` cannot give the ranges ``wanted`` ([] when they can): a parameter of
    another size, or element ranges no piece covers."""
    try:
        by_name = _pieces(shards)
    except ShardError as exc:
        return [str(exc)]
    problems = []
    for name, (numel, start, end) in sorted(wanted.items()):
        pieces = by_name.get(name, [])
        sizes = {int(p["numel"]) for p in pieces}
        if sizes - {numel}:
            problems.append(f"{name} has {sorted(sizes)} elements in the state, {numel} in this model")
            continue
        if len({tuple(sorted(p["tensors"])) for p in pieces}) > 1:
            problems.append(f"{name}'s pieces hold different optimizer states")
            continue
        gaps = _gaps(start, end, [(int(p["start"]), int(p["end"])) for p in pieces])
        if gaps:
            problems.append(f"{name} elements {gaps[0][0]}..{gaps[0][1]} are in no shard")
    return problems


def cut(shards: list[dict[str, Any]], wanted: Ranges) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of each wanted range (``name -> {"param", "exp_avg", ...}``), copied from
    the pieces of ``shards`` that overlap it; ShardError naming the first gap otherwise."""
    problems = missing(shards, wanted)
    if problems:
        raise ShardError(f"the optimizer state misses what this rank owns: {problems[0]}")
    by_name = _pieces(shards)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, (_, start, end) in wanted.items():
        tensors: dict[str, torch.Tensor] = {}
        for piece in by_name.get(name, []):
            lo, hi = max(start, int(piece["start"])), min(end, int(piece["end"]))
            if lo >= hi:
                continue
            for key, source in piece["tensors"].items():
                if key not in tensors:
                    tensors[key] = torch.empty(end - start, dtype=source.dtype)
                offset = int(piece["start"])
                tensors[key][lo - start : hi - start].copy_(source[lo - offset : hi - offset])
        out[name] = tensors
    return out


# A rank's place in ``pieces_to_exchange``: (iteration of its state or -1, its slice,
# the (rank, degree) its shard was taken at, its (rank, degree) now). Degree 0: no shard.
Place = tuple[int, tuple[int, int], tuple[int, int], tuple[int, int]]
# A buddy copy a rank keeps (buddy.py): (its iteration or -1, the (rank, degree) of the
# shard it copies). It belongs to the slice of the rank that keeps it.
CopyPlace = tuple[int, tuple[int, int]]
# Who sends which shard: (global rank, the (rank, degree) the shard was taken at).
Holder = tuple[int, tuple[int, int]]


def _holders(
    places: list[Place], copies: list[CopyPlace], members: list[int], target: int
) -> dict[tuple[int, int], int]:
    """Each shard of iteration ``target`` the slice's ``members`` hold (their own first, then
    the buddy copies), and one rank that holds it."""
    holders: dict[tuple[int, int], int] = {}
    for r in members:
        if places[r][0] == target and places[r][2][1]:
            holders.setdefault(places[r][2], r)
    for r in members:
        if r < len(copies) and copies[r][0] == target and copies[r][1][1]:
            holders.setdefault(copies[r][1], r)
    return holders


def pieces_to_exchange(
    places: list[Place], target: int, copies: list[CopyPlace] | None = None
) -> tuple[dict[tuple[int, int], list[Holder]], str]:
    """Which optimizer shards each slice's data-parallel ranks must exchange so that every rank
    can cut its shard at ``target`` (slice -> holders: the global rank that sends and which
    shard, one per shard taken; a slice whose ranks each hold their own shard at ``target``
    already needs none), and why that is impossible ("" when it is not): the shards of some
    data-parallel ranks died with them, and no buddy copy (``copies``, by global rank) has them."""
    copies = copies or []
    slices: dict[tuple[int, int], list[int]] = {}
    for rank, (_, slice_, _, _) in enumerate(places):
        slices.setdefault(slice_, []).append(rank)
    exchange: dict[tuple[int, int], list[Holder]] = {}
    for slice_, members in sorted(slices.items()):
        if not any(places[r][3][1] for r in members):
            continue  # a replicated optimizer: nothing sharded
        if all(places[r][0] == target and places[r][2] == places[r][3] for r in members):
            continue
        holders = _holders(places, copies, members, target)
        degrees = {degree for _, degree in holders}
        taken = sorted(dp_rank for dp_rank, _ in holders)
        if len(degrees) != 1 or taken != list(range(next(iter(degrees)))):
            shown = f"{len(taken)} of {max(degrees, default=0)}" if len(degrees) <= 1 else f"{sorted(holders)}"
            return {}, (
                f"slice {slice_}: only {shown} optimizer shards of iteration {target} are held; the rest were lost"
                " with their ranks"
            )
        exchange[slice_] = [(holders[key], key) for key in sorted(holders)]
    return exchange, ""
