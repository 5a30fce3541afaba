"""A shard's training state sent from its source rank to the ranks of its data-parallel group
that lack it, as the tensors' own bytes (``reform.exchange_state``'s transfer).

The state dict travels in two parts:

* its *skeleton* (``tensor_bytes``): everything but the tensors' contents, small, serialized;
* its tensors' bytes, in order. A tensor of at least ``DIRECT_BYTES`` is broadcast from its
  own memory in slices of at most ``CHUNK_BYTES``, into the receiver's buffer for it; smaller
  ones are packed into shared chunks. Nothing of the bulk is pickled, and no rank holds a
  second copy of the whole shard.

Before the bulk, the source broadcasts a header (a status, the tensor count, the skeleton's
length and CRC-32) and a table of (bytes, dtype) per tensor, which alone fixes the sequence of
broadcasts: a receiver that cannot use what it gets still takes part in every one of them, so
a failure never leaves the group's collectives out of step. After the bulk the source
broadcasts the CRC-32 of every unit it sent; a receiver compares them with its own. Measured
on this machine: CRC-32 runs at about 2.5 GB/s against sha256's 1.1, and ``torch.save`` /
``torch.load`` of a state at about 1 / 1.5 GB/s, which the direct path skips.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unicron.trainer.tensor_bytes import DTYPES, StateError, bytes_of, crc, decode, encode

# A unit of the bulk: bounded, so that a shard of many GB never needs a second whole copy on
# the device, and large enough that the per-broadcast overhead does not matter.
CHUNK_BYTES = 64 << 20
# Tensors at least this large go from their own memory; smaller ones share packed chunks
# (an optimizer holds hundreds of small tensors, each a broadcast's latency on its own).
DIRECT_BYTES = 1 << 20
_OK, _REFUSED = 1, 0


@dataclass(frozen=True)
class _Unit:
    """One broadcast of the bulk: whole tensors packed (``direct`` False) or a slice of one."""

    direct: bool
    parts: tuple[tuple[int, int, int], ...]  # (tensor index, first byte, bytes)

    @property
    def size(self) -> int:
        return sum(n for _, _, n in self.parts)


def _units(sizes: list[int]) -> list[_Unit]:
    """The broadcasts that move tensors of these byte sizes, the same on every rank."""
    units: list[_Unit] = []
    packed: list[tuple[int, int, int]] = []
    packed_bytes = 0
    for index, size in enumerate(sizes):
        if size >= DIRECT_BYTES:
            units.extend(_Unit(True, ((index, start, min(CHUNK_BYTES, size - start)),)) for start in _starts(size))
            continue
        if packed and packed_bytes + size > CHUNK_BYTES:
            units.append(_Unit(False, tuple(packed)))
            packed, packed_bytes = [], 0
        packed.append((index, 0, size))
        packed_bytes += size
    if packed:
        units.append(_Unit(False, tuple(packed)))
    return units


def _starts(size: int) -> Iterator[int]:
    return iter(range(0, size, CHUNK_BYTES))


class _Wire:
    """Broadcasts over one group from one source, through the backend's device (NCCL: the GPU;
    gloo: host memory, in place)."""

    def __init__(self, src: int, group: Any, device: torch.device) -> None:
        self.src, self.group, self.device = src, group, device
        self.sending = dist.get_rank() == src

    def tensor(self, data: torch.Tensor) -> torch.Tensor:
        """Broadcasts ``data`` (the source's) into ``data`` (a receiver's buffer of its size)."""
        if self.device.type == "cpu":
            dist.broadcast(data, src=self.src, group=self.group)
            return data
        moved = data.to(self.device)
        dist.broadcast(moved, src=self.src, group=self.group)
        if not self.sending:
            data.copy_(moved.cpu())
        return data

    def ints(self, values: list[int] | None, count: int) -> list[int]:
        if count == 0:
            return []
        data = torch.tensor(values, dtype=torch.int64) if values is not None else torch.zeros(count, dtype=torch.int64)
        return [int(v) for v in self.tensor(data)]


def broadcast_state(
    state: dict[str, Any] | None, src: int, group: Any, device: torch.device, corrupt: bool = False
) -> dict[str, Any] | None:
    """Sends ``state`` from global rank ``src`` over ``group`` (None: the world): the source
    returns None, every other member the state it received, checked unit by unit (StateError
    otherwise, after every broadcast took place). ``corrupt`` flips one byte of one unit the
    source sends after its checksum was taken (fault injection; the source's state is left
    as it is)."""
    wire = _Wire(src, group, device)
    tensors: list[torch.Tensor] = []
    header: list[int] | None = None
    skeleton_bytes = b""
    if wire.sending:
        header = [_REFUSED, 0, 0, 0]
        try:
            if state is None:
                raise StateError("the source holds no state")
            skeleton_bytes, tensors = encode(state)
            header = [_OK, len(tensors), len(skeleton_bytes), zlib.crc32(skeleton_bytes)]
        except StateError:
            tensors = []
    status, count, skeleton_len, skeleton_crc = wire.ints(header, 4)
    if status != _OK:
        if wire.sending:
            return None
        raise StateError("the source could not send its state")
    table = wire.ints(
        [v for t in tensors for v in (t.numel() * t.element_size(), DTYPES.index(t.dtype))] if wire.sending else None,
        2 * count,
    )
    sizes, codes = table[0::2], table[1::2]
    skeleton = torch.frombuffer(bytearray(skeleton_bytes), dtype=torch.uint8) if wire.sending else None
    skeleton = wire.tensor(skeleton if skeleton is not None else torch.zeros(skeleton_len, dtype=torch.uint8))
    if not wire.sending:
        tensors = [torch.empty(max(0, size), dtype=torch.uint8) for size in sizes]
    units = _units(sizes)
    crcs = [_send_unit(wire, unit, tensors, corrupt and i == len(units) // 2) for i, unit in enumerate(units)]
    expected = wire.ints(crcs if wire.sending else None, len(crcs))
    if wire.sending:
        return None
    problems = [i for i, (got, want) in enumerate(zip(crcs, expected, strict=True)) if got != want]
    if problems:
        raise StateError(f"state is corrupt: {len(problems)} of {len(crcs)} chunks fail their CRC-32")
    raw = skeleton.numpy().tobytes()
    if zlib.crc32(raw) != skeleton_crc:
        raise StateError("state is corrupt: its skeleton fails its CRC-32")
    try:
        typed = [flat.view(DTYPES[code]) for flat, code in zip(tensors, codes, strict=True)]
    except Exception as exc:  # noqa: BLE001 - a bad table makes the state unusable
        raise StateError(f"state cannot be decoded: {exc}") from None
    return decode(raw, typed)


def _send_unit(wire: _Wire, unit: _Unit, tensors: list[torch.Tensor], corrupt: bool) -> int:
    """One unit of the bulk; the CRC-32 of what this rank sent or received."""
    if unit.direct:
        ((index, start, size),) = unit.parts
        if wire.sending:
            data = bytes_of(tensors[index])[start : start + size]
            checksum = crc(data)
            if corrupt:
                data = _flipped(data)
            wire.tensor(data)
            return checksum
        data = wire.tensor(tensors[index][start : start + size])
        return crc(data)
    if wire.sending:
        packed = torch.cat([bytes_of(tensors[index]) for index, _, _ in unit.parts]) if unit.parts else None
        assert packed is not None
        checksum = crc(packed)
        wire.tensor(_flipped(packed) if corrupt else packed)
        return checksum
    packed = wire.tensor(torch.empty(unit.size, dtype=torch.uint8))
    offset = 0
    for index, _, size in unit.parts:
        tensors[index].copy_(packed[offset : offset + size])
        offset += size
    return crc(packed)


def _flipped(data: torch.Tensor) -> torch.Tensor:
    """A copy of ``data`` with its middle byte inverted (the source's own state stays intact)."""
    copy = data.clone()
    if copy.numel():
        copy[copy.numel() // 2] ^= 0xFF
    return copy
