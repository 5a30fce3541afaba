"""A training state as a small *skeleton* plus its tensors' own bytes: the form in which a
state moves to a peer (``transfer``) and is written to a node's memory (``snapshot``).

The skeleton is the state dict with each tensor replaced by a marker (its index and shape):
keys, Python values and shapes, small, serialized with ``torch.save`` and decoded with
``torch.load(weights_only=True)``, as checkpoints are. The tensors travel apart, as flat bytes
with a CRC-32 each, so the bulk is never pickled and never copied into one blob. Measured on
this machine at 1.2 GB: ``torch.save`` to memory 1.5 s and sha256 1.1 s, against a raw write
0.4 s and CRC-32 0.6 s (``zlib.crc32`` also lets other threads run while it works)."""

from __future__ import annotations

import io
import zlib
from typing import Any

import torch

MARKER = "__unicron_tensor__"
# The dtypes a state may hold, by a code that is fixed once written (append only).
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


class StateError(Exception):
    """Transferred or stored state that must not be used, and why."""


def skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its marker; the tensors appended, in order."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.dtype not in DTYPES:
            raise StateError(f"cannot send a {value.layout} tensor of {value.dtype}")
        tensors.append(value.detach().contiguous())
        return {MARKER: len(tensors) - 1, "shape": list(value.shape)}
    if isinstance(value, dict):
        return {key: skeleton(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(skeleton(item, tensors) for item in value)
    return value


def filled(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with its markers replaced by ``tensors`` (flat, typed), viewed in shape."""
    if isinstance(value, dict):
        if MARKER in value:
            index, shape = value[MARKER], value["shape"]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise StateError(f"the state's skeleton names tensor {index!r}, of {len(tensors)}")
            flat = tensors[index]
            if flat.numel() != torch.Size(shape).numel():
                raise StateError(f"tensor {index} has {flat.numel()} elements, its shape {shape} needs more or fewer")
            return flat.view(shape)
        return {key: filled(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(filled(item, tensors) for item in value)
    return value


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The serialized skeleton of ``state`` and its tensors (contiguous, in marker order)."""
    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    torch.save(skeleton(state, tensors), buffer)
    return buffer.getvalue(), tensors


def decode(raw: bytes, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The state from a serialized skeleton and its tensors (typed); StateError when it cannot
    be decoded or is not a dict."""
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure makes the state unusable
        raise StateError(f"state cannot be decoded: {exc}") from None
    state = filled(value, tensors)
    if not isinstance(state, dict):
        raise StateError("state is not a dict")
    return state


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory."""
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def crc(data: torch.Tensor) -> int:
    """CRC-32 of a flat uint8 tensor's bytes."""
    return zlib.crc32(data.cpu().numpy().data) if data.numel() else 0
