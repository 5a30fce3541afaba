"""Megatron-Core's distributed optimizer seen as named pieces (``optimizer_shards``): which
element ranges of which parameters this data-parallel rank owns, its shard of the fp32 main
parameters and Adam moments as pieces, and loading a shard cut from any pieces.

Megatron's own ``state_dict()`` of a ``DistributedOptimizer`` holds only the parameter groups
(no moments, no main parameters); its ``get_parameter_state_dp_reshardable()`` holds them but
by bucket position, which changes with the data-parallel degree. Pieces are named by the
model's parameter names and element ranges, so a shard taken at one degree loads at any other.

Megatron-Core 0.16.1 API used (private, pinned): ``model_param_gbuf_map``,
``_get_model_param_range_map``, ``model_param_group_index_map``. Import after
``unicron.trainer.megatron_cpu``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from unicron.trainer.optimizer_shards import Ranges, cut, shard_state, shards_of

# The per-parameter Adam state torch keeps beside the main parameter; "step" is one number
# for the whole optimizer and travels in Megatron's own state_dict().
_SCALAR_KEYS = ("step",)


def _parts(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer instances behind ``optimizer`` (Megatron chains one per
    parameter dtype group)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if hasattr(part, "model_param_gbuf_map")]


def is_distributed(optimizer: Any) -> bool:
    return bool(_parts(optimizer))


def _owned(optimizer: Any, model: torch.nn.Module) -> Iterator[tuple[Any, torch.nn.Parameter, str, int, int, int]]:
    """(optimizer part, model parameter, name, numel, start, end) of every parameter this rank
    owns a (non-empty) range of."""
    names = {param: name for name, param in model.named_parameters()}
    for part in _parts(optimizer):
        for param in part.model_param_gbuf_map:
            span = part._get_model_param_range_map(param)["param"]
            if span.end > span.start:
                yield part, param, names[param], param.numel(), span.start, span.end


def owned_ranges(optimizer: Any, model: torch.nn.Module) -> Ranges:
    return {name: (numel, start, end) for _, _, name, numel, start, end in _owned(optimizer, model)}


def _state_of(part: Any, param: torch.nn.Parameter) -> tuple[torch.Tensor, dict[str, Any]]:
    """The main parameter (this rank's range of ``param``, fp32) and its optimizer state."""
    group, order = part.model_param_group_index_map[param]
    main = part.optimizer.param_groups[group]["params"][order]
    return main, part.optimizer.state[main]


def allocate_state(optimizer: Any) -> None:
    """Gives every main parameter Adam's initial state now instead of at the first step:
    Megatron's ``state_dict()`` of a distributed optimizer fails on an optimizer that has not
    stepped, and a state copy may be taken (or loaded) before the first step. The values are
    those torch.optim.Adam would create (step 0, zero moments), so the run does not change."""
    for part in _parts(optimizer):
        for group in part.optimizer.param_groups:
            for main in group["params"]:
                state = part.optimizer.state[main]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)


def shard(optimizer: Any, model: torch.nn.Module, rank: int, size: int) -> dict[str, Any]:
    """This rank's optimizer shard as pieces (references to the live tensors, not copies)."""
    pieces = {}
    for part, param, name, numel, start, end in _owned(optimizer, model):
        main, state = _state_of(part, param)
        tensors = {"param": main.detach().view(-1)}
        tensors.update(
            {k: v.view(-1) for k, v in state.items() if k not in _SCALAR_KEYS and isinstance(v, torch.Tensor)}
        )
        pieces[name] = (numel, start, end, tensors)
    return shard_state(rank, size, pieces)


@torch.no_grad()
def load(optimizer: Any, model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Loads ``state["optimizer"]`` (Megatron's parameter groups and step) and this rank's
    ranges, cut from the shards ``state`` carries, into the main parameters and the moments.
    ShardError or ValueError, before anything is loaded, when the shards miss part of them."""
    owned = list(_owned(optimizer, model))
    tensors = cut(shards_of(state), {name: (numel, start, end) for _, _, name, numel, start, end in owned})
    for part, param, name, *_ in owned:
        main, optim_state = _state_of(part, param)
        for key, value in tensors[name].items():
            target = main if key == "param" else optim_state.get(key)
            if not isinstance(target, torch.Tensor) or target.numel() != value.numel():
                raise ValueError(f"optimizer state {key!r} of {name} has no place in this optimizer")
    optimizer.load_state_dict(state["optimizer"])
    unshare_steps(optimizer)
    for part, param, name, *_ in owned:
        main, optim_state = _state_of(part, param)
        for key, value in tensors[name].items():
            target = main if key == "param" else optim_state[key]
            target.view(-1).copy_(value)


def unshare_steps(optimizer: Any) -> None:
    """Megatron's load_state_dict (without Apex or Transformer Engine, as on CPU) gives every
    parameter the *same* "step" tensor, and torch's Adam increments each parameter's step in
    place: after a load the shared step would advance once per parameter per iteration, and
    Adam's bias correction with it (seen: a reattempt 3e-4 off in loss one step after its
    reload). Each parameter gets its own copy, as a fresh Adam has."""
    for part in _parts(optimizer):
        for state in part.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()


def steps_from_groups(optimizer: Any) -> None:
    """After Megatron loads a sharded (dist_checkpointing) optimizer state: the Adam step count
    it restored into each parameter group's "step", given to each parameter's own state, whose
    "step" the load leaves at the template's 0 (seen with Megatron-Core 0.16.1's dp_reshardable
    layout: the first update after a restore then used step 1's bias correction)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)
