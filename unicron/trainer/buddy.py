"""Buddy copies: every data-parallel rank's optimizer shard, kept each iteration in the host
memory of a data-parallel peer on another node or failure domain (docs/architecture.md:
Sharded state).

Under Megatron's distributed optimizer a rank's shard (its range of the fp32 main parameters
and Adam's moments) is in no peer's memory, nor under FSDP2 its range of every parameter and
moment (the trainer's ``shard_to_copy``): lose the rank and only a snapshot or the checkpoint
has it. Here each rank of a slice's data-parallel group also keeps the shard of the peer
``shift`` places before it, where ``shift`` is the smallest that puts every rank's buddy in
another failure domain where the job's nodes have domains that allow it, else on another node
(``unicron/buddy_map.py``: the same function the coordinator writes the job's map with; the
ranks tell each other their node and domain, which the agent sets, once per process group).
At the start of each iteration (inside the step's failure handling, so a peer lost during it
is a failed step) a rank copies its shard into a buffer, takes its checksum and exchanges it
with its buddies: a copy is of the iteration the live ranks hold.

A copy is the shard's tensors as one byte buffer with its layout (the pieces' names, element
ranges and tensors), the shard's (data-parallel rank, degree), its slice and iteration, and a
checksum taken by the sender. ``exchange_state`` (reform.py) counts a copy as a holder of that
shard at that iteration, beside the ranks' own shards, so a restart, a shrink and a grow all
take the lost ranks' shards from their buddies through the same plan (``pieces_to_exchange``),
and a copy whose checksum fails, or of another job layout or iteration, is never loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unicron.buddy_map import choose_shift
from unicron.trainer.optimizer_shards import shard_state

log = logging.getLogger(__name__)

# (name, numel, start, end, ((tensor key, dtype name, elements), ...)) per piece, in order.
Layout = tuple[tuple[str, int, int, int, tuple[tuple[str, str, int], ...]], ...]


def checksum(flat: torch.Tensor) -> int:
    """The checksum of a byte buffer whose length is a multiple of 8: the wrapping sum of its
    64-bit words. Summed in about 2 ms per 60 MB here, where CRC-32 took most of a second and
    a sum of 32-bit words 50 ms; it catches a flipped bit or a lost chunk, not a forgery."""
    return int(flat.view(torch.int64).sum())


def layout_of(shard: dict[str, Any]) -> Layout:
    """The layout of a shard's buffer: its pieces in name order, their tensors in key order."""
    return tuple(
        (
            name,
            int(piece["numel"]),
            int(piece["start"]),
            int(piece["end"]),
            tuple(
                (key, str(tensor.dtype).removeprefix("torch."), tensor.numel())
                for key, tensor in sorted(piece["tensors"].items())
            ),
        )
        for name, piece in sorted(shard["pieces"].items())
    )


def buffer_bytes(layout: Layout) -> int:
    """The bytes a buffer of ``layout`` takes, rounded up to whole 64-bit words."""
    size = sum(
        elements * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        for *_, keys in layout
        for _, dtype, elements in keys
    )
    return (size + 7) // 8 * 8


def fill(buffer: torch.Tensor, shard: dict[str, Any]) -> None:
    """Copies a shard's tensors into ``buffer`` (of its layout's size) in layout order."""
    at = 0
    for _, piece in sorted(shard["pieces"].items()):
        for _, tensor in sorted(piece["tensors"].items()):
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            buffer[at : at + flat.numel()].copy_(flat)
            at += flat.numel()
    buffer[at:].zero_()


def unflatten(layout: Layout, flat: torch.Tensor, rank: int, degree: int) -> dict[str, Any]:
    """The shard a buffer holds (views into ``flat``)."""
    pieces = {}
    at = 0
    for name, numel, start, end, keys in layout:
        tensors = {}
        for key, dtype_name, elements in keys:
            dtype = getattr(torch, dtype_name)
            size = elements * torch.empty(0, dtype=dtype).element_size()
            # A copy: a view at an offset the dtype's alignment does not divide cannot be made.
            tensors[key] = flat[at : at + size].clone().view(dtype)
            at += size
        pieces[name] = (numel, start, end, tensors)
    if (at + 7) // 8 * 8 != flat.numel():
        raise ValueError(f"the buffer holds {flat.numel()} bytes, its layout {at}")
    return shard_state(rank, degree, pieces)


@dataclass
class Copy:
    """A peer's optimizer shard as this rank keeps it."""

    owner: tuple[int, int]  # (data-parallel rank, degree) the shard was taken at
    slice: tuple[int, int]  # (tensor, pipeline) rank of the model slice it belongs to
    iteration: int
    layout: Layout
    flat: torch.Tensor
    checksum: int

    def shard(self) -> dict[str, Any]:
        """The shard, once its checksum holds; ValueError otherwise."""
        if checksum(self.flat) != self.checksum:
            raise ValueError(f"the buddy copy of data-parallel rank {self.owner[0]} fails its checksum")
        return unflatten(self.layout, self.flat, *self.owner)


@dataclass
class _Group:
    """What a data-parallel group's ranks told each other once: the buddy shift and every
    rank's layout (what its shard's buffer holds)."""

    group: Any
    ranks: list[int]
    shift: int
    layouts: list[Layout]


class BuddyCopies:
    """This rank's copy of its buddy's shard. ``refresh`` (collective over the data-parallel
    group, at the start of each iteration) copies this rank's shard into a buffer, takes its
    checksum, sends it to its buddy and receives the shard of the rank it is buddy of.
    ``node``: this rank's node; ``enabled``: the job's replication is 2.

    Synchronous, between steps: tried in flight beside the step, the copy competed with the
    step for this machine's two cores and took longer in all (26% of a 10M-parameter
    iteration against 20%), and a failure while it flew left no copy at all."""

    def __init__(self, node: str, enabled: bool = True, domain: str = "") -> None:
        self.node = node
        self.domain = domain
        self.enabled = enabled
        self.copy: Copy | None = None
        self._group: _Group | None = None
        self._send: torch.Tensor | None = None
        self._receive: torch.Tensor | None = None
        self.seconds = 0.0  # spent refreshing, for the overhead the job reports
        self.transfer_seconds = 0.0  # of which moving the bytes
        self.refreshes = 0

    @property
    def held_bytes(self) -> int:
        """Host memory the copies take: the buddy's copy and this rank's send buffer."""
        return sum(b.numel() for b in (self._send, self._receive) if b is not None)

    def regroup(self) -> None:
        """The process group changed (a reform): learn the new one at the next refresh. The
        copy held stays: the reform may have needed it, and a later one still may."""
        self._group = None

    def refresh(self, trainer: Any) -> None:
        """Collective over ``trainer``'s data-parallel group: sends this rank's shard to its
        buddy and keeps the shard of the rank whose buddy it is."""
        if not self.enabled or trainer.data_parallel_size < 2:
            return
        began = time.perf_counter()
        own = trainer.shard_to_copy()
        if own is None:
            return
        size, rank = trainer.data_parallel_size, trainer.data_parallel_rank
        # Learned again when the layout changed: an optimizer may make its state at its first
        # step (torch's Adam does), which every rank of the group takes at once.
        layout = layout_of(own)
        known = self._group
        if known is None or known.layouts[rank] != layout:
            known = self._learn(trainer, layout)
        if not known.shift:
            return
        source = (rank - known.shift) % size
        if self._send is None or self._send.numel() != buffer_bytes(known.layouts[rank]):
            self._send = torch.empty(buffer_bytes(known.layouts[rank]), dtype=torch.uint8)
        if self._receive is None or self._receive.numel() != buffer_bytes(known.layouts[source]):
            self._receive = torch.empty(buffer_bytes(known.layouts[source]), dtype=torch.uint8)
        fill(self._send, own)
        sent_sum = torch.tensor([checksum(self._send)], dtype=torch.int64)
        got_sum = torch.empty(1, dtype=torch.int64)
        self.copy = None  # its buffer is about to be written
        to, frm = known.ranks[(rank + known.shift) % size], known.ranks[source]
        moving = time.perf_counter()
        ops = [
            dist.P2POp(dist.isend, self._send, to, known.group),
            dist.P2POp(dist.isend, sent_sum, to, known.group),
            dist.P2POp(dist.irecv, self._receive, frm, known.group),
            dist.P2POp(dist.irecv, got_sum, frm, known.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        self.transfer_seconds += time.perf_counter() - moving
        self.copy = Copy(
            (source, size), trainer.shard, trainer.iteration, known.layouts[source], self._receive, int(got_sum)
        )
        self.seconds += time.perf_counter() - began
        self.refreshes += 1

    def _learn(self, trainer: Any, layout: Layout) -> _Group:
        """Collective over the data-parallel group: each rank's node and layout."""
        group = trainer.data_parallel_group()
        ranks = list(dist.get_process_group_ranks(group))
        told: list[Any] = [None] * len(ranks)
        dist.all_gather_object(told, (self.node, self.domain, layout), group=group)
        shift, level = choose_shift([node for node, _, _ in told], [domain for _, domain, _ in told])
        if not shift:
            log.warning("no data-parallel peer on another node: optimizer shards have no buddy copy")
        else:
            log.info("buddy copies placed", extra={"shift": shift, "apart_by": level})
        self._group = _Group(group, ranks, shift, [entry for *_, entry in told])
        return self._group

    def summary(self) -> dict[str, Any]:
        """What the copies cost this rank: the memory they take and the time spent on them."""
        return {
            "held_bytes": self.held_bytes,
            "copy_bytes": 0 if self._receive is None else self._receive.numel(),
            "refreshes": self.refreshes,
            "refresh_seconds": round(self.seconds, 4),
            "transfer_seconds": round(self.transfer_seconds, 4),
        }
