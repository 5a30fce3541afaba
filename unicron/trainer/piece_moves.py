"""Moving named pieces between ranks: a plan of element ranges from the shards the ranks hold
to the ranges each must own, and its execution point to point (docs/architecture.md: Sharded
state).

A shard is a set of pieces, each a range ``[start, end)`` of one parameter's flattened
elements with its tensors (``optimizer_shards``). ``plan_moves`` is pure: given what every
member of a group can send (its own shard, a buddy copy it keeps) and the ranges every member
must own, it picks for each wanted range the pieces that cover it, the receiver's own first
(no bytes move), then the sender covering the most, and names what no piece covers. Every
member computes the same plan from the same table. ``run_moves`` then sends each pair of
ranks one message (every range one sends the other, every tensor of it, in plan order) with
the checksum of its bytes; a receiver assembles exactly the ranges it owns and checks every
message before anything is used. No rank receives a range it will not own, and no rank holds
more than its own shard and what it sends: the full gather onto one rank is what this
replaces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unicron.trainer.buddy import Copy, checksum
from unicron.trainer.optimizer_shards import SHARD_KEY, Holder, Ranges, data_parallel_of, ranges_of, shard_state
from unicron.trainer.tensor_bytes import StateError

log = logging.getLogger(__name__)

# What a held shard's tensors are, per parameter name: ((tensor key, dtype name), ...), in
# key order; the same for every piece of a parameter.
Kinds = dict[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Offer:
    """A shard a member can send: its ranges and what tensors each piece holds."""

    ranges: Ranges
    kinds: Kinds


@dataclass(frozen=True)
class Move:
    """Elements ``[start, end)`` of parameter ``name``, from offer ``offer`` of member
    ``sender`` to member ``receiver`` (indices into the group's members)."""

    sender: int
    offer: int
    receiver: int
    name: str
    start: int
    end: int


def kinds_of(shard: dict[str, Any]) -> Kinds:
    return {
        name: tuple((key, str(t.dtype).removeprefix("torch.")) for key, t in sorted(piece["tensors"].items()))
        for name, piece in shard["pieces"].items()
    }


def _cover(
    name: str, start: int, end: int, receiver: int, offers: Sequence[Sequence[Offer]]
) -> tuple[list[Move], int | None]:
    """The moves that cover ``[start, end)`` of ``name`` for ``receiver``, and the first
    element none covers (None when all are)."""
    candidates = [
        (sender != receiver, sender, index, lo, hi)
        for sender, held in enumerate(offers)
        for index, offer in enumerate(held)
        if name in offer.ranges
        for _, lo, hi in [offer.ranges[name]]
        if lo < end and hi > start
    ]
    moves: list[Move] = []
    at = start
    while at < end:
        reaching = [c for c in candidates if c[3] <= at < c[4]]
        if not reaching:
            return moves, at
        # The receiver's own piece first (it moves nothing), then the one reaching farthest.
        elsewhere, sender, index, _, hi = min(reaching, key=lambda c: (c[0], -c[4], c[1], c[2]))
        stop = min(hi, end)
        if elsewhere:  # hand over to the receiver's own piece where one begins
            stop = min([stop] + [c[3] for c in candidates if not c[0] and at < c[3] < stop])
        moves.append(Move(sender, index, receiver, name, at, stop))
        at = stop
    return moves, None


def plan_moves(offers: Sequence[Sequence[Offer]], wanted: Sequence[Ranges]) -> tuple[list[Move], str]:
    """Every move that gives each member (by index) the ranges it wants from what the members
    offer, and why that is impossible ("" when it is not: then the moves are all of it)."""
    moves: list[Move] = []
    for receiver, ranges in enumerate(wanted):
        for name, (numel, start, end) in sorted(ranges.items()):
            sizes = {o.ranges[name][0] for held in offers for o in held if name in o.ranges}
            if sizes - {numel}:
                return [], f"{name} has {sorted(sizes)} elements in the shards held, {numel} in this model"
            covered, gap = _cover(name, start, end, receiver, offers)
            if gap is not None:
                return [], f"{name} elements from {gap} are in no shard held"
            moves.extend(covered)
    return moves, ""


def _element_bytes(dtype_name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()


def message_bytes(moves: Sequence[Move], offers: Sequence[Sequence[Offer]]) -> int:
    """The bytes of one message carrying ``moves``, padded to whole 64-bit words (the checksum's)."""
    size = sum(
        (m.end - m.start) * _element_bytes(dtype) for m in moves for _, dtype in offers[m.sender][m.offer].kinds[m.name]
    )
    return (size + 7) // 8 * 8


def _fill(moves: Sequence[Move], offers: Sequence[Sequence[Offer]], held: Sequence[dict[str, Any]]) -> torch.Tensor:
    """One message: the moves' elements of the sender's held shards (``held``, in its offers'
    order), every tensor of each range in key order, zero-padded to whole 64-bit words."""
    data = torch.empty(message_bytes(moves, offers), dtype=torch.uint8)
    at = 0
    for m in moves:
        piece = held[m.offer]["pieces"][m.name]
        lo, hi = m.start - int(piece["start"]), m.end - int(piece["start"])
        for _, tensor in sorted(piece["tensors"].items()):
            flat = tensor.reshape(-1)[lo:hi].contiguous().view(torch.uint8)
            data[at : at + flat.numel()].copy_(flat)
            at += flat.numel()
    data[at:].zero_()
    return data


def _target(owned: dict[str, Any], name: str, key: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's tensor ``key`` of its piece ``name``, allocated on first use."""
    _, start, end, tensors = owned[name]
    if key not in tensors:
        tensors[key] = torch.empty(end - start, dtype=dtype)
    return tensors[key]


def _unpack(moves: Sequence[Move], data: torch.Tensor, kinds: Kinds, owned: dict[str, Any]) -> None:
    """Puts a message's elements into this rank's pieces (``owned``: name -> (numel, start,
    end, tensors)). A move that brings a whole piece's range is kept as a view into the
    message, not copied: at 100M parameters a fresh copy of a 617 MB shard cost about a
    second here, most of it faulting in new pages."""
    at = 0
    for m in moves:
        _, start, end, tensors = owned[m.name]
        for key, dtype_name in kinds[m.name]:
            dtype, element = getattr(torch, dtype_name), _element_bytes(dtype_name)
            size = (m.end - m.start) * element
            whole = key not in tensors and (m.start, m.end) == (start, end)
            if whole and at % element == 0:
                tensors[key] = data[at : at + size].view(dtype)
            else:
                _target(owned, m.name, key, dtype)[m.start - start : m.end - start].view(torch.uint8).copy_(
                    data[at : at + size]
                )
            at += size


def _copy_local(move: Move, held: Sequence[dict[str, Any]], owned: dict[str, Any]) -> int:
    """Copies a move this rank makes to itself straight into its pieces; the bytes copied."""
    piece = held[move.offer]["pieces"][move.name]
    lo = move.start - int(piece["start"])
    start = owned[move.name][1]
    copied = 0
    for key, source in piece["tensors"].items():
        target = _target(owned, move.name, key, source.dtype)[move.start - start : move.end - start]
        if target.dtype != source.dtype:
            raise StateError(f"{move.name}'s {key} is held as {source.dtype}, this rank holds {target.dtype}")
        target.copy_(source.reshape(-1)[lo : lo + move.end - move.start])
        copied += target.numel() * target.element_size()
    return copied


@dataclass
class Received:
    """What ``run_moves`` gave this rank: its shard, and the bytes it kept and received."""

    shard: dict[str, Any]
    kept_bytes: int
    received_bytes: int
    senders: int
    wire_seconds: float = 0.0


def run_moves(
    moves: Sequence[Move],
    offers: Sequence[Sequence[Offer]],
    held: Sequence[dict[str, Any]],
    me: int,
    members: Sequence[int],
    group: Any,
    wanted: Ranges,
    place: tuple[int, int],
    corrupt: bool = False,
) -> Received:
    """Collective over ``group`` (whose global ranks are ``members``; this rank is
    ``members[me]``, holding the shards ``held`` in its offers' order): sends and receives
    ``moves``, and returns the shard of ``wanted`` taken at ``place`` (data-parallel rank,
    degree). StateError when a message fails its checksum, after every send and receive.
    ``corrupt`` flips one byte of the first message this rank sends after its checksum was
    taken (fault injection)."""
    kinds = {name: kind for held_by in offers for o in held_by for name, kind in o.kinds.items()}
    # Each piece's tensors come into being as the moves fill them (see _unpack).
    owned: dict[str, Any] = {name: (numel, start, end, {}) for name, (numel, start, end) in wanted.items()}
    pairs: dict[tuple[int, int], list[Move]] = {}
    for m in moves:
        pairs.setdefault((m.sender, m.receiver), []).append(m)
    requests: list[Any] = []
    inbound: list[tuple[list[Move], torch.Tensor, torch.Tensor]] = []
    outbound: list[torch.Tensor] = []  # alive until their sends complete
    # Receives first, so no sender's bytes wait for a buffer; then each message sent as soon
    # as it is packed; then this rank's own pieces, copied while the bytes travel.
    for (sender, receiver), group_moves in sorted(pairs.items()):
        if receiver == me != sender:
            data = torch.empty(message_bytes(group_moves, offers), dtype=torch.uint8)
            total = torch.empty(1, dtype=torch.int64)
            requests += [dist.irecv(t, members[sender], group=group) for t in (data, total)]
            inbound.append((group_moves, data, total))
    wire = time.perf_counter()
    for (sender, receiver), group_moves in sorted(pairs.items()):
        if sender == me != receiver:
            data = _fill(group_moves, offers, held)
            total = torch.tensor([checksum(data)], dtype=torch.int64)
            if corrupt and data.numel():
                data[data.numel() // 2] ^= 0xFF
                corrupt = False
            requests += [dist.isend(t, members[receiver], group=group) for t in (data, total)]
            outbound += [data, total]
    kept = sum(_copy_local(m, held, owned) for m in pairs.get((me, me), []))
    for request in requests:
        request.wait()
    # The wire (from posting to completing the sends and receives, this rank's own copies
    # overlapped), for throughput reports.
    wire = time.perf_counter() - wire
    for group_moves, data, total in inbound:
        if checksum(data) != int(total):
            raise StateError(f"the optimizer pieces from rank {members[group_moves[0].sender]} fail their checksum")
        _unpack(group_moves, data, kinds, owned)
    for name, (_, _, _, tensors) in owned.items():
        if {key for key, _ in kinds[name]} - tensors.keys():  # cannot happen by the plan
            raise StateError(f"no move brought all of {name}")
    return Received(
        shard_state(*place, owned),
        kept_bytes=kept,
        received_bytes=sum(d.numel() for _, d, _ in inbound),
        senders=len(inbound),
        wire_seconds=wire,
    )


def shard_held(own: dict[str, Any] | None, copy: Copy | None, key: tuple[int, int]) -> dict[str, Any]:
    """The shard taken at ``key`` (data-parallel rank, degree) that this rank holds: its own,
    (``own``) or the buddy copy it keeps (checked against the sender's checksum)."""
    if own is not None and data_parallel_of(own) == key:
        return own
    if copy is not None and copy.owner == key:
        try:
            return copy.shard()
        except ValueError as exc:
            raise StateError(str(exc)) from None
    raise StateError(f"holds no optimizer shard of data-parallel rank {key[0]} of {key[1]}")


def reshard(holders: list[Holder], own: dict[str, Any] | None, copy: Copy | None, trainer: Any) -> dict[str, Any]:
    """Collective over ``trainer``'s data-parallel group: the shard this rank owns now, its
    ranges taken from the shards the holders send (their own or a buddy copy) by the plan of
    point-to-point moves above. StateError, the same on every rank, when a holder's shard is
    unusable or the shards held do not cover every rank's ranges; after the moves, when a
    message fails its checksum."""
    rank = dist.get_rank()
    mine: list[dict[str, Any]] = []
    problem = ""
    for holder, key in holders:
        if holder == rank:
            try:
                mine.append(shard_held(own, copy, key))
            except StateError as exc:
                problem = problem or f"rank {rank}: {exc}"
    return reshard_offers(mine, trainer, problem)


def reshard_offers(mine: list[dict[str, Any]], trainer: Any, problem: str = "") -> dict[str, Any]:
    """Collective over ``trainer``'s data-parallel group: every rank offers the shards it
    holds (``mine``: from memory, a buddy copy, a snapshot file, whatever their source) and
    gets the shard of the ranges it owns now. ``problem``: why this rank cannot take part
    (every rank then raises it as StateError before anything moves)."""
    group = trainer.data_parallel_group()
    members = list(dist.get_process_group_ranks(group))
    rank = dist.get_rank()
    wanted = ranges_of(trainer.state_dict()[SHARD_KEY])
    told: list[Any] = [None] * len(members)
    offers = [] if problem else [Offer(ranges_of(s), kinds_of(s)) for s in mine]
    dist.all_gather_object(told, (offers, wanted, problem), group=group)
    problem = next((said for _, _, said in told if said), "")
    if problem:
        raise StateError(problem)
    moves, problem = plan_moves([o for o, _, _ in told], [w for _, w, _ in told])
    if problem:
        raise StateError(f"the optimizer shards held cannot be resharded: {problem}")
    began = time.perf_counter()
    got = run_moves(
        moves,
        [o for o, _, _ in told],
        mine,
        members.index(rank),
        members,
        group,
        wanted,
        (trainer.data_parallel_rank, trainer.data_parallel_size),
    )
    log.info(
        "optimizer shard resharded",
        extra={
            "kept_bytes": got.kept_bytes,
            "received_bytes": got.received_bytes,
            "senders": got.senders,
            "seconds": round(time.perf_counter() - began, 4),
            "wire_seconds": round(got.wire_seconds, 4),
        },
    )
    return got.shard
