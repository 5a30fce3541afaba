"""The failure taxonomy as data (docs/architecture.md: Detection): kind -> severity -> first action,
and a classifier for caught exceptions.

Who uses what: trainers and agents observe (an exception's text, a health check) and report
a kind; only the coordinator classifies a kind into its severity and remedy (`classify`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from unicron.v1 import common_pb2 as pb


class Action(Enum):
    REATTEMPT = "reattempt in place"
    RESTART = "restart process"
    RECONFIGURE = "reconfigure"
    REPORT = "report"
    # A deterministic error of the job's own program: every retry would fail the same way.
    FAIL = "fail the job"


# A remedy that keeps failing is replaced by the next heavier one; RECONFIGURE is the last.
ESCALATION: tuple[Action, ...] = (Action.REATTEMPT, Action.RESTART, Action.RECONFIGURE)


def escalate(action: Action) -> Action | None:
    """The next heavier remedy, or None when there is none left (the job fails)."""
    if action not in ESCALATION:
        return None
    index = ESCALATION.index(action)
    return ESCALATION[index + 1] if index + 1 < len(ESCALATION) else None


@dataclass(frozen=True)
class FailureClass:
    kind: pb.FailureKind
    severity: pb.Severity
    action: Action
    description: str


TAXONOMY: dict[pb.FailureKind, FailureClass] = {
    c.kind: c
    for c in (
        FailureClass(pb.FAILURE_KIND_NODE_LOST, pb.SEVERITY_SEV1, Action.RECONFIGURE, "node unreachable"),
        FailureClass(pb.FAILURE_KIND_ECC_ERROR, pb.SEVERITY_SEV1, Action.RECONFIGURE, "uncorrectable ECC error"),
        FailureClass(pb.FAILURE_KIND_NVLINK_ERROR, pb.SEVERITY_SEV1, Action.RECONFIGURE, "NVLink error"),
        FailureClass(pb.FAILURE_KIND_INVALID_DMA_MAPPING, pb.SEVERITY_SEV1, Action.RECONFIGURE, "invalid DMA mapping"),
        FailureClass(
            pb.FAILURE_KIND_GPU_DRIVER_ERROR, pb.SEVERITY_SEV1, Action.RECONFIGURE, "GPU driver error or GPU lost"
        ),
        FailureClass(pb.FAILURE_KIND_DISK_FULL, pb.SEVERITY_SEV1, Action.RECONFIGURE, "node disk full"),
        FailureClass(pb.FAILURE_KIND_HOST_MEMORY_LOW, pb.SEVERITY_SEV1, Action.RECONFIGURE, "node host memory low"),
        FailureClass(pb.FAILURE_KIND_PROCESS_EXIT, pb.SEVERITY_SEV2, Action.RESTART, "process exited abnormally"),
        FailureClass(pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS, pb.SEVERITY_SEV2, Action.RESTART, "illegal memory access"),
        FailureClass(pb.FAILURE_KIND_CUDA_ERROR, pb.SEVERITY_SEV2, Action.RESTART, "CUDA error"),
        FailureClass(pb.FAILURE_KIND_OUT_OF_MEMORY, pb.SEVERITY_SEV2, Action.RESTART, "out of memory"),
        FailureClass(pb.FAILURE_KIND_SOFTWARE_ERROR, pb.SEVERITY_SEV2, Action.RESTART, "software error"),
        FailureClass(pb.FAILURE_KIND_TASK_HANG, pb.SEVERITY_SEV2, Action.RESTART, "task hang"),
        FailureClass(
            pb.FAILURE_KIND_TRANSITION_TIMEOUT,
            pb.SEVERITY_SEV2,
            Action.RESTART,
            "agent missed a transition command's deadline",
        ),
        FailureClass(pb.FAILURE_KIND_COLLECTIVE_TIMEOUT, pb.SEVERITY_SEV3, Action.REATTEMPT, "collective timeout"),
        FailureClass(pb.FAILURE_KIND_LINK_FLAPPING, pb.SEVERITY_SEV3, Action.REATTEMPT, "link flapping"),
        FailureClass(pb.FAILURE_KIND_CONNECTION_REFUSED, pb.SEVERITY_SEV3, Action.REATTEMPT, "connection refused"),
        FailureClass(pb.FAILURE_KIND_CONNECTION_RESET, pb.SEVERITY_SEV3, Action.REATTEMPT, "connection reset"),
        FailureClass(pb.FAILURE_KIND_NETWORK_ERROR, pb.SEVERITY_SEV3, Action.REATTEMPT, "network error"),
        FailureClass(pb.FAILURE_KIND_STRAGGLER, pb.SEVERITY_SEV3, Action.REPORT, "straggler (slow rank)"),
        FailureClass(
            pb.FAILURE_KIND_PROGRAM_ERROR, pb.SEVERITY_SEV2, Action.FAIL, "error in the job's program (not retryable)"
        ),
        FailureClass(
            pb.FAILURE_KIND_CHECKPOINT_STORAGE, pb.SEVERITY_SEV3, Action.REPORT, "checkpoint volume (nearly) full"
        ),
    )
}

# How a failure elsewhere looks from a rank in the same process group: its collectives
# break or time out. A rank that reports one of these has its state intact and waits for the
# decision; a rank that reports any other kind had the failure itself and is replaced.
GROUP_SYMPTOMS: frozenset[pb.FailureKind] = frozenset(
    {
        pb.FAILURE_KIND_CONNECTION_RESET,
        pb.FAILURE_KIND_CONNECTION_REFUSED,
        pb.FAILURE_KIND_NETWORK_ERROR,
        pb.FAILURE_KIND_COLLECTIVE_TIMEOUT,
        pb.FAILURE_KIND_LINK_FLAPPING,
    }
)


# Ordered: the first pattern that matches an exception's text decides its kind. Hardware
# markers come first because CUDA wraps them in generic "CUDA error" messages.
_PATTERNS: tuple[tuple[re.Pattern[str], pb.FailureKind], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), kind)
    for pattern, kind in (
        (r"uncorrectable ecc|ecc error", pb.FAILURE_KIND_ECC_ERROR),
        (r"nvlink", pb.FAILURE_KIND_NVLINK_ERROR),
        (r"invalid dma|dma mapping", pb.FAILURE_KIND_INVALID_DMA_MAPPING),
        (r"fallen off the bus|gpu is lost|driver (shutting down|error)|xid", pb.FAILURE_KIND_GPU_DRIVER_ERROR),
        (r"illegal memory access", pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS),
        (r"out of memory|\boom\b", pb.FAILURE_KIND_OUT_OF_MEMORY),
        (r"cuda error|cudaerror|cublas|cudnn", pb.FAILURE_KIND_CUDA_ERROR),
        (r"timed out|timeout|diststoreerror", pb.FAILURE_KIND_COLLECTIVE_TIMEOUT),
        (r"connection refused", pb.FAILURE_KIND_CONNECTION_REFUSED),
        (r"connection reset|reset by peer|broken pipe|connection closed by peer", pb.FAILURE_KIND_CONNECTION_RESET),
        (r"link (is )?(down|flap)", pb.FAILURE_KIND_LINK_FLAPPING),
        (r"distnetworkerror|gloo|nccl|socket|network", pb.FAILURE_KIND_NETWORK_ERROR),
    )
)


def classify_exception(exc: BaseException) -> pb.FailureKind:
    text = f"{type(exc).__name__}: {exc}"
    for pattern, kind in _PATTERNS:
        if pattern.search(text):
            return kind
    return pb.FAILURE_KIND_SOFTWARE_ERROR


def classify(kind: pb.FailureKind) -> FailureClass:
    return TAXONOMY.get(kind, TAXONOMY[pb.FAILURE_KIND_SOFTWARE_ERROR])


def severity_name(severity: pb.Severity) -> str:
    return pb.Severity.Name(severity).removeprefix("SEVERITY_")


def kind_name(kind: pb.FailureKind) -> str:
    return pb.FailureKind.Name(kind).removeprefix("FAILURE_KIND_").lower()
