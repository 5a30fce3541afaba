"""FSDP2 models under the plain PyTorch level (docs/trainer-library.md: Sharded models).

A model sharded with ``torch.distributed.fsdp.fully_shard`` lives on a device mesh, whose
process groups a reform destroys: the model cannot be kept, it must be built again on the new
mesh. So the user hands ``Session.register(build=...)`` a function that builds and shards the
model on a mesh and makes its optimizer (and LR scheduler); the session calls it at the start
and after every reform, and the loop takes the current objects from ``session.model`` and
``session.optimizer``.

Each rank holds a contiguous range of every parameter's flattened elements: FSDP2 shards dim 0
the way ``torch.chunk`` splits it (rows ``[r*c, (r+1)*c)``, ``c = ceil(rows / degree)``), and a
range of whole rows of a row-major tensor is a range of its elements. So a rank's state is the
same *optimizer shard* of named pieces that Megatron's distributed optimizer gives
(``optimizer_shards``): per parameter its range of the parameter itself and of each per-element
optimizer state (Adam's moments), with the replicated rest (the LR schedule, the step counts,
the hyperparameters) beside it. The runtime's state machinery then moves it as it moves a
distributed optimizer's shard: kept in place through a reattempt, cut by piece moves in a
resize, written one file per rank to a checkpoint and read back under any shard degree.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unicron import hsdp
from unicron.trainer.optimizer_shards import SHARD_KEY, Ranges, ShardError, cut, shard_state, shards_of
from unicron.trainer.plain_trainer import PlainLoopTrainer
from unicron.trainer.program import ProgramError, Training

# What the user's build function returns: (model, optimizer) or (model, optimizer, scheduler).
Build = Callable[[Any], tuple[Any, ...]]


def make_mesh(device: str, world_size: int, shard_degree: int = 0) -> Any:
    """The mesh the model is sharded on: 1-D over the whole world (``shard``) for FSDP, or for
    HSDP (``shard_degree`` ranks per shard group, fewer than the world) 2-D, ``replicate`` x
    ``shard``, each row a whole copy of the state. ProgramError when the world does not split
    into groups of ``shard_degree``. A world smaller than one shard group (a job shrunk below
    it) is sharded whole: its state still fits the pieces, and the job trains on."""
    from torch.distributed.device_mesh import init_device_mesh

    if shard_degree in (0, world_size) or 0 < world_size < shard_degree:
        return init_device_mesh(device, (world_size,), mesh_dim_names=("shard",))
    if shard_degree < 0 or not hsdp.fits(world_size, shard_degree):
        raise ProgramError(
            f"register(shard_degree={shard_degree}): the world of {world_size} ranks does not split into it"
        )
    return init_device_mesh(device, (world_size // shard_degree, shard_degree), mesh_dim_names=("replicate", "shard"))


def element_range(param: Any) -> tuple[int, int, int]:
    """(numel, start, end) of the elements of ``param`` (a DTensor) this rank holds, in the
    parameter's flattened row-major order. ProgramError for a sharding that is not of dim 0."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not isinstance(p, Shard | Replicate) or (isinstance(p, Shard) and p.dim != 0) for p in param.placements):
        raise ProgramError(
            f"a parameter is sharded as {param.placements}: Unicron heals FSDP2's default sharding"
            " of dim 0 (no shard_placement_fn of another dim)"
        )
    shape = tuple(param.shape)
    local, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    row = math.prod(shape[1:]) if shape else 1
    start = offset[0] * row if shape else 0
    return math.prod(shape), start, start + math.prod(local)


def _unpack(built: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise ProgramError("register(build=...): the build function returns (model, optimizer[, scheduler])")
    model, optimizer, scheduler = (*built, None) if len(built) == 2 else built
    if not isinstance(model, torch.nn.Module):
        raise ProgramError(f"register(build=...): the build function's model is a {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ProgramError(f"register(build=...): the build function's optimizer is a {type(optimizer).__name__}")
    return model, optimizer, scheduler


def _check(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: Any) -> None:
    """The build function's objects are what the session was told: every parameter a DTensor
    on the mesh it was given, and the optimizer over exactly those parameters."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise ProgramError(
                f"register(build=...): parameter {name} is not sharded: call fully_shard(module, mesh=mesh)"
                " on the model (and its blocks) with the mesh the build function gets"
            )
        if param.device_mesh != mesh:
            raise ProgramError(f"register(build=...): parameter {name} is sharded on another mesh than the one given")
    owned = {id(p) for p in model.parameters()}
    if not all(id(p) in owned for group in optimizer.param_groups for p in group["params"]):
        raise ProgramError("register(build=...): the optimizer updates parameters that are not the built model's")


class FSDPTrainer(PlainLoopTrainer):
    """The state of an FSDP2-sharded program as the runtime's state machinery takes a trainer:
    one (TP, PP) slice, every rank a data-parallel rank holding its shard of everything."""

    def __init__(
        self,
        build: Build,
        device: str,
        timeout: timedelta | None,
        training: Training | None = None,
        shard_degree: int = 0,
    ) -> None:
        """``training``: the job's settings (its ``checkpoint_format`` picks the persistent
        checkpoint's: Unicron's, or torch's DCP). ``shard_degree``: HSDP's ranks per shard
        group (0: the whole world, plain FSDP)."""
        self._build, self.training, self._shard_degree = build, training, shard_degree
        self.mesh = make_mesh(device, dist.get_world_size(), shard_degree)
        # (replica, shard rank, shard degree): under HSDP each replica's shard ranks hold the
        # pieces of that shard rank, so the data-parallel place of the state is the shard's.
        coordinate = self.mesh.get_coordinate() or [0]
        degree = self.mesh.size(-1)
        self.replica = int(coordinate[0]) if self.mesh.ndim == 2 else 0
        self._place = (int(coordinate[-1]), int(degree))
        model, optimizer, scheduler = _unpack(build(self.mesh))
        _check(model, optimizer, self.mesh)
        super().__init__(model, optimizer, scheduler, device, timeout)
        self.model.register_forward_hook(self._hook_backward_start)

    def _hook_backward_start(self, _module: Any, _inputs: Any, output: Any) -> None:
        # A hook on the root's output tensor runs as backward reaches it: before any of the
        # model's own backward (a module backward hook would warn when no input needs grad).
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._backward_starts)

    def _backward_starts(self, *_: Any) -> None:
        # FSDP reduces the gradients inside backward, layer by layer, and no rank updates
        # before every rank has: the start of backward is where the library sees the gradient
        # synchronization begin (and injects faults into it), with every rank's step redoable.
        if self.grad_sync_hook is not None:
            self.grad_sync_hook()

    @property
    def data_parallel_rank(self) -> int:
        """The rank within the shard group: which pieces this rank holds."""
        return self._place[0]

    @property
    def data_parallel_size(self) -> int:
        """The shard degree: into how many parts the state is cut."""
        return self._place[1]

    def data_parallel_group(self) -> Any:
        return None

    def layout(self) -> dict[str, Any]:
        """The model's parameter names and *global* shapes, digested: the same under any shard
        degree, and never that of a replicated Session's model."""
        shapes = [(name, list(p.shape)) for name, p in self.model.named_parameters()]
        digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
        return {"model": {"parameters": digest, "sharding": "fsdp2"}, "tensor_parallel": 1, "pipeline_parallel": 1}

    def _parameters(self) -> list[tuple[str, Any]]:
        """(name, DTensor parameter), typed loosely: torch types them as plain Parameters.
        A step that failed between FSDP's all-gather and its reshard leaves a module's
        parameters registered unsharded (plain tensors): they are resharded first, which
        frees the gathered copies and needs no collective."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return list(self.model.named_parameters())

    def owned_ranges(self) -> Ranges:
        ranges = {name: element_range(p) for name, p in self._parameters()}
        return {name: span for name, span in ranges.items() if span[2] > span[1]}

    def _per_element(self, param: Any, value: Any) -> bool:
        return hasattr(value, "to_local") and tuple(value.shape) == tuple(param.shape)

    @property
    def replicas(self) -> int:
        """HSDP's replica groups (1 under plain FSDP), each holding the whole state."""
        return int(self.mesh.size(0)) if self.mesh.ndim == 2 else 1

    def _shard_and_kept(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """This rank's shard (references to the live tensors: its range of each parameter and
        of its per-element optimizer states) and, per parameter, its scalar optimizer state
        (Adam's step) and the names of its per-element states, which a rank holding none of
        its elements must still make."""
        pieces: dict[str, tuple[int, int, int, dict[str, torch.Tensor]]] = {}
        kept: dict[str, dict[str, Any]] = {}
        owned = self.owned_ranges()
        for name, param in self._parameters():
            moments = self.optimizer.state.get(param, {})
            per_element = {k: v for k, v in moments.items() if self._per_element(param, v)}
            scalars = {k: float(v) for k, v in moments.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
            kept[name] = {"scalars": scalars, "tensors": sorted(per_element)}
            if name in owned:
                tensors = {"param": param.to_local().detach().reshape(-1)}
                tensors.update({k: v.to_local().reshape(-1) for k, v in per_element.items()})
                pieces[name] = (*owned[name], tensors)
        return shard_state(self.data_parallel_rank, self.data_parallel_size, pieces), kept

    def shard_to_copy(self) -> dict[str, Any] | None:
        """This rank's shard, for a buddy on another node to keep. None under HSDP: the same
        shard rank of every other replica holds it already."""
        return None if self.replicas > 1 else self._shard_and_kept()[0]

    def state_dict(self) -> dict[str, Any]:
        """References to the live tensors: the pieces, and the replicated rest."""
        shard, kept = self._shard_and_kept()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {
            "iteration": self.iteration,
            "model": {},  # nothing replicated: every parameter is in the pieces
            "optimizer": {"param_groups": groups, "per_parameter": kept},
            SHARD_KEY: shard,
            **self.replicated_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's ranges cut from the shards ``state`` carries (its own, or several to
        reshard from), and the replicated rest. ShardError before anything is loaded when the
        shards miss part of this rank's."""
        from torch.distributed.tensor import DTensor

        owned = self.owned_ranges()
        tensors = cut(shards_of(state), owned)
        saved_groups = state["optimizer"]["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ShardError(
                f"the state has {len(saved_groups)} parameter groups, the optimizer {len(self.optimizer.param_groups)}"
            )
        kept = state["optimizer"]["per_parameter"]
        for name, param in self._parameters():
            local = param.to_local()
            opt_state = self.optimizer.state[param]
            received = tensors.get(name, {})
            if "param" in received:
                local.view(-1).copy_(received["param"])
            # Scalars first: the order torch's Adam makes its state in.
            for key, number in kept.get(name, {}).get("scalars", {}).items():
                opt_state[key] = torch.tensor(number, dtype=torch.float32)
            for key in kept.get(name, {}).get("tensors", []):
                value = received.get(key, local.new_empty((0,)))
                if isinstance(opt_state.get(key), DTensor):
                    opt_state[key].to_local().view(-1).copy_(value)
                else:  # a state the optimizer makes at its first step: made here, as it would
                    opt_state[key] = DTensor.from_local(
                        value.clone().view(local.shape),
                        self.mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                    )
        for group, saved in zip(self.optimizer.param_groups, saved_groups, strict=True):
            group.update(saved)
        self.load_replicated(state)

    def rebuild(self, timeout: timedelta | None = None) -> FSDPTrainer:
        """The model built again on a mesh over the current world (its state fresh: the
        reform loads it)."""
        trainer = FSDPTrainer(self._build, self._device, timeout or self._timeout, self.training, self._shard_degree)
        trainer.grad_sync_hook = self.grad_sync_hook
        return trainer

    def release(self) -> None:
        """Lets the old process groups close although the user's loop may still hold the model
        (its locals ``model``, ``loss``: a failed step's frame is alive while it is handled). A
        gloo group closes its connections only when its last reference is gone, and a peer
        blocked in one of FSDP's collectives with this rank fails only then; FSDP's mesh infos
        are the only holders besides the world's registry, so their references are dropped.
        The model, optimizer and mesh are dropped too, and what Session froze is unfrozen, so
        their reference cycles can be collected."""
        if self.model is not None:
            _drop_process_groups(self.model, self.mesh)
        self.model = self.optimizer = self.scheduler = self.mesh = None  # type: ignore[assignment]
        gc.unfreeze()


def _drop_process_groups(model: torch.nn.Module, mesh: Any) -> None:
    """Clears every reference to a process group that ``model`` and its meshes hold (torch
    2.13): the FSDP state of each module (its parameter groups, their mesh infos and
    communication context), and each mesh's registry of groups by name, which outlives the
    model (DTensor's sharding-propagation cache keeps the mesh). Neither can run a collective
    afterwards."""
    from torch.distributed.fsdp import FSDPModule

    meshes = {id(m): m for m in [mesh, *(getattr(p, "device_mesh", None) for p in model.parameters())] if m}
    for each in meshes.values():
        for owner in (each, getattr(each, "_root_mesh", None)):
            registry = getattr(owner, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            holders = [group, group.mesh_info, group.post_forward_mesh_info, getattr(group, "comm_ctx", None)]
            for holder in holders:
                for name, value in list(vars(holder).items()) if holder is not None else []:
                    if isinstance(value, dist.ProcessGroup):
                        setattr(holder, name, None)
