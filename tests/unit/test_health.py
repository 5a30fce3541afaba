from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.agent import health
from services.agent.health import (
    DiskCheck,
    HealthCheck,
    HealthFinding,
    MemoryCheck,
    NvmlCheck,
    default_checks,
    run_checks,
)
from unicron.v1 import common_pb2

GIB = 1 << 30
MIB = 1 << 20


# --- disk --------------------------------------------------------------------------------


def fixed_usage(total: int, free: int) -> Any:
    return lambda path: (total, total - free, free)


@pytest.mark.parametrize(
    ("total", "free", "finds"),
    [
        (100 * GIB, 50 * GIB, False),
        (100 * GIB, 2 * GIB + 1, False),  # above both floors
        (100 * GIB, GIB // 2, True),  # under 1 GiB
        (1000 * GIB, 10 * GIB, True),  # under 2% although plenty of bytes
        (10 * GIB, GIB - 1, True),
        (0, 0, True),  # nothing can be written there
    ],
)
def test_disk_check_thresholds(total: int, free: int, finds: bool) -> None:
    check = DiskCheck("/work", usage=fixed_usage(total, free))
    assert bool(check.run()) == finds


def test_disk_full_finding_carries_evidence() -> None:
    [finding] = DiskCheck("/work", usage=fixed_usage(100 * GIB, GIB // 4)).run()
    assert finding.kind == common_pb2.FAILURE_KIND_DISK_FULL
    assert finding.check == "disk:/work"
    assert finding.evidence == {
        "free_bytes": float(GIB // 4),
        "total_bytes": float(100 * GIB),
        "free_fraction": pytest.approx(0.0025),
        "min_free_bytes": float(GIB),
        "min_free_fraction": 0.02,
    }
    assert "0.25 GiB free" in finding.message


def test_disk_check_thresholds_can_be_disabled() -> None:
    assert DiskCheck("/w", min_free_bytes=0, min_free_fraction=0.0, usage=fixed_usage(GIB, 1)).run() == []


def test_disk_check_measures_the_nearest_existing_parent() -> None:
    seen: list[str] = []

    def usage(path: str) -> tuple[int, int, int]:
        seen.append(path)
        if path != "/data":
            raise FileNotFoundError(path)
        return (100 * GIB, 100 * GIB - 10, 10)

    [finding] = DiskCheck("/data/run/agent", usage=usage).run()
    assert seen == ["/data/run/agent", "/data/run", "/data"]
    assert finding.message.startswith("/data:")


def test_disk_check_that_cannot_read_logs_and_finds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def usage(path: str) -> tuple[int, int, int]:
        raise PermissionError(path)

    with caplog.at_level(logging.WARNING):
        assert DiskCheck("/secret", usage=usage).run() == []
    assert "could not run" in caplog.text


@pytest.mark.parametrize(
    "kwargs", [{"path": ""}, {"min_free_bytes": -1}, {"min_free_fraction": 1.0}, {"min_free_fraction": -0.1}]
)
def test_disk_check_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DiskCheck(**{"path": "/w", **kwargs})


# --- memory ------------------------------------------------------------------------------


def test_memory_low() -> None:
    [finding] = MemoryCheck(read=lambda: (100 * MIB, 64 * GIB)).run()
    assert finding.kind == common_pb2.FAILURE_KIND_HOST_MEMORY_LOW
    assert finding.check == "memory"
    assert finding.evidence == {
        "available_bytes": float(100 * MIB),
        "total_bytes": float(64 * GIB),
        "min_available_bytes": float(512 * MIB),
    }


def test_memory_healthy() -> None:
    assert MemoryCheck(read=lambda: (512 * MIB, 64 * GIB)).run() == []


def test_memory_check_reads_this_machine() -> None:
    assert MemoryCheck(min_available_bytes=0).run() == []
    assert len(MemoryCheck(min_available_bytes=1 << 60).run()) == 1


def test_healthy_machine_has_no_findings() -> None:
    checks: list[HealthCheck] = [
        DiskCheck("/w", usage=fixed_usage(100 * GIB, 50 * GIB)),
        MemoryCheck(read=lambda: (8 * GIB, 64 * GIB)),
    ]
    assert run_checks(checks) == []


# --- NVML --------------------------------------------------------------------------------


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    uncorrected: int = 0
    retired_pending: int = 0
    rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    links: dict[int, bool] = field(default_factory=lambda: {0: True, 1: True})
    nvlink: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> count
    lost: bool = False
    no_ecc: bool = False


@dataclass
class Event:
    device: int
    eventType: int
    eventData: int


class FakeNvml:
    """The slice of pynvml that NvmlCheck uses; handles are GPU indices."""

    NVMLError = NVMLError
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FEATURE_DISABLED = 0
    NVML_FEATURE_ENABLED = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_NVLINK_MAX_LINKS = 4
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = [FakeGpu() for _ in range(gpus)]
        self.events: list[Event] = []
        self.inits = 0
        self.registered: list[int] = []

    def _gpu(self, handle: int) -> FakeGpu:
        gpu = self.gpus[handle]
        if gpu.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._gpu(index)
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        assert (error_type, counter_type) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        if gpu.no_ecc:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return gpu.uncorrected

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return self._gpu(handle).retired_pending

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self._gpu(handle).rows

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        gpu = self._gpu(handle)
        if link not in gpu.links:
            raise NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return self.NVML_FEATURE_ENABLED if gpu.links[link] else self.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: int, link: int, counter: int) -> int:
        return self._gpu(handle).nvlink.get((link, counter), 0)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, events: str) -> None:
        assert types == self.nvmlEventTypeXidCriticalError and events == "event-set"
        self.registered.append(handle)

    def nvmlEventSetFree(self, events: str) -> None:
        pass

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Event:
        assert timeout_ms == 0
        if not self.events:
            raise NVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def xid(self, gpu: int, xid: int) -> None:
        self.events.append(Event(gpu, self.nvmlEventTypeXidCriticalError, xid))


def kinds(findings: list[HealthFinding]) -> list[int]:
    return [f.kind for f in findings]


def test_nvml_first_run_only_records_counters() -> None:
    nvml = FakeNvml()
    nvml.gpus[0].uncorrected = 7  # from before the agent started
    nvml.gpus[1].nvlink[(0, nvml.NVML_NVLINK_ERROR_DL_REPLAY)] = 3
    check = NvmlCheck(nvml)
    assert check.run() == []
    assert nvml.inits == 1
    assert nvml.registered == [0, 1]
    assert check.run() == []
    assert nvml.inits == 1  # initialized once


def test_nvml_ecc_increase_reported_once() -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    check.run()
    nvml.gpus[1].uncorrected = 2
    [finding] = check.run()
    assert finding.kind == common_pb2.FAILURE_KIND_ECC_ERROR
    assert finding.check == "nvml"
    assert finding.evidence == {"gpu": 1.0, "uncorrected_ecc": 2.0, "previous": 0.0, "increase": 2.0}
    assert check.run() == []  # unchanged: not repeated
    nvml.gpus[1].uncorrected = 3
    assert kinds(check.run()) == [common_pb2.FAILURE_KIND_ECC_ERROR]


def test_nvml_ecc_counter_reset_is_a_new_baseline() -> None:
    nvml = FakeNvml()
    nvml.gpus[0].uncorrected = 5
    check = NvmlCheck(nvml)
    check.run()
    nvml.gpus[0].uncorrected = 0  # driver reloaded
    assert check.run() == []
    nvml.gpus[0].uncorrected = 1
    assert kinds(check.run()) == [common_pb2.FAILURE_KIND_ECC_ERROR]


@pytest.mark.parametrize(
    ("gpu_state", "message"),
    [
        ({"retired_pending": 1}, "pending retirement"),
        ({"rows": (0, 2, 1, 0)}, "row remap pending"),
        ({"rows": (0, 2, 0, 1)}, "row remapping failed"),
    ],
)
def test_nvml_pending_memory_repair_reported_while_it_lasts(gpu_state: dict[str, Any], message: str) -> None:
    nvml = FakeNvml(gpus=1)
    for name, value in gpu_state.items():
        setattr(nvml.gpus[0], name, value)
    check = NvmlCheck(nvml)
    for _ in range(2):
        [finding] = check.run()
        assert finding.kind == common_pb2.FAILURE_KIND_ECC_ERROR
        assert message in finding.message
    nvml.gpus[0] = FakeGpu()  # reset: repaired
    assert check.run() == []


@pytest.mark.parametrize(
    ("xid", "kind"),
    [
        (79, common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR),
        (74, common_pb2.FAILURE_KIND_NVLINK_ERROR),
        (48, common_pb2.FAILURE_KIND_ECC_ERROR),
        (63, common_pb2.FAILURE_KIND_ECC_ERROR),
        (64, common_pb2.FAILURE_KIND_ECC_ERROR),
        (92, common_pb2.FAILURE_KIND_ECC_ERROR),
        (94, common_pb2.FAILURE_KIND_ECC_ERROR),
        (95, common_pb2.FAILURE_KIND_ECC_ERROR),
        (119, common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR),  # GSP timeout: unknown to the table
    ],
)
def test_nvml_xid_classified(xid: int, kind: int) -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    check.run()
    nvml.xid(1, xid)
    [finding] = check.run()
    assert finding.kind == kind
    assert finding.evidence == {"gpu": 1.0, "xid": float(xid), "count": 1.0}
    assert f"XID {xid}" in finding.message
    assert check.run() == []  # an event is reported once


@pytest.mark.parametrize("xid", [13, 31, 43, 45])
def test_nvml_application_xids_are_not_node_faults(xid: int) -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    nvml.xid(0, xid)
    assert check.run() == []


def test_nvml_repeated_xids_become_one_finding_with_a_count() -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    check.run()
    for _ in range(3):
        nvml.xid(0, 79)
    nvml.xid(1, 74)
    findings = check.run()
    assert [(f.evidence["gpu"], f.evidence["xid"], f.evidence["count"]) for f in findings] == [
        (0.0, 79.0, 3.0),
        (1.0, 74.0, 1.0),
    ]


def test_nvml_event_storm_is_bounded_per_run() -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    check.run()
    for _ in range(1000):
        nvml.xid(0, 79)
    [finding] = check.run()
    assert finding.evidence["count"] == float(health._MAX_EVENTS_PER_RUN)
    assert len(nvml.events) == 1000 - health._MAX_EVENTS_PER_RUN


def test_nvml_nvlink_counter_increase_and_link_down() -> None:
    nvml = FakeNvml(gpus=1)
    check = NvmlCheck(nvml)
    check.run()
    nvml.gpus[0].nvlink[(1, nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)] = 4
    nvml.gpus[0].nvlink[(1, nvml.NVML_NVLINK_ERROR_DL_RECOVERY)] = 1
    [finding] = check.run()
    assert finding.kind == common_pb2.FAILURE_KIND_NVLINK_ERROR
    assert finding.evidence == {"gpu": 0.0, "link": 1.0, "recovery_increase": 1.0, "crc_flit_increase": 4.0}
    assert check.run() == []
    nvml.gpus[0].links[0] = False
    [finding] = check.run()
    assert finding.kind == common_pb2.FAILURE_KIND_NVLINK_ERROR
    assert finding.evidence["link_down"] == 1.0


def test_nvml_lost_gpu() -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    check.run()
    nvml.gpus[1].lost = True
    for _ in range(2):
        [finding] = check.run()
        assert finding.kind == common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR
        assert finding.evidence == {"gpu": 1.0}


def test_nvml_gpu_lost_before_the_first_run() -> None:
    nvml = FakeNvml()
    nvml.gpus[0].lost = True
    findings = NvmlCheck(nvml).run()
    assert [(f.kind, f.evidence["gpu"]) for f in findings] == [(common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR, 0.0)]


def test_nvml_unsupported_queries_are_skipped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml(gpus=1)
    nvml.gpus[0].no_ecc = True
    check = NvmlCheck(nvml)
    with caplog.at_level(logging.WARNING):
        assert check.run() == []
        assert check.run() == []
    assert caplog.text == ""


def test_nvml_init_failure_logs_and_retries(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml()
    calls = {"n": 0}

    def flaky_init() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise NVMLError(9)  # driver not loaded
        nvml.inits += 1

    nvml.nvmlInit = flaky_init  # type: ignore[method-assign]
    check = NvmlCheck(nvml)
    with caplog.at_level(logging.WARNING):
        assert check.run() == []
    assert "could not run" in caplog.text
    nvml.xid(0, 79)
    assert kinds(check.run()) == [common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR]


def test_nvml_close_releases() -> None:
    nvml = FakeNvml()
    check = NvmlCheck(nvml)
    check.run()
    check.close()
    assert nvml.inits == 0


def test_nvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine has no pynvml; make sure of it whatever the environment.
    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(health.importlib, "import_module", missing)
    assert NvmlCheck.available() is False
    assert NvmlCheck().run() == []


# --- run_checks and defaults ---------------------------------------------------------------


class Exploding:
    name = "exploding"

    def run(self) -> list[HealthFinding]:
        raise RuntimeError("bug in a check")


def test_a_raising_check_does_not_break_run_checks(caplog: pytest.LogCaptureFixture) -> None:
    memory = MemoryCheck(read=lambda: (1, 2))
    with caplog.at_level(logging.WARNING):
        findings = run_checks([Exploding(), memory, Exploding()])
    assert kinds(findings) == [common_pb2.FAILURE_KIND_HOST_MEMORY_LOW]
    assert "health check exploding failed" in caplog.text


def test_default_checks_without_pynvml(tmp_path: Any) -> None:
    checks = default_checks(str(tmp_path))
    assert [type(c) for c in checks] == [DiskCheck, MemoryCheck]
    assert checks[0].name == f"disk:{tmp_path}"
    run_checks(checks)  # runs for real on this machine without raising


def test_default_checks_with_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NvmlCheck, "available", staticmethod(lambda: True))
    assert [type(c) for c in default_checks("/w")] == [DiskCheck, MemoryCheck, NvmlCheck]


def test_available_with_a_working_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    monkeypatch.setattr(health.importlib, "import_module", lambda name: nvml)
    assert NvmlCheck.available() is True
    assert nvml.inits == 0  # shut down again
    nvml.gpus = []
    assert NvmlCheck.available() is False


def test_health_finding_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        HealthFinding(12345, "x", "m", {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        HealthFinding(common_pb2.FAILURE_KIND_UNSPECIFIED, "x", "m", {})
    with pytest.raises(ValueError, match="check"):
        HealthFinding(common_pb2.FAILURE_KIND_DISK_FULL, "", "m", {})
