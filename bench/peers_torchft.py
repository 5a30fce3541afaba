"""One torchft replica group training the digits MLP, for `bench/peers.py` (`make bench-peers`).

    .cache/bench-peers-venv/bin/python -m bench.peers_torchft --group 0 --groups 2 \
        --lighthouse http://127.0.0.1:29510 --steps 40 --out-params /tmp/g0.pt

It runs in the bench's own venv (torch and torchft 0.2.0, no Unicron package): torchft is a
peer measured beside Unicron, never a dependency of the runtime. So it cannot import
`examples.digits.train` (which imports the trainer library, hence gRPC and Megatron); the
model and the data order are re-created here, and tests/unit/test_bench_peers.py checks that
they stay equal to the example's.

The replica group is one process (group world size 1) with a TCPStore of its own. Each step:
`Optimizer.zero_grad` starts torchft's quorum; the group takes its share of the step's global
batch (the same split as the Unicron Session: group g of G takes the g-th contiguous
1/G of the step's samples, addressed by global sample index, so the data follows the committed
step); the gradient all-reduce runs in torchft's DistributedDataParallel comm hook, averaged over
the quorum's participants; the optimizer and LR scheduler step only when
`Manager.should_commit()` says so. A group that restarts joins the quorum at step 0 and heals
from a live peer (model, optimizer, scheduler, step) through torchft's checkpoint transport.

With ``--fsdp`` the MLP is sharded with FSDP2 inside the group and the groups are HSDP's
replicas (``shard_in_group``, ``average_across_groups``): what a team training a sharded model under torchft runs. A
group restarted heals its shards from the live group's the same way.

Stdout: one JSON object per line (`event`: start, step, done), timed with time.time(), which
the bench parses; torchft's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def build_model(hidden: int) -> torch.nn.Module:
    """examples/digits/train.py's MLP, layer for layer (64 -> hidden -> hidden -> 10)."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


class Digits:
    """examples/digits/train.py's data: scikit-learn's 1,797 digits addressed by global sample
    index, each epoch in an order drawn from (seed, epoch)."""

    def __init__(self, seed: int) -> None:
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        self.images = torch.from_numpy(images.astype(np.float32) / 16.0)
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self._seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        picked = [int(self._order(g // n)[g % n]) for g in indices]
        return self.images[picked], self.labels[picked]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self._seed, epoch]).permutation(len(self))
        return self._orders[epoch]


def group_samples(step: int, group: int, groups: int, global_batch_size: int) -> range:
    """Group `group`'s global sample indices of `step` (1-based): as Session.samples() splits a
    step over data-parallel ranks, so a failure-free run sees the same batches as the others."""
    if global_batch_size % groups:
        raise ValueError(f"global batch {global_batch_size} does not split over {groups} groups")
    per_group = global_batch_size // groups
    first = (step - 1) * global_batch_size + group * per_group
    return range(first, first + per_group)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers_torchft", description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, required=True, help="this replica group's index")
    parser.add_argument("--groups", type=int, default=2, help="replica groups of the job (the data split)")
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://HOST:PORT")
    parser.add_argument("--steps", type=int, default=40, help="committed steps to train")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="collective and RPC timeout")
    parser.add_argument("--out-params", default="", help="final model state_dict here (torch.save)")
    parser.add_argument(
        "--stock-ddp", action="store_true", help="torchft's own DDP gradient hook (crashes on a failed all-reduce)"
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="HSDP: the MLP sharded with FSDP2 inside the group, torchft's managed all-reduce across the groups",
    )
    return parser.parse_args(argv)


def shard_in_group(model: torch.nn.Module, store: Any) -> None:
    """HSDP as torchft 0.2.0 builds it (its fsdp_test.py; torchtitan's ft manager), first half:
    FSDP2 shards ``model`` over the group's own ranks (here one: the group is one process).
    Before the optimizer is made: ``fully_shard`` replaces the parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.PrefixStore("shard", store), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def average_across_groups(model: torch.nn.Module, manager: Any) -> None:
    """Second half: a managed process group all-reduces each reduce-scattered gradient across
    the replica groups in FSDP's all-reduce hook, averaged over the quorum's participants. A
    failed all-reduce is kept by the manager (``should_commit`` then says no), not raised."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchft.process_group import ManagedProcessGroup

    replicate = ManagedProcessGroup(manager)
    replicate.register("dp_replicate")

    def across_groups(gradient: torch.Tensor) -> None:
        dist.all_reduce(gradient, group=replicate, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(across_groups)


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


def _tolerant_ddp(base: Any, group: int) -> Any:
    """torchft's DistributedDataParallel with its gradient hook fixed for a failed all-reduce.

    torchft 0.2.0's hook (torchft/ddp.py, `_comm_hook`) waits on the managed all-reduce and
    returns the future of its callback chain, asserting that the chain exists; when a peer dies
    inside the all-reduce, `_ManagedWork.wait()` catches the error, reports it to the manager and
    returns False before building the chain, so the assertion fails, backward() raises and the
    live replica group dies with the dead one (seen here with gloo: a peer killed during the
    all-reduce took the other group down). The manager already knows the step failed and
    should_commit() will discard it, which is torchft's design; so on that path this hook hands
    DDP the bucket as it is (its step is thrown away) and says so on stdout ("hook_error")."""
    import torch.distributed as dist

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        ok = work.wait()
        fut = work.get_future()
        # A managed future's chain, or (the manager had errored before) a plain one.
        chained = getattr(fut, "_fut", fut)
        if ok and chained is not None:
            return chained
        emit("hook_error", group=group, error=str(state.errored() or "")[:200])
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    # DDP checks a hook's annotations as objects; this module's are strings (postponed).
    hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

    class TolerantDDP(base):
        _comm_hook = staticmethod(hook)

    return TolerantDDP


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    started = time.time()
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    emit("start", group=args.group, pid=os.getpid(), imported_s=round(time.time() - started, 3))
    # Same seed in every group: identical initial weights, so the first quorum needs no sync
    # (init_sync=False); a restarted group heals from a peer anyway.
    torch.manual_seed(args.seed)
    model = build_model(args.hidden)
    # The group's own store (torchrun would provide one per replica group).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if args.fsdp:
        shard_in_group(model, store)
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=args.steps)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "scheduler": scheduler.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["scheduler"])

    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"digits_{args.group}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        init_sync=False,
    )
    managed = time.time()
    if args.fsdp:
        average_across_groups(model, manager)
        ddp = model
    else:
        ddp = (DistributedDataParallel if args.stock_ddp else _tolerant_ddp(DistributedDataParallel, args.group))(
            manager, model
        )
    optimizer = Optimizer(manager, inner)
    wrapped = time.time()
    data = Digits(args.seed)
    # Where a (re)start's time goes, up to the first quorum.
    emit(
        "ready",
        group=args.group,
        manager_s=round(managed - started, 3),
        ddp_s=round(wrapped - managed, 3),
        data_s=round(time.time() - wrapped, 3),
    )
    while manager.current_step() < args.steps:
        before = manager.current_step()
        optimizer.zero_grad()  # starts the quorum (and, for a restarted group, the heal)
        manager.wait_quorum()
        # After the quorum a healing group's step is the peers' (its state arrives by should_commit).
        step = manager.current_step() + 1
        participants = manager.num_participants()
        participating = manager.is_participating()
        images, labels = data.batch(group_samples(step, args.group, args.groups, args.global_batch_size))
        loss = F.cross_entropy(ddp(images), labels)
        loss.backward()  # the comm hook all-reduces over the quorum (a non-participant sends zeros)
        committed = manager.should_commit()
        if committed:
            inner.step()
            scheduler.step()
        emit(
            "step",
            group=args.group,
            step=step,
            committed=committed,
            participants=participants,
            participating=participating,
            healed=before == 0 and step > 1,
            loss=round(float(loss.item()), 6),
            errored=str(manager.errored() or "")[:200],
        )
    with torch.no_grad():
        eval_loss = float(F.cross_entropy(model(data.images), data.labels).item())
    if args.out_params:
        # Under FSDP2 the whole tensors (over a one-rank mesh, no peer is needed).
        whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        torch.save({k: v.detach().clone() for k, v in whole.items()}, args.out_params)
    emit("done", group=args.group, step=manager.current_step(), eval_loss=round(eval_loss, 6))
    manager.shutdown(wait=False)
    sys.stdout.flush()
    # torchft's server threads can hold the interpreter's exit; the results are written.
    os._exit(0)


if __name__ == "__main__":
    main()
