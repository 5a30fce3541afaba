"""Resharding a distributed optimizer's state as named pieces: cutting the ranges a rank owns
out of the shards at hand, naming what none covers, and which shards a reform must exchange."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from unicron.trainer.optimizer_shards import (
    CopyPlace,
    Holder,
    Place,
    ShardError,
    cut,
    missing,
    pieces_to_exchange,
    ranges_of,
    shard_state,
    shards_of,
)

NUMELS = {"a": 10, "b": 7, "c": 1}


def full(name: str, key: str) -> torch.Tensor:
    """The whole (unsharded) state ``key`` of parameter ``name``: distinct values everywhere."""
    base = {"param": 0.0, "exp_avg": 1000.0, "exp_avg_sq": 2000.0}[key] + 100.0 * sorted(NUMELS).index(name)
    return torch.arange(NUMELS[name], dtype=torch.float32) + base


def ranges(degree: int) -> list[dict[str, tuple[int, int, int]]]:
    """Megatron's split: the parameters laid end to end in one buffer padded to a multiple of
    ``degree``, each rank owning an equal contiguous part of it."""
    total = sum(NUMELS.values())
    size = -(-total // degree)
    out: list[dict[str, tuple[int, int, int]]] = [{} for _ in range(degree)]
    offset = 0
    for name, numel in NUMELS.items():
        for rank in range(degree):
            lo, hi = max(offset, rank * size), min(offset + numel, (rank + 1) * size)
            if lo < hi:
                out[rank][name] = (numel, lo - offset, hi - offset)
        offset += numel
    return out


def shards(degree: int) -> list[dict[str, Any]]:
    return [
        shard_state(
            rank,
            degree,
            {
                name: (numel, lo, hi, {k: full(name, k)[lo:hi].clone() for k in ("param", "exp_avg", "exp_avg_sq")})
                for name, (numel, lo, hi) in owned.items()
            },
        )
        for rank, owned in enumerate(ranges(degree))
    ]


@pytest.mark.parametrize(("saved", "wanted"), [(1, 2), (2, 1), (2, 3), (3, 2), (4, 3), (3, 3), (5, 18)])
def test_any_degree_cuts_to_any_other_exactly(saved: int, wanted: int) -> None:
    # Degrees that do not divide the 18 elements leave padding and uneven pieces.
    held = shards(saved)
    for owned in ranges(wanted):
        assert not missing(held, owned)
        got = cut(held, owned)
        for name, (_, lo, hi) in owned.items():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                assert got[name][key].equal(full(name, key)[lo:hi])


def test_a_missing_shard_is_named_and_nothing_is_cut() -> None:
    held = shards(3)
    del held[1]
    owned = ranges(1)[0]
    problems = missing(held, owned)
    assert problems and "elements" in problems[0] and "in no shard" in problems[0]
    with pytest.raises(ShardError, match="misses what this rank owns"):
        cut(held, owned)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda p: p.update(numel=11), "elements in the state"),
        (lambda p: p["tensors"].pop("exp_avg"), "different optimizer states"),
    ],
)
def test_pieces_of_another_model_are_refused(change: Callable[[dict[str, Any]], object], problem: str) -> None:
    held = shards(2)
    change(held[1]["pieces"]["a"] if "a" in held[1]["pieces"] else held[0]["pieces"]["a"])
    assert any(problem in p for p in missing(held, ranges(1)[0]))


def test_shards_of_reads_a_rank_own_gathered_or_none() -> None:
    one = shards(2)
    assert shards_of({"optimizer_shard": one[0]}) == [one[0]]
    assert shards_of({"optimizer_shards": one}) == one
    assert shards_of({"optimizer": {}}) == []
    assert ranges_of(one[0]) == ranges(2)[0]
    assert missing([{"no": "pieces"}], ranges(1)[0]) == ["an optimizer shard holds no pieces"]


S0, S1 = (0, 0), (1, 0)  # two tensor-parallel slices


@pytest.mark.parametrize(
    ("places", "target", "exchange", "problem"),
    [
        # a reattempt: every rank holds its own shard at the target
        ([(5, S0, (0, 2), (0, 2)), (5, S0, (1, 2), (1, 2))], 5, {}, ""),
        # a replicated optimizer: nothing to exchange, whatever is held
        ([(5, S0, (0, 0), (0, 0)), (-1, S0, (0, 0), (1, 0))], 5, {}, ""),
        # a grow 1 -> 2: the one shard is everything
        ([(5, S0, (0, 1), (0, 2)), (-1, S0, (0, 0), (1, 2))], 5, {S0: [(0, (0, 1))]}, ""),
        # ranks renumbered: shards of both, each to be cut anew
        ([(5, S0, (1, 2), (0, 2)), (5, S0, (0, 2), (1, 2))], 5, {S0: [(1, (0, 2)), (0, (1, 2))]}, ""),
        # TP 2 grow: each slice exchanges within itself; the other slice's ranks need none
        (
            [(5, S0, (0, 1), (0, 2)), (5, S1, (0, 1), (0, 2)), (-1, S0, (0, 0), (1, 2)), (-1, S1, (0, 0), (1, 2))],
            5,
            {S0: [(0, (0, 1))], S1: [(1, (0, 1))]},
            "",
        ),
        # a shrink 2 -> 1 after the other rank died: half the state is gone
        ([(5, S0, (0, 2), (0, 1))], 5, {}, "only 1 of 2 optimizer shards"),
        # a restart: the new rank's shard is in no peer
        ([(5, S0, (0, 2), (0, 2)), (-1, S0, (0, 0), (1, 2))], 5, {}, "only 1 of 2"),
        # a shard held at an older iteration does not count
        ([(5, S0, (0, 2), (0, 2)), (4, S0, (1, 2), (1, 2))], 5, {}, "only 1 of 2"),
    ],
)
def test_which_shards_a_reform_exchanges(
    places: list[Place], target: int, exchange: dict[tuple[int, int], list[Holder]], problem: str
) -> None:
    got, why = pieces_to_exchange(places, target)
    assert got == exchange
    assert (problem in why) if problem else why == ""


@pytest.mark.parametrize(
    ("places", "copies", "exchange", "problem"),
    [
        # a restart: the new rank's shard comes from its buddy's copy
        (
            [(5, S0, (0, 2), (0, 2)), (-1, S0, (0, 0), (1, 2))],
            [(5, (1, 2)), (-1, (0, 0))],
            {S0: [(0, (0, 2)), (0, (1, 2))]},
            "",
        ),
        # a shrink 2 -> 1 after rank 1 died: its shard from rank 0's copy
        ([(5, S0, (0, 2), (0, 1))], [(5, (1, 2))], {S0: [(0, (0, 2)), (0, (1, 2))]}, ""),
        # a copy one iteration older does not count
        ([(5, S0, (0, 2), (0, 1))], [(4, (1, 2))], {}, "only 1 of 2"),
        # DP 4 grow to 6 with ranks 2 and 3 lost: copies of 1 and 3 held by 2's and 0's buddies
        (
            [(5, S0, (0, 4), (0, 3)), (5, S0, (1, 4), (1, 3)), (-1, S0, (0, 0), (2, 3))],
            [(5, (2, 4)), (5, (3, 4)), (-1, (0, 0))],
            {S0: [(0, (0, 4)), (1, (1, 4)), (0, (2, 4)), (1, (3, 4))]},
            "",
        ),
    ],
)
def test_buddy_copies_hold_the_shards_their_ranks_lost(
    places: list[Place], copies: list[CopyPlace], exchange: dict[tuple[int, int], list[Holder]], problem: str
) -> None:
    got, why = pieces_to_exchange(places, 5, copies)
    assert got == exchange
    assert (problem in why) if problem else why == ""
