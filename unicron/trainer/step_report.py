"""What an iteration reports besides its loss: the loss function's report dict reduced over the
whole global batch, as Megatron-LM's ``training_log`` does it.

Megatron-Core loss functions report ``{"lm loss": tensor([loss_sum, num_tokens])}``: a value of
two elements is a (sum, count) pair, and the job's value is the sum of the sums over the sum of
the counts (over micro-batches and data-parallel ranks). A one-element value (Megatron's older
form, an already averaged number) counts once per micro-batch. Anything else in the dict is
not a number to report and is left out.

The loss function's answer is checked here too (``check_loss``): a wrong shape is a
ProgramError saying what came back.

The ranks agree on the names once per trainer (one ``all_gather_object``); after that the
pairs ride in the loss's own all-reduce, so a step's reports cost no further collective."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from unicron.trainer.program import ProgramError

Totals = dict[str, list[float]]  # name -> [sum, count]
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def add(totals: Totals, report: dict[str, Any]) -> None:
    """Adds one micro-batch's report dict to ``totals``."""
    for name, value in report.items():
        pair = _pair(value)
        if pair is not None:
            entry = totals.setdefault(str(name), [0.0, 0.0])
            entry[0] += pair[0]
            entry[1] += pair[1]


def _pair(value: Any) -> tuple[float, float] | None:
    if isinstance(value, torch.Tensor):
        if value.numel() == 2:
            flat = value.detach().double().flatten()
            return float(flat[0]), float(flat[1])
        if value.numel() == 1:
            return float(value.detach().double()), 1.0
        return None
    if isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(v, int | float) for v in value):
        return float(value[0]), float(value[1])
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value), 1.0
    return None


def agreed_names(local: Totals) -> list[str]:
    """Collective over the world: every name any rank's loss function reported (the last
    pipeline stage reports, the others have none), in one order."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(local))
    return sorted({name for names in everyone for name in names})


def pack(names: list[str], totals: Totals) -> list[float]:
    return [v for name in names for v in totals.get(name, [0.0, 0.0])]


# What an iteration report carries at most (the coordinator refuses more).
MAX_METRICS = 32
MAX_METRIC_NAME = 64


def unpack(names: list[str], values: list[float]) -> dict[str, float]:
    """The reduced pairs as the job's values: the first MAX_METRICS names, each cut to
    MAX_METRIC_NAME characters; a name no micro-batch counted, or not finite, is left out."""
    out = {}
    for i, name in enumerate(names[:MAX_METRICS]):
        total, count = values[2 * i], values[2 * i + 1]
        if count > 0 and math.isfinite(total / count):
            out[name[:MAX_METRIC_NAME]] = total / count
    return out


def check_mean_loss(result: tuple[Any, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    loss, report = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ProgramError(f"the loss function's loss must be a one-element tensor, got {type(loss).__name__}")
    if not isinstance(report, dict):
        raise ProgramError(f"the loss function's report must be a dict, got {type(report).__name__}")
    return loss, report


def check_loss(result: Any) -> LossOutput:
    """The loss function's answer in Megatron's form (loss sum, token count, report), or a
    ProgramError that says what came back instead."""
    if not isinstance(result, tuple) or len(result) != 3:
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else f"a {type(result).__name__}"
        raise ProgramError(
            "the loss function must return (loss_sum, num_tokens, report), or (loss, report), as"
            f" Megatron-Core's schedule takes it; it returned {got}"
        )
    loss_sum, num_tokens, report = result
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
        raise ProgramError(f"the loss function's loss_sum must be a one-element tensor, got {type(loss_sum).__name__}")
    if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1:
        raise ProgramError(
            f"the loss function's num_tokens must be a one-element tensor, got {type(num_tokens).__name__}"
        )
    if not isinstance(report, dict):
        raise ProgramError(f"the loss function's report must be a dict, got {type(report).__name__}")
    return loss_sum, num_tokens, report
