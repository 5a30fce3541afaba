"""The transfer plan over named pieces: which ranges move from whom to whom (a table), and its
execution over a real gloo group: each rank receives only what it will own, checksummed."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unicron.redisutil import free_port
from unicron.trainer.optimizer_shards import cut, ranges_of, shard_state
from unicron.trainer.piece_moves import Move, Offer, kinds_of, message_bytes, plan_moves, run_moves
from unicron.trainer.tensor_bytes import StateError

KINDS = {"w": (("exp_avg", "float32"), ("param", "float32")), "b": (("exp_avg", "float32"), ("param", "float32"))}


def offer(**ranges: tuple[int, int, int]) -> Offer:
    return Offer(dict(ranges), {name: KINDS[name] for name in ranges})


# DP 2 -> 3 of a 12-element "w": old shards [0, 6) and [6, 12), new [0, 4), [4, 8), [8, 12).
GROW = [[offer(w=(12, 0, 6))], [offer(w=(12, 6, 12))], []]
GROW_WANTED = [{"w": (12, 0, 4)}, {"w": (12, 4, 8)}, {"w": (12, 8, 12)}]


@pytest.mark.parametrize(
    ("offers", "wanted", "moves"),
    [
        pytest.param(
            GROW,
            GROW_WANTED,
            [Move(0, 0, 0, "w", 0, 4), Move(0, 0, 1, "w", 4, 6), Move(1, 0, 1, "w", 6, 8), Move(1, 0, 2, "w", 8, 12)],
            id="grow: each new range from the old shards it overlaps, nothing else",
        ),
        pytest.param(
            # Rank 1 lost, its shard in rank 0's buddy copy (offer 1): DP 3 -> 2 shrink.
            [[offer(w=(12, 0, 4)), offer(w=(12, 4, 8))], [offer(w=(12, 8, 12))]],
            [{"w": (12, 0, 6)}, {"w": (12, 6, 12)}],
            [Move(0, 0, 0, "w", 0, 4), Move(0, 1, 0, "w", 4, 6), Move(0, 1, 1, "w", 6, 8), Move(1, 0, 1, "w", 8, 12)],
            id="shrink: a lost rank's range from the buddy copy that holds it",
        ),
        pytest.param(
            # The receiver holds part of its range itself: that part moves nothing.
            [[offer(w=(12, 0, 12))], [offer(w=(12, 4, 8))]],
            [{}, {"w": (12, 2, 10)}],
            [Move(0, 0, 1, "w", 2, 4), Move(1, 0, 1, "w", 4, 8), Move(0, 0, 1, "w", 8, 10)],
            id="own piece first, then the farthest-reaching sender",
        ),
        pytest.param(
            [[offer(w=(12, 0, 6), b=(3, 0, 3))], [offer(w=(12, 6, 12))]],
            [{"b": (3, 0, 3), "w": (12, 0, 12)}, {}],
            [Move(0, 0, 0, "b", 0, 3), Move(0, 0, 0, "w", 0, 6), Move(1, 0, 0, "w", 6, 12)],
            id="several parameters, in name order",
        ),
    ],
)
def test_the_plan_moves_each_wanted_range_once(
    offers: list[list[Offer]], wanted: list[dict[str, tuple[int, int, int]]], moves: list[Move]
) -> None:
    planned, problem = plan_moves(offers, wanted)
    assert problem == ""
    assert planned == moves
    # Every receiver gets exactly its ranges, and no sender sends what it does not hold.
    for receiver, ranges in enumerate(wanted):
        got = sorted((m.name, m.start, m.end) for m in planned if m.receiver == receiver)
        for name, (_, start, end) in ranges.items():
            spans = [(lo, hi) for n, lo, hi in got if n == name]
            assert spans[0][0] == start and spans[-1][1] == end
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for m in planned:
        _, lo, hi = offers[m.sender][m.offer].ranges[m.name]
        assert lo <= m.start < m.end <= hi


@pytest.mark.parametrize(
    ("offers", "wanted", "problem"),
    [
        pytest.param(
            [[offer(w=(12, 0, 6))], []], [{}, {"w": (12, 0, 12)}], "w elements from 6 are in no shard held", id="gap"
        ),
        pytest.param(
            [[offer(w=(10, 0, 10))]], [{"w": (12, 0, 12)}], "w has [10] elements in the shards held, 12", id="size"
        ),
    ],
)
def test_a_plan_that_cannot_cover_says_why(
    offers: list[list[Offer]], wanted: list[dict[str, tuple[int, int, int]]], problem: str
) -> None:
    planned, said = plan_moves(offers, wanted)
    assert planned == []
    assert said.startswith(problem)


def test_a_message_is_padded_to_whole_words() -> None:
    offers = [[offer(w=(12, 0, 12))]]
    assert message_bytes([Move(0, 0, 1, "w", 0, 3)], offers) == 24  # 2 tensors x 3 x 4 bytes
    assert message_bytes([Move(0, 0, 1, "w", 0, 1)], offers) == 8


def _shard(rank: int, degree: int, numel: int) -> dict[str, Any]:
    """DP rank ``rank`` of ``degree``'s shard of a parameter whose elements are 0..numel-1."""
    start, end = numel * rank // degree, numel * (rank + 1) // degree
    values = torch.arange(start, end, dtype=torch.float32)
    return shard_state(rank, degree, {"w": (numel, start, end, {"param": values, "exp_avg": -values})})


def _grow_rank(rank: int, port: int, corrupt: bool, out: Any) -> None:
    """DP 2 -> 3 of a 30-element parameter; with ``corrupt`` rank 0's message is damaged in flight."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        held = [_shard(rank, 2, 30)] if rank < 2 else []
        offers = [[Offer(ranges_of(_shard(r, 2, 30)), kinds_of(_shard(r, 2, 30)))] if r < 2 else [] for r in range(3)]
        wanted = [ranges_of(_shard(r, 3, 30)) for r in range(3)]
        moves, problem = plan_moves(offers, wanted)
        assert not problem
        try:
            got = run_moves(moves, offers, held, rank, [0, 1, 2], None, wanted[rank], (rank, 3), corrupt and rank == 0)
        except StateError as exc:
            out.put((rank, "error", str(exc)))
            return
        values = cut([got.shard], wanted[rank])["w"]
        out.put((rank, values["param"].tolist(), values["exp_avg"].tolist(), got.received_bytes, got.kept_bytes))
    finally:
        dist.destroy_process_group()


def _run(corrupt: bool) -> dict[int, tuple[Any, ...]]:
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_grow_rank, args=(r, port, corrupt, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        found = out.get(timeout=60)
        results[found[0]] = found[1:]
    for p in procs:
        p.join(timeout=30)
    return results


def test_a_grow_gives_each_rank_only_its_range() -> None:
    results = _run(corrupt=False)
    for rank in range(3):
        param, exp_avg, *_ = results[rank]
        assert param == [float(v) for v in range(10 * rank, 10 * rank + 10)]
        assert exp_avg == [-v for v in param]
    # Rank 0 keeps [0, 10) of its own; rank 1 keeps [10, 15) and receives [15, 20); rank 2
    # receives [20, 30): 8 bytes per element (two fp32 tensors), nothing more.
    assert [results[r][2:] for r in range(3)] == [(0, 80), (40, 40), (80, 0)]


def test_a_corrupted_message_is_refused() -> None:
    results = _run(corrupt=True)
    # Rank 0's damaged message goes to rank 1 only; its own range [0, 10) is untouched.
    assert results[1][0] == "error" and "fail their checksum" in results[1][1]
    assert results[0][0] == list(map(float, range(10)))
