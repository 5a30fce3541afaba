"""Buddy copies' pure parts (unicron/trainer/buddy.py): the buffer a shard travels in and its
checksum (who is whose: test_buddy_map.py). The copies through real trainers:
tests/trainer/test_exactness.py."""

from __future__ import annotations

import pytest
import torch

from unicron.trainer.buddy import Copy, buffer_bytes, checksum, fill, layout_of, unflatten
from unicron.trainer.optimizer_shards import shard_state


def _shard() -> dict:
    return shard_state(
        1,
        2,
        {
            "w": (10, 5, 10, {"param": torch.arange(5.0), "exp_avg": torch.ones(5), "exp_avg_sq": torch.zeros(5)}),
            "b": (3, 0, 3, {"param": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)}),
        },
    )


def test_a_shard_travels_in_one_buffer_and_comes_back_whole() -> None:
    shard = _shard()
    layout = layout_of(shard)
    buffer = torch.empty(buffer_bytes(layout), dtype=torch.uint8)
    assert buffer.numel() % 8 == 0
    fill(buffer, shard)
    back = unflatten(layout, buffer, 1, 2)
    assert back["data_parallel"] == [1, 2]
    for name, piece in shard["pieces"].items():
        got = back["pieces"][name]
        assert (got["numel"], got["start"], got["end"]) == (piece["numel"], piece["start"], piece["end"])
        for key, tensor in piece["tensors"].items():
            assert got["tensors"][key].dtype == tensor.dtype and got["tensors"][key].equal(tensor)


def test_a_copy_that_fails_its_checksum_is_never_used() -> None:
    shard = _shard()
    layout = layout_of(shard)
    buffer = torch.empty(buffer_bytes(layout), dtype=torch.uint8)
    fill(buffer, shard)
    copy = Copy((1, 2), (0, 0), 7, layout, buffer, checksum(buffer))
    assert copy.shard()["pieces"]["w"]["tensors"]["param"].equal(torch.arange(5.0))
    buffer[3] ^= 0x10  # a flipped bit in host memory
    with pytest.raises(ValueError, match="fails its checksum"):
        copy.shard()
