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
        if failure.severity == severity and failure.action not in (Action.REPORT, Action.FAIL):
            assert failure.action == action


def test_injected_exception_texts_classify_back_to_their_kind() -> None:
    from unicron.faults import EXCEPTION_TEXTS
    from unicron.trainer.faults import InjectedFailure

    for kind, text in EXCEPTION_TEXTS.items():
        assert classify_exception(InjectedFailure(text)) == kind, text


@pytest.mark.parametrize(
    ("text", "kind", "step", "extra"),
    [
        ("crash@5", pb.FAULT_KIND_CRASH, 5, {}),
        ("hang", pb.FAULT_KIND_HANG, 0, {}),
        (
            "exception:illegal_memory_access@3",
            pb.FAULT_KIND_EXCEPTION,
            3,
            {"exception_kind": pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS},
        ),
        ("slow:0.5@2", pb.FAULT_KIND_SLOW, 2, {"delay_seconds": 0.5}),
        ("vanish-in-allreduce@4", pb.FAULT_KIND_VANISH_IN_ALLREDUCE, 4, {}),
    ],
)
def test_parse_fault(text: str, kind: int, step: int, extra: dict) -> None:
    from unicron.faults import parse_fault

    fault = parse_fault(text, rank=2)
    assert (fault.kind, fault.step, fault.rank) == (kind, step, 2)
    for name, value in extra.items():
        assert getattr(fault, name) == value


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("explode", "fault.kind"),
        ("exception", "fault.exception_kind"),
        ("exception:nope", "fault.exception_kind"),
        ("crash@x", "fault.step"),
        ("slow:fast", "fault.delay_seconds"),
        ("crash:now", "fault"),
    ],
)
def test_parse_fault_errors_name_the_field(text: str, field: str) -> None:
    from unicron.errors import InvalidArgument
    from unicron.faults import parse_fault

    with pytest.raises(InvalidArgument) as error:
        parse_fault(text)
    assert error.value.field == field
