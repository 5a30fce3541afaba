from __future__ import annotations

import pytest

from unicron.failures import TAXONOMY, Action, classify_exception
from unicron.v1 import common_pb2 as pb


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), pb.FAILURE_KIND_ECC_ERROR),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), pb.FAILURE_KIND_OUT_OF_MEMORY),
        (RuntimeError("CUDA error: device-side assert triggered"), pb.FAILURE_KIND_CUDA_ERROR),
        (
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
            pb.FAILURE_KIND_CONNECTION_RESET,
        ),
        (RuntimeError("Connection reset by peer"), pb.FAILURE_KIND_CONNECTION_RESET),
        (ConnectionRefusedError("Connection refused"), pb.FAILURE_KIND_CONNECTION_REFUSED),
        (
            RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE) ran for 600000 ms"),
            pb.FAILURE_KIND_COLLECTIVE_TIMEOUT,
        ),
        (RuntimeError("NCCL error: unhandled system error, NVLink error detected"), pb.FAILURE_KIND_NVLINK_ERROR),
        (ValueError("shapes do not match"), pb.FAILURE_KIND_SOFTWARE_ERROR),
    ],
)
def test_classify(exc: BaseException, kind: int) -> None:
    assert classify_exception(exc) == kind


def test_every_kind_is_in_the_taxonomy() -> None:
    kinds = {v for k, v in pb.FailureKind.items() if k != "FAILURE_KIND_UNSPECIFIED"}
    assert set(TAXONOMY) == kinds


@pytest.mark.parametrize(
    ("severity", "action"),
    [(pb.SEVERITY_SEV1, Action.RECONFIGURE), (pb.SEVERITY_SEV2, Action.RESTART), (pb.SEVERITY_SEV3, Action.REATTEMPT)],
)
def test_severity_decides_first_action(severity: int, action: Action) -> None:
    for failure in TAXONOMY.values():
        if failure.severity == severity and failure.action != Action.REPORT:
            assert failure.action == action
