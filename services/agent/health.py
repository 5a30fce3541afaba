"""Node health checks (docs/architecture.md: Detection): local checks behind one small interface, NVML
where GPUs exist (ECC counts, retired pages, NVLink errors, XID events), disk and host
memory on every machine.

Findings describe what a run saw. Conditions that persist (a full disk, low memory, pages
pending retirement, a lost GPU, a downed NVLink) are reported by every run while they hold,
so the caller can tell when they clear; events (an ECC or NVLink counter that went up, an
XID) are reported by the one run that saw them. The agent reports a (kind, check) pair
again only after it disappeared from a run.

A check that fails to run reports nothing and logs a warning: an unreadable counter is not
evidence of a faulty node, and every finding here leads to a SEV1 reconfigure (isolating the
node), which is far costlier than a missed run. The one exception is NVML saying a GPU is
lost, which is itself the hardware verdict.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from unicron.v1 import common_pb2

log = logging.getLogger(__name__)

_GIB = float(1 << 30)
_MIB = float(1 << 20)

# XIDs classified by what they say about the node (NVIDIA's XID catalogue).
_ECC_XIDS = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}
_NVLINK_XIDS = {74: "NVLink error"}
_DRIVER_XIDS = {79: "GPU fell off the bus"}
# XIDs raised by a faulting application, not by faulty hardware: 13 graphics engine exception
# (e.g. out-of-bounds access), 31 MMU fault (illegal address), 43 GPU stopped processing a
# faulted context, 45 preemptive cleanup after a process was killed. The trainer sees the
# same fault as a CUDA error, and DESIGN routes that to a process restart; reporting these
# as a node fault would isolate a healthy node for a software bug.
_APPLICATION_XIDS = frozenset({13, 31, 43, 45})
_MAX_EVENTS_PER_RUN = 256  # a storm of XIDs must not keep one run from finishing

# NVML return codes (nvmlReturn_t), for modules that lack the named constants.
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_TIMEOUT = 10
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_GPU_IS_LOST = 15


@dataclass(frozen=True)
class HealthFinding:
    kind: common_pb2.FailureKind
    check: str  # the name of the check that found it
    message: str
    evidence: dict[str, float]

    def __post_init__(self) -> None:
        if self.kind not in common_pb2.FailureKind.values() or self.kind == common_pb2.FAILURE_KIND_UNSPECIFIED:
            raise ValueError(f"kind: {self.kind!r} is not a failure kind")
        if not self.check:
            raise ValueError("check: is required")


class HealthCheck(Protocol):
    name: str

    def run(self) -> list[HealthFinding]:
        """Findings of one run. Must not raise: a check that cannot run logs a warning and
        returns no finding (run_checks enforces this for checks that get it wrong)."""
        ...


class DiskCheck:
    """The file system holding `path` (checkpoints, logs) has room left: at least
    `min_free_bytes` and at least `min_free_fraction` of its size; either may be 0 to disable."""

    def __init__(
        self,
        path: str,
        min_free_bytes: int = 1 << 30,
        min_free_fraction: float = 0.02,
        usage: Callable[[str], tuple[int, int, int]] = shutil.disk_usage,
        kind: common_pb2.FailureKind = common_pb2.FAILURE_KIND_DISK_FULL,
    ) -> None:
        if not path:
            raise ValueError("path: is required")
        if min_free_bytes < 0:
            raise ValueError("min_free_bytes: must not be negative")
        if not (math.isfinite(min_free_fraction) and 0.0 <= min_free_fraction < 1.0):
            raise ValueError("min_free_fraction: must be in [0, 1)")
        self.name = f"disk:{path}"
        self.path = path
        self.min_free_bytes = min_free_bytes
        self.min_free_fraction = min_free_fraction
        self._usage = usage
        self.kind = kind

    def run(self) -> list[HealthFinding]:
        try:
            measured, (total, _used, free) = self._usage_of_nearest_existing()
        except OSError as exc:
            log.warning("disk check of %s could not run: %s", self.path, exc)
            return []
        fraction = free / total if total > 0 else 0.0
        problems = []
        if free < self.min_free_bytes:
            problems.append(f"under {self.min_free_bytes / _GIB:.2f} GiB")
        if fraction < self.min_free_fraction:
            problems.append(f"under {self.min_free_fraction:.1%}")
        if not problems:
            return []
        return [
            HealthFinding(
                kind=self.kind,
                check=self.name,
                message=(
                    f"{measured}: {free / _GIB:.2f} GiB free of {total / _GIB:.2f} GiB ({fraction:.1%}), "
                    + " and ".join(problems)
                ),
                evidence={
                    "free_bytes": float(free),
                    "total_bytes": float(total),
                    "free_fraction": fraction,
                    "min_free_bytes": float(self.min_free_bytes),
                    "min_free_fraction": self.min_free_fraction,
                },
            )
        ]

    def _usage_of_nearest_existing(self) -> tuple[str, tuple[int, int, int]]:
        # The work directory may not exist yet (a fresh node); what matters is the file
        # system it will be created on.
        path = self.path
        while True:
            try:
                total, used, free = self._usage(path)
                return path, (int(total), int(used), int(free))
            except FileNotFoundError:
                parent = os.path.dirname(os.path.abspath(path))
                if parent == path:
                    raise
                path = parent


def _virtual_memory() -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


class MemoryCheck:
    """Host memory available (psutil's estimate of what can be allocated without swapping)
    stays above `min_available_bytes`: data loaders and pinned buffers die when it does not."""

    def __init__(self, min_available_bytes: int = 512 << 20, read: Callable[[], tuple[int, int]] | None = None) -> None:
        if min_available_bytes < 0:
            raise ValueError("min_available_bytes: must not be negative")
        self.name = "memory"
        self.min_available_bytes = min_available_bytes
        self._read = read or _virtual_memory

    def run(self) -> list[HealthFinding]:
        try:
            available, total = self._read()
        except OSError as exc:
            log.warning("memory check could not run: %s", exc)
            return []
        if available >= self.min_available_bytes:
            return []
        return [
            HealthFinding(
                kind=common_pb2.FAILURE_KIND_HOST_MEMORY_LOW,
                check=self.name,
                message=(
                    f"{available / _MIB:.0f} MiB available of {total / _MIB:.0f} MiB, "
                    f"under {self.min_available_bytes / _MIB:.0f} MiB"
                ),
                evidence={
                    "available_bytes": float(available),
                    "total_bytes": float(total),
                    "min_available_bytes": float(self.min_available_bytes),
                },
            )
        ]


class _GpuLost(Exception):
    pass


# Stand-ins for the handle of a GPU that could not be opened at start.
_LOST = object()
_UNREADABLE = object()


def _xid_finding(check: str, gpu: int, xid: int, count: int) -> HealthFinding | None:
    if xid in _APPLICATION_XIDS:
        log.info("GPU %d reported application XID %d (x%d); left to the trainer's own error", gpu, xid, count)
        return None
    if xid in _ECC_XIDS:
        kind, what = common_pb2.FAILURE_KIND_ECC_ERROR, _ECC_XIDS[xid]
    elif xid in _NVLINK_XIDS:
        kind, what = common_pb2.FAILURE_KIND_NVLINK_ERROR, _NVLINK_XIDS[xid]
    else:
        kind, what = common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR, _DRIVER_XIDS.get(xid, "critical driver error")
    times = f" x{count}" if count > 1 else ""
    return HealthFinding(
        kind=kind,
        check=check,
        message=f"GPU {gpu} reported XID {xid} ({what}){times}",
        evidence={"gpu": float(gpu), "xid": float(xid), "count": float(count)},
    )


class NvmlCheck:
    """GPU health through NVML (module `pynvml`, package nvidia-ml-py), or any object with the
    same functions and constants (`nvml`, for tests).

    Counters are compared with the previous run; the first run only records them, because
    errors counted before the agent started belong to an earlier incident:
    - uncorrectable volatile ECC count went up -> ECC_ERROR
    - retired pages pending, or (A100 and newer) a row remap pending or failed -> ECC_ERROR
    - an NVLink replay/recovery/CRC counter went up, or a link that was up is down -> NVLINK_ERROR
    - an XID critical event -> by XID: ECC ones ECC_ERROR, 74 NVLINK_ERROR, others GPU_DRIVER_ERROR
    - a GPU that NVML says is lost -> GPU_DRIVER_ERROR
    Queries a GPU does not support are skipped silently.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        self.name = "nvml"
        self._nvml = nvml
        self._started = False
        self._handles: list[Any] = []
        self._links: dict[int, list[int]] = {}  # gpu -> NVLinks up at start
        self._ecc: dict[int, int] = {}
        self._nvlink: dict[tuple[int, int, int], int] = {}  # (gpu, link, counter) -> count
        self._events: Any | None = None
        self._missing_logged = False

    @staticmethod
    def available() -> bool:
        """pynvml imports, NVML initializes, and at least one GPU is visible."""
        try:
            nvml: Any = importlib.import_module("pynvml")
        except ImportError:
            return False
        try:
            nvml.nvmlInit()
            try:
                return int(nvml.nvmlDeviceGetCount()) > 0
            finally:
                nvml.nvmlShutdown()
        except (nvml.NVMLError, OSError) as exc:
            log.debug("NVML unavailable: %s", exc)
            return False

    def run(self) -> list[HealthFinding]:
        nvml = self._module()
        if nvml is None:
            return []
        try:
            if not self._started:
                self._start(nvml)
            findings: list[HealthFinding] = []
            for gpu, handle in enumerate(self._handles):
                try:
                    findings.extend(self._device(nvml, gpu, handle))
                except _GpuLost:
                    findings.append(
                        HealthFinding(
                            kind=common_pb2.FAILURE_KIND_GPU_DRIVER_ERROR,
                            check=self.name,
                            message=f"GPU {gpu} is lost (fell off the bus or otherwise inaccessible)",
                            evidence={"gpu": float(gpu)},
                        )
                    )
            findings.extend(self._drain_events(nvml))
            return findings
        except nvml.NVMLError as exc:
            log.warning("NVML check could not run: %s", exc)
            return []

    def close(self) -> None:
        """Releases the event set and NVML; a later run starts afresh."""
        nvml = self._nvml
        if nvml is None or not self._started:
            return
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)
        self._started = False
        self._events = None

    # --- internals -------------------------------------------------------------------------

    def _module(self) -> Any | None:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                if not self._missing_logged:
                    log.warning("NVML check configured but pynvml is not installed; GPUs go unchecked")
                    self._missing_logged = True
                return None
        return self._nvml

    def _start(self, nvml: Any) -> None:
        nvml.nvmlInit()
        try:
            count = int(nvml.nvmlDeviceGetCount())
            self._handles = [self._handle(nvml, i) for i in range(count)]
        except nvml.NVMLError:
            nvml.nvmlShutdown()  # NVML counts inits; the next run starts over
            raise
        self._links = {gpu: self._active_links(nvml, gpu, h) for gpu, h in enumerate(self._handles)}
        self._events = self._register_events(nvml)
        self._started = True

    def _handle(self, nvml: Any, gpu: int) -> Any:
        try:
            return nvml.nvmlDeviceGetHandleByIndex(gpu)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", _NVML_ERROR_GPU_IS_LOST):
                return _LOST  # already gone at start: every run reports it
            log.warning("GPU %d: no NVML handle, left unchecked: %s", gpu, exc)
            return _UNREADABLE

    def _active_links(self, nvml: Any, gpu: int, handle: Any) -> list[int]:
        if handle is _LOST or handle is _UNREADABLE:
            return []
        try:
            return [
                link
                for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)))
                # Links past the GPU's count answer INVALID_ARGUMENT: quietly not there.
                if self._query(nvml, gpu, "NVLink state", nvml.nvmlDeviceGetNvLinkState, handle, link, quiet=True)
                == nvml.NVML_FEATURE_ENABLED
            ]
        except _GpuLost:
            return []

    def _register_events(self, nvml: Any) -> Any | None:
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML event set unavailable, XIDs will not be seen: %s", exc)
            return None
        registered = 0
        for gpu, handle in enumerate(self._handles):
            if handle is _LOST or handle is _UNREADABLE:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except nvml.NVMLError as exc:
                log.warning("GPU %d: XID events unavailable: %s", gpu, exc)
        if registered == 0:
            nvml.nvmlEventSetFree(events)
            return None
        return events

    def _query(self, nvml: Any, gpu: int, what: str, fn: Callable[..., Any], *args: Any, quiet: bool = False) -> Any:
        """fn(*args), or None where the GPU cannot answer; raises _GpuLost if it is gone."""
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", _NVML_ERROR_GPU_IS_LOST):
                raise _GpuLost from exc
            unsupported = (
                getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", _NVML_ERROR_NOT_SUPPORTED),
                getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", _NVML_ERROR_FUNCTION_NOT_FOUND),
                getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", _NVML_ERROR_INVALID_ARGUMENT),
            )
            if not quiet and code not in unsupported:
                log.warning("GPU %d: reading %s failed: %s", gpu, what, exc)
            return None

    def _device(self, nvml: Any, gpu: int, handle: Any) -> list[HealthFinding]:
        if handle is _UNREADABLE:
            return []
        if handle is _LOST:
            raise _GpuLost
        findings: list[HealthFinding] = []

        def ecc(message: str, **evidence: float) -> None:
            findings.append(
                HealthFinding(
                    common_pb2.FAILURE_KIND_ECC_ERROR,
                    self.name,
                    f"GPU {gpu}: {message}",
                    {"gpu": float(gpu), **evidence},
                )
            )

        uncorrected = self._query(
            nvml,
            gpu,
            "ECC errors",
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        if uncorrected is not None:
            previous = self._ecc.get(gpu)
            self._ecc[gpu] = int(uncorrected)
            # A drop means the counters were reset (driver reload): a new baseline, not an error.
            if previous is not None and int(uncorrected) > previous:
                ecc(
                    f"uncorrectable ECC errors rose from {previous} to {int(uncorrected)}",
                    uncorrected_ecc=float(uncorrected),
                    previous=float(previous),
                    increase=float(int(uncorrected) - previous),
                )

        pending = self._query(nvml, gpu, "retired pages", nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        if pending is not None and int(pending) == nvml.NVML_FEATURE_ENABLED:
            ecc("memory pages pending retirement (needs a GPU reset)", retired_pages_pending=1.0)

        rows = self._query(nvml, gpu, "remapped rows", nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            _corrected, uncorrected_rows, remap_pending, remap_failed = (int(v) for v in rows)
            if remap_failed:
                ecc("row remapping failed", uncorrectable_rows=float(uncorrected_rows), remap_failed=1.0)
            elif remap_pending:
                ecc("row remap pending (needs a GPU reset)", uncorrectable_rows=float(uncorrected_rows))

        findings.extend(self._nvlinks(nvml, gpu, handle))
        return findings

    def _nvlinks(self, nvml: Any, gpu: int, handle: Any) -> list[HealthFinding]:
        counters = {
            "replay": nvml.NVML_NVLINK_ERROR_DL_REPLAY,
            "recovery": nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
            "crc_flit": nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            "crc_data": nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
        }
        findings: list[HealthFinding] = []
        for link in self._links.get(gpu, []):
            state = self._query(nvml, gpu, f"NVLink {link} state", nvml.nvmlDeviceGetNvLinkState, handle, link)
            if state is not None and state != nvml.NVML_FEATURE_ENABLED:
                findings.append(
                    HealthFinding(
                        common_pb2.FAILURE_KIND_NVLINK_ERROR,
                        self.name,
                        f"GPU {gpu}: NVLink {link} is down",
                        {"gpu": float(gpu), "link": float(link), "link_down": 1.0},
                    )
                )
                continue
            increases: dict[str, float] = {}
            for label, counter in counters.items():
                value = self._query(
                    nvml, gpu, f"NVLink {link} {label}", nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter
                )
                if value is None:
                    continue
                key = (gpu, link, counter)
                previous = self._nvlink.get(key)
                self._nvlink[key] = int(value)
                if previous is not None and int(value) > previous:
                    increases[label] = float(int(value) - previous)
            if increases:
                summary = ", ".join(f"{label} +{n:.0f}" for label, n in increases.items())
                findings.append(
                    HealthFinding(
                        common_pb2.FAILURE_KIND_NVLINK_ERROR,
                        self.name,
                        f"GPU {gpu}: NVLink {link} errors: {summary}",
                        {"gpu": float(gpu), "link": float(link), **{f"{k}_increase": v for k, v in increases.items()}},
                    )
                )
        return findings

    def _drain_events(self, nvml: Any) -> list[HealthFinding]:
        if self._events is None:
            return []
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        timeout_code = getattr(nvml, "NVML_ERROR_TIMEOUT", _NVML_ERROR_TIMEOUT)
        counts: dict[tuple[int, int], int] = {}
        for _ in range(_MAX_EVENTS_PER_RUN):
            try:
                data = wait(self._events, 0)  # never block the health loop
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != timeout_code:
                    log.warning("reading NVML events failed: %s", exc)
                break
            if not int(data.eventType) & nvml.nvmlEventTypeXidCriticalError:
                continue
            key = (self._gpu_of(nvml, data.device), int(data.eventData))
            counts[key] = counts.get(key, 0) + 1
        findings = []
        for (gpu, xid), count in sorted(counts.items()):
            finding = _xid_finding(self.name, gpu, xid, count)
            if finding is not None:
                findings.append(finding)
        return findings

    def _gpu_of(self, nvml: Any, device: Any) -> int:
        try:
            return int(nvml.nvmlDeviceGetIndex(device))
        except nvml.NVMLError:
            return -1


def default_checks(work_dir: str, checkpoint_dir: str = "") -> list[HealthCheck]:
    """Disk (the file system of work_dir) and memory on every machine; NVML where GPUs exist.
    The checkpoint volume apart (when it is another file system): a full one fails every
    job's checkpoints, but the node itself is fine, so it is a finding of its own kind that
    isolates nothing."""
    checks: list[HealthCheck] = [DiskCheck(work_dir), MemoryCheck()]
    if checkpoint_dir and _file_system(checkpoint_dir) != _file_system(work_dir):
        checks.append(DiskCheck(checkpoint_dir, kind=common_pb2.FAILURE_KIND_CHECKPOINT_STORAGE))
    if NvmlCheck.available():
        checks.append(NvmlCheck())
    return checks


def _file_system(path: str) -> int | None:
    """The device of the nearest existing directory at or above `path`."""
    here = os.path.abspath(path)
    while True:
        try:
            return os.stat(here).st_dev
        except OSError:
            parent = os.path.dirname(here)
            if parent == here:
                return None
            here = parent


def run_checks(checks: Sequence[HealthCheck]) -> list[HealthFinding]:
    """Runs every check and gathers its findings; never raises. A check that raises (a bug,
    since checks must not) is logged and skipped, and the others still run."""
    findings: list[HealthFinding] = []
    for check in checks:
        try:
            findings.extend(check.run())
        except Exception:  # noqa: BLE001 - a broken check must not stop the others or the agent loop
            log.warning("health check %s failed", getattr(check, "name", check), exc_info=True)
    return findings
