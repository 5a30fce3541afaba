"""Session refuses a model it cannot heal: one sharded by FSDP2 (``fully_shard``), whose ranks
each hold part of it, is told apart from a plain replica (unicron/trainer/session.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from unicron.redisutil import free_port
from unicron.trainer.session import is_sharded


def _check(rank: int, port: int, out: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        sharded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(sharded, mesh=init_device_mesh("cpu", (2,)))
        out.put((rank, is_sharded(plain), is_sharded(sharded)))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_model_is_told_apart_from_a_replica() -> None:
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_check, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    found = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert found == [(0, False, True), (1, False, True)]
