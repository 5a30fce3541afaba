"""Fault injection as a feature: the names users type, and the error texts an injected
exception carries, so detection sees exactly what a real failure would show it."""

from __future__ import annotations

from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2 as pb

FAULT_NAMES: dict[str, pb.FaultKind] = {
    "crash": pb.FAULT_KIND_CRASH,
    "exit": pb.FAULT_KIND_EXIT,
    "exception": pb.FAULT_KIND_EXCEPTION,
    "hang": pb.FAULT_KIND_HANG,
    "stuck-collective": pb.FAULT_KIND_STUCK_COLLECTIVE,
    "slow": pb.FAULT_KIND_SLOW,
    "agent-loss": pb.FAULT_KIND_AGENT_LOSS,
    "vanish-in-allreduce": pb.FAULT_KIND_VANISH_IN_ALLREDUCE,
}

# What the real failure's exception says (CUDA, NCCL, gloo and torch.distributed texts).
EXCEPTION_TEXTS: dict[pb.FailureKind, str] = {
    pb.FAILURE_KIND_ECC_ERROR: "CUDA error: uncorrectable ECC error encountered",
    pb.FAILURE_KIND_NVLINK_ERROR: "NCCL error: unhandled system error (NVLink error detected on link 3)",
    pb.FAILURE_KIND_INVALID_DMA_MAPPING: "CUDA error: invalid DMA mapping (IOMMU fault)",
    pb.FAILURE_KIND_GPU_DRIVER_ERROR: "CUDA error: GPU has fallen off the bus",
    pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS: "CUDA error: an illegal memory access was encountered",
    pb.FAILURE_KIND_CUDA_ERROR: "CUDA error: device-side assert triggered",
    pb.FAILURE_KIND_OUT_OF_MEMORY: "CUDA out of memory. Tried to allocate 2.00 GiB",
    pb.FAILURE_KIND_SOFTWARE_ERROR: "ValueError: shapes (4, 8) and (16, 8) are not aligned",
    pb.FAILURE_KIND_COLLECTIVE_TIMEOUT: (
        "Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE) ran for 1800000 milliseconds"
    ),
    pb.FAILURE_KIND_LINK_FLAPPING: "NCCL WARN NET/IB : link is down (port 1), link flapping",
    pb.FAILURE_KIND_CONNECTION_REFUSED: "DistNetworkError: Connection refused (peer 10.0.0.7:29500)",
    pb.FAILURE_KIND_CONNECTION_RESET: "[gloo/transport/tcp/pair.cc:534] Connection reset by peer",
    pb.FAILURE_KIND_NETWORK_ERROR: "DistNetworkError: gloo network error while receiving from peer",
}


def kind_from_name(name: str) -> pb.FailureKind:
    key = "FAILURE_KIND_" + name.upper().replace("-", "_")
    if key not in pb.FailureKind.keys():
        raise InvalidArgument("fault.exception_kind", f"unknown failure kind {name!r}")
    return pb.FailureKind.Value(key)  # type: ignore[return-value]


def parse_fault(text: str, rank: int = 0) -> pb.Fault:
    """`kind[:arg][@step]`: crash@5, exception:illegal_memory_access@3, slow:0.5, hang. An
    exception raised inside the gradient all-reduce rather than before the iteration:
    exception:collective_timeout:allreduce@5."""
    head, _, step_text = text.strip().partition("@")
    name, _, arg = head.partition(":")
    if name not in FAULT_NAMES:
        raise InvalidArgument("fault.kind", f"unknown fault {name!r} (one of: {', '.join(FAULT_NAMES)})")
    fault = pb.Fault(kind=FAULT_NAMES[name], rank=rank)
    if step_text:
        if not step_text.isdigit():
            raise InvalidArgument("fault.step", f"must be an iteration number, got {step_text!r}")
        fault.step = int(step_text)
    if fault.kind == pb.FAULT_KIND_EXCEPTION:
        if not arg:
            raise InvalidArgument("fault.exception_kind", "an exception fault needs a kind, e.g. exception:ecc_error")
        kind, _, where = arg.partition(":")
        if where not in ("", "allreduce"):
            raise InvalidArgument(
                "fault.in_grad_sync", f"an exception fires before the step or in its 'allreduce', got {where!r}"
            )
        fault.exception_kind = kind_from_name(kind)
        fault.in_grad_sync = where == "allreduce"
    elif fault.kind == pb.FAULT_KIND_SLOW:
        try:
            fault.delay_seconds = float(arg or "1")
        except ValueError:
            raise InvalidArgument("fault.delay_seconds", f"must be seconds, got {arg!r}") from None
    elif arg:
        raise InvalidArgument("fault", f"{name} takes no argument")
    return fault


def fault_name(kind: pb.FaultKind) -> str:
    return next(name for name, value in FAULT_NAMES.items() if value == kind)
