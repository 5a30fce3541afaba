"""The peer transfer of a shard's state (unicron/trainer/transfer.py): its plan of broadcasts
and its skeleton without processes, then two gloo ranks in spawned processes sending a state
bit for bit, refusing a corrupted one and a source that holds none."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from unicron.ports import free_port
from unicron.trainer import tensor_bytes, transfer


def test_small_tensors_share_chunks_and_large_ones_go_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 100)
    monkeypatch.setattr(transfer, "DIRECT_BYTES", 40)
    units = transfer._units([10, 30, 250, 0, 39, 39, 39])
    # Large tensors go out at once; small ones wait in the pack until it would pass a chunk.
    assert [(u.direct, u.parts) for u in units] == [
        (True, ((2, 0, 100),)),
        (True, ((2, 100, 100),)),
        (True, ((2, 200, 50),)),
        (False, ((0, 0, 10), (1, 0, 30), (3, 0, 0), (4, 0, 39))),
        (False, ((5, 0, 39), (6, 0, 39))),
    ]


def test_the_skeleton_keeps_everything_but_the_tensors_bytes() -> None:
    state = {"iteration": 3, "model": {"w": torch.ones(2, 3)}, "groups": [{"lr": 0.1, "params": (0, 1)}]}
    tensors: list[torch.Tensor] = []
    skeleton = tensor_bytes.skeleton(state, tensors)
    assert skeleton["model"]["w"] == {"__unicron_tensor__": 0, "shape": [2, 3]}
    assert skeleton["groups"] == [{"lr": 0.1, "params": (0, 1)}] and len(tensors) == 1
    flat = [t.reshape(-1) for t in tensors]
    assert torch.equal(tensor_bytes.filled(skeleton, flat)["model"]["w"], torch.ones(2, 3))
    with pytest.raises(tensor_bytes.StateError, match="shape"):
        tensor_bytes.filled(skeleton, [torch.ones(5)])
    with pytest.raises(tensor_bytes.StateError, match="cannot send"):
        tensor_bytes.skeleton({"s": torch.ones(2).to_sparse()}, [])


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(5)
    return {
        "iteration": 7,
        "model": {
            "big": torch.randn(300, 70, generator=generator),  # 84,000 bytes: direct, in slices
            "small": torch.randn(5, generator=generator, dtype=torch.float64),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "bf16": torch.randn(40, generator=generator).to(torch.bfloat16),
            "empty": torch.empty(0, 4),
        },
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "flag": torch.tensor([True, False])}}, "lr": 0.01},
    }


def _rank(rank: int, port: int, case: str, result: Any) -> None:
    import torch.distributed as dist

    transfer.CHUNK_BYTES = 32_000  # several slices and chunks even for a small state
    transfer.DIRECT_BYTES = 1_000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        sent = None if case == "nothing" else _state()
        got = transfer.broadcast_state(sent if rank == 0 else None, 0, None, torch.device("cpu"), case == "corrupt")
        if rank == 0:
            result.put(("sent", sent is not None and torch.equal(sent["model"]["big"], _state()["model"]["big"])))
            return
        assert got is not None
        expected = _state()
        same = all(
            torch.equal(got["model"][k], expected["model"][k]) and got["model"][k].dtype == expected["model"][k].dtype
            for k in expected["model"]
        )
        step = got["optimizer"]["state"][0]
        same = same and torch.equal(step["step"], torch.tensor(7.0)) and step["flag"].tolist() == [True, False]
        result.put(("received", same and got["iteration"] == 7 and got["optimizer"]["lr"] == 0.01))
    except tensor_bytes.StateError as exc:
        result.put(("refused", str(exc)))
    finally:
        dist.destroy_process_group()


def _run(case: str) -> dict[str, Any]:
    port = free_port()
    context = mp.get_context("spawn")
    result = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, port, case, result)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    outcomes = dict(result.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    return outcomes


def test_a_state_arrives_bit_for_bit_and_a_corrupted_or_missing_one_is_refused() -> None:
    assert _run("exact") == {"sent": True, "received": True}
    corrupt = _run("corrupt")
    # The source's own state is untouched by the injected fault; the receiver refuses.
    assert corrupt["sent"] is True and "1 of" in corrupt["refused"] and "CRC-32" in corrupt["refused"]
    assert _run("nothing") == {"sent": False, "refused": "the source could not send its state"}
