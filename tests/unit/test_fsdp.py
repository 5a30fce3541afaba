"""An FSDP2 model's state as named pieces (unicron/trainer/fsdp.py), over real gloo groups of
two processes: each rank's ranges of every parameter cover it exactly once; the state taken
from one model and loaded into a model built again (a reform's rebuild) continues bit for bit;
the two ranks' shards cut together give the whole parameters and Adam moments (what a shrink
to one rank loads); a buddy copy is the peer's whole shard; and a build function that does
not shard, or shards on another mesh, is refused in one line."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from unicron.redisutil import free_port
from unicron.trainer.buddy import BuddyCopies
from unicron.trainer.fsdp import FSDPTrainer
from unicron.trainer.optimizer_shards import SHARD_KEY, cut
from unicron.trainer.program import ProgramError

# Shapes whose rows do not split evenly over two ranks, and one that leaves a rank empty.
SHAPES = [(7, 5), (7,), (3, 7), (3,), (1, 4)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in SHAPES])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum()
        for w in self.weights:
            total = total + (w * w).sum() * x.mean()
        return total


def build(mesh: Any, shard: bool = True) -> tuple[Any, ...]:
    torch.manual_seed(3)
    model = Net()
    if shard:
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return model, optimizer, scheduler


def _step(trainer: FSDPTrainer, seed: int) -> None:
    torch.manual_seed(seed)
    trainer.model(torch.randn(4)).backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    trainer.scheduler.step()
    trainer.iteration += 1


def _locals(trainer: FSDPTrainer) -> list[torch.Tensor]:
    out = []
    for param in trainer.model.parameters():
        out.append(param.to_local().clone())  # type: ignore[attr-defined]
        for _, value in sorted(trainer.optimizer.state[param].items()):
            out.append(value.to_local().clone() if hasattr(value, "to_local") else value.clone())
    return out


def _checks(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = FSDPTrainer(build, "cpu", None)
        ranges = trainer.owned_ranges()
        for seed in (1, 2):
            _step(trainer, seed)
        state = trainer.state_dict()
        again = trainer.rebuild()
        again.load_state_dict(state)
        _step(trainer, 3)
        _step(again, 3)
        same = all(a.equal(b) for a, b in zip(_locals(trainer), _locals(again), strict=True))
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, trainer.state_dict()[SHARD_KEY])
        wanted = {name: (p.numel(), 0, p.numel()) for name, p in trainer.model.named_parameters()}
        whole = cut(gathered, wanted)
        full = {
            name: (p.full_tensor().reshape(-1), trainer.optimizer.state[p]["exp_avg"].full_tensor().reshape(-1))  # type: ignore[attr-defined]
            for name, p in trainer.model.named_parameters()
        }
        cut_right = all(whole[n]["param"].equal(full[n][0]) and whole[n]["exp_avg"].equal(full[n][1]) for n in full)
        copies = _buddy_copies(trainer, gathered[1 - rank])
        refusals = []
        for bad in (
            lambda mesh: build(mesh, shard=False),
            lambda mesh: build(init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))),
        ):
            try:
                FSDPTrainer(bad, "cpu", None)
            except ProgramError as exc:
                refusals.append(str(exc))
        out.put((rank, ranges, same, cut_right, refusals, again.scheduler.get_last_lr(), copies))
    finally:
        dist.destroy_process_group()


def _buddy_copies(trainer: FSDPTrainer, peers: dict[str, Any]) -> tuple[bool, bool, bool]:
    """With the ranks on two nodes: (the first copy, of a model not yet stepped, holds the
    parameters only; the next, after Adam made its moments, is the peer's whole shard; under
    HSDP there is nothing to copy)."""
    buddies = BuddyCopies(f"node-{dist.get_rank()}")
    buddies.refresh(trainer.rebuild())
    assert buddies.copy is not None
    params_only = {key for *_, keys in buddies.copy.layout for key, _, _ in keys} == {"param"}
    buddies.refresh(trainer)  # the layout changed: learned again
    assert buddies.copy is not None
    copied = buddies.copy.shard()["pieces"]
    whole = sorted(copied) == sorted(peers["pieces"]) and all(
        tensor.equal(peers["pieces"][name]["tensors"][key])
        for name, piece in copied.items()
        for key, tensor in piece["tensors"].items()
    )
    hsdp = FSDPTrainer(build, "cpu", None, shard_degree=1)
    shrunk_below = FSDPTrainer(build, "cpu", None, shard_degree=4)  # a world of 2 < 4: sharded whole
    return params_only, whole, hsdp.shard_to_copy() is None and shrunk_below.replicas == 1


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_checks, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    found = {}
    for _ in procs:
        rank, *rest = out.get(timeout=120)
        found[rank] = rest
    for p in procs:
        p.join(timeout=30)
    return found


def test_each_parameter_is_covered_once_by_the_ranks_ranges(results: dict[int, Any]) -> None:
    covered: dict[str, list[tuple[int, int]]] = {}
    for rank in (0, 1):
        for name, (numel, start, end) in results[rank][0].items():
            covered.setdefault(name, []).append((start, end))
            assert 0 <= start < end <= numel
    numels = {f"weights.{i}": torch.Size(s).numel() for i, s in enumerate(SHAPES)}
    for name, numel in numels.items():
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    # (1, 4): one row, all on rank 0; rank 1 holds no piece of it.
    assert "weights.4" not in results[1][0]


def test_a_rebuilt_model_continues_bit_for_bit(results: dict[int, Any]) -> None:
    assert results[0][1] and results[1][1]
    assert results[0][4] == results[1][4]  # the LR schedule came along


def test_the_shards_cut_together_are_the_whole_state(results: dict[int, Any]) -> None:
    assert results[0][2] and results[1][2]


def test_a_build_that_does_not_shard_or_uses_another_mesh_is_refused(results: dict[int, Any]) -> None:
    not_sharded, other_mesh = results[0][3]
    assert "is not sharded: call fully_shard" in not_sharded
    assert "sharded on another mesh" in other_mesh


def test_a_buddy_copy_is_the_peers_whole_shard(results: dict[int, Any]) -> None:
    for rank in (0, 1):
        params_only, whole, none_under_hsdp = results[rank][5]
        assert params_only, "before the first step a shard holds the parameters only"
        assert whole, "the copy differs from the peer's shard"
        assert none_under_hsdp, "under HSDP the other replica holds the shard: no copy; below a group, FSDP"
