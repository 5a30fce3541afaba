"""Failure traces: a seeded generator, presets calibrated on public figures, and CSV replay.

A trace is a time-ordered list of ``FailureEvent``: at ``time_s`` (seconds from the start of
the simulation) node ``node`` (0-based index) suffers a failure of ``kind`` (a
``FAILURE_KIND_*`` of the taxonomy in ``unicron.failures``); if the failure takes the node
out (a SEV1 kind, or a lighter one the severity ladder escalates to a reconfiguration), it is
back ``repair_s`` seconds later.

Kinds. A trace names kinds either by the taxonomy's own names (``kind_name``: ``ecc_error``,
``collective_timeout``, ``node_lost``, ...) or by the names of the published mix below:

    nccl_timeout -> collective_timeout      ecc -> ecc_error          nvlink -> nvlink_error
    network_error -> network_error          link_flapping             others -> software_error
    task_hang                               illegal_memory_access     invalid_dma_mapping
    connection_refused                      cuda_error                connection_reset
    gpu_driver -> gpu_driver_error

Default mix (``DEFAULT_MIX``): the share of training tasks that ended in each failure, as the
Unicron paper reports it for a production cluster (He et al. 2023, Table 1): NCCL timeout 10.1%,
ECC 5.0%, NVLink 4.5%, other network 4.0%, link flapping 3.9%, others 3.3%, task hang 3.1%,
illegal memory access 2.1%, invalid DMA mapping 2.1%, connection refused 2.1%, CUDA error 1.6%,
connection reset 1.0%, GPU driver 0.6%. The shares sum to 43.4% (the tasks that failed); the
generator normalizes them to a distribution over failures.

Arrivals: a Poisson process over the cluster, ``failure_rate_per_node_per_s`` x nodes, each
failure on a node drawn uniformly. Repair times: exponential with mean ``repair_mean_s``
(an assumption; the published figures give no repair-time distribution).

CSV (``load_csv``/``save_csv``): one event per line, ``time_s,node,kind,repair_s``; an optional
header line of exactly those names; blank lines and lines starting with ``#`` are skipped. A bad
line (wrong field count, a number that does not parse or is negative or not finite, an unknown
kind, a node outside the cluster, a time before the previous line's) raises ``TraceError``
naming the file and line, and nothing is simulated.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unicron.errors import InvalidArgument
from unicron.failures import TAXONOMY, kind_name
from unicron.v1 import common_pb2 as pb

DAY_S = 86_400.0

# Published mix names (the Unicron paper's Table 1) -> the taxonomy's kinds.
MIX_NAMES: dict[str, int] = {
    "nccl_timeout": pb.FAILURE_KIND_COLLECTIVE_TIMEOUT,
    "ecc": pb.FAILURE_KIND_ECC_ERROR,
    "nvlink": pb.FAILURE_KIND_NVLINK_ERROR,
    "network_error": pb.FAILURE_KIND_NETWORK_ERROR,
    "link_flapping": pb.FAILURE_KIND_LINK_FLAPPING,
    "others": pb.FAILURE_KIND_SOFTWARE_ERROR,
    "task_hang": pb.FAILURE_KIND_TASK_HANG,
    "illegal_memory_access": pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS,
    "invalid_dma_mapping": pb.FAILURE_KIND_INVALID_DMA_MAPPING,
    "connection_refused": pb.FAILURE_KIND_CONNECTION_REFUSED,
    "cuda_error": pb.FAILURE_KIND_CUDA_ERROR,
    "connection_reset": pb.FAILURE_KIND_CONNECTION_RESET,
    "gpu_driver": pb.FAILURE_KIND_GPU_DRIVER_ERROR,
}

# Percent of tasks ending in each failure (the paper's Table 1); normalized where used.
DEFAULT_MIX: dict[str, float] = {
    "nccl_timeout": 10.1,
    "ecc": 5.0,
    "nvlink": 4.5,
    "network_error": 4.0,
    "link_flapping": 3.9,
    "others": 3.3,
    "task_hang": 3.1,
    "illegal_memory_access": 2.1,
    "invalid_dma_mapping": 2.1,
    "connection_refused": 2.1,
    "cuda_error": 1.6,
    "connection_reset": 1.0,
    "gpu_driver": 0.6,
}

# Every name a trace may use: the taxonomy's own kind names and the published mix's.
KIND_BY_NAME: dict[str, int] = {**{kind_name(k): int(k) for k in TAXONOMY}, **MIX_NAMES}

CSV_HEADER = ("time_s", "node", "kind", "repair_s")


class TraceError(InvalidArgument):
    """A bad trace line: ``str()`` is ``"<source> line <n>: <problem>"``."""

    def __init__(self, source: str, line: int, problem: str) -> None:
        self.source, self.line, self.problem = source, line, problem
        super().__init__(f"{source} line {line}", problem)


def kind_of(name: str) -> int:
    """The taxonomy kind of a trace kind name (either naming); KeyError when unknown."""
    return KIND_BY_NAME[name.strip().lower()]


def is_hardware(kind: int) -> bool:
    """SEV1 kinds: the node is faulty and must be taken out until repaired."""
    failure = TAXONOMY.get(kind)  # type: ignore[call-overload]
    return failure is not None and failure.severity == pb.SEVERITY_SEV1


def _require(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise InvalidArgument(name, problem)


@dataclass(frozen=True)
class FailureEvent:
    time_s: float
    node: int
    kind: int
    repair_s: float


def normalized_mix(mix: Mapping[str, float]) -> dict[int, float]:
    """A mix by name -> probabilities by kind (names of either kind naming; shares summed)."""
    total = sum(mix.values())
    _require(total > 0, "mix", "shares must sum to more than 0")
    out: dict[int, float] = {}
    for name, share in mix.items():
        _require(name.strip().lower() in KIND_BY_NAME, f"mix[{name!r}]", "unknown failure kind")
        _require(share >= 0 and math.isfinite(share), f"mix[{name!r}]", "share must be a finite number >= 0")
        kind = kind_of(name)
        out[kind] = out.get(kind, 0.0) + share / total
    return out


def with_hardware_share(mix: Mapping[str, float], share: float) -> dict[str, float]:
    """The mix rescaled so that SEV1 (node-level hardware) kinds make ``share`` of failures,
    each group keeping its internal proportions."""
    _require(0.0 <= share <= 1.0, "hardware_share", "must lie in [0, 1]")
    hard = sum(v for k, v in mix.items() if is_hardware(kind_of(k)))
    soft = sum(v for k, v in mix.items() if not is_hardware(kind_of(k)))
    _require(hard > 0 and soft > 0, "mix", "needs both hardware and other kinds to rescale")
    return {k: (share * v / hard if is_hardware(kind_of(k)) else (1 - share) * v / soft) for k, v in mix.items()}


@dataclass(frozen=True)
class TraceConfig:
    """What the generator draws from. ``failure_rate_per_node_per_s`` counts every failure kind
    (the mix splits it); ``repair_mean_s`` is the mean time a node taken out stays out."""

    nodes: int
    days: float
    failure_rate_per_node_per_s: float
    repair_mean_s: float = 4 * 3600.0
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    seed: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.nodes, int) and self.nodes >= 1, "nodes", "must be an int >= 1")
        _require(self.days > 0 and math.isfinite(self.days), "days", "must be a finite number > 0")
        rate = self.failure_rate_per_node_per_s
        _require(rate >= 0 and math.isfinite(rate), "failure_rate_per_node_per_s", "must be a finite number >= 0")
        _require(self.repair_mean_s >= 0 and math.isfinite(self.repair_mean_s), "repair_mean_s", "must be >= 0")
        normalized_mix(self.mix)  # validates names and shares
        object.__setattr__(self, "mix", dict(self.mix))

    @property
    def duration_s(self) -> float:
        return self.days * DAY_S


def generate(config: TraceConfig) -> list[FailureEvent]:
    """A seeded trace: the same config gives the same events."""
    rng = random.Random(f"unicron-sim-trace:{config.seed}")
    probabilities = normalized_mix(config.mix)
    kinds = sorted(probabilities)
    weights = [probabilities[k] for k in kinds]
    rate = config.failure_rate_per_node_per_s * config.nodes
    events: list[FailureEvent] = []
    if rate <= 0:
        return events
    t = rng.expovariate(rate)
    while t < config.duration_s:
        node = rng.randrange(config.nodes)
        kind = rng.choices(kinds, weights)[0]
        repair = rng.expovariate(1.0 / config.repair_mean_s) if config.repair_mean_s > 0 else 0.0
        events.append(FailureEvent(t, node, kind, repair))
        t += rng.expovariate(rate)
    return events


# --- presets -------------------------------------------------------------------------------------

# Llama 3 405B pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4):
# 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs, about 78% of them
# attributed to confirmed or suspected hardware issues.
META_INTERRUPTIONS = 419
META_DAYS = 54.0
META_GPUS = 16_384
META_HARDWARE_SHARE = 0.78
# The llama3-405b preset's spare nodes beside the job's 2,048 (*assumption*): the paper's RoCE
# cluster has 24K GPUs of which up to 16K trained Llama 3 (sec. 3.3.1), so replacements existed;
# how many stood ready is not published. 64 nodes outlast the ~6 nodes a day the job loses to
# hardware at a day's repair.
LLAMA3_SPARE_NODES = 64


@dataclass(frozen=True)
class Preset:
    """A named scenario: cluster size, duration and trace parameters. ``workload`` names the
    job mix (``model.workload``)."""

    name: str
    gpus: int
    days: float
    failure_rate_per_node_per_s: float
    repair_mean_s: float
    mix: Mapping[str, float]
    description: str
    # The job mix (``model.workload``) or, for "llama3-405b", the one job of ``llama3``.
    workload: str = "mix"
    # Whether the large jobs run bf16 with Megatron's distributed optimizer (model: State).
    distributed_optimizer: bool = False

    def trace_config(self, gpus_per_node: int, seed: int = 0, days: float | None = None) -> TraceConfig:
        return TraceConfig(
            nodes=self.gpus // gpus_per_node,
            days=self.days if days is None else days,
            failure_rate_per_node_per_s=self.failure_rate_per_node_per_s,
            repair_mean_s=self.repair_mean_s,
            mix=self.mix,
            seed=seed,
        )


def meta_rate_per_node(gpus_per_node: int = 8) -> float:
    """Failures per node per second implied by the Llama 3 figures."""
    return META_INTERRUPTIONS / (META_DAYS * DAY_S * (META_GPUS / gpus_per_node))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="high-failure-128",
            gpus=128,
            days=7.0,
            # One failure per node every 8 hours: the 16-node cluster fails every 30 min.
            # A stress test in the spirit of the paper's 128-GPU trace experiments, about 250x
            # the Llama 3 rate; chosen so that checkpoint-restart spends much of its time
            # recovering. Not calibrated on a published figure.
            failure_rate_per_node_per_s=1.0 / (8 * 3600.0),
            repair_mean_s=2 * 3600.0,
            mix=DEFAULT_MIX,
            description="128 GPUs, 7 days, one failure per node every 8 h (stress), paper's mix",
        ),
        Preset(
            name="meta-16k",
            gpus=META_GPUS,
            days=META_DAYS,
            failure_rate_per_node_per_s=meta_rate_per_node(),
            repair_mean_s=24 * 3600.0,
            mix=with_hardware_share(DEFAULT_MIX, META_HARDWARE_SHARE),
            description="16,384 GPUs, 54 days, 419 interruptions expected, 78% hardware (Llama 3); "
            "16 distributed-optimizer jobs",
            distributed_optimizer=True,
        ),
        Preset(
            name="scale-100k",
            gpus=100_000,
            days=30.0,
            failure_rate_per_node_per_s=meta_rate_per_node(),
            repair_mean_s=24 * 3600.0,
            mix=with_hardware_share(DEFAULT_MIX, META_HARDWARE_SHARE),
            description="100,000 GPUs, 30 days, the Llama 3 per-node rate and mix (the speed target); "
            "16 distributed-optimizer jobs",
            distributed_optimizer=True,
        ),
        Preset(
            name="llama3-405b",
            gpus=META_GPUS + LLAMA3_SPARE_NODES * 8,
            days=META_DAYS,
            failure_rate_per_node_per_s=meta_rate_per_node(),
            repair_mean_s=24 * 3600.0,
            mix=with_hardware_share(DEFAULT_MIX, META_HARDWARE_SHARE),
            description="Llama 3 405B's own run: one 405B job on 16,384 GPUs (TP 8, PP 16, DP 128) and "
            f"{LLAMA3_SPARE_NODES} spare nodes, 54 days, 419 interruptions expected; checkpoint-restart "
            "calibrated to Meta's >90% effective training time",
            workload="llama3-405b",
            distributed_optimizer=True,
        ),
    )
}


# --- CSV -----------------------------------------------------------------------------------------


def _number(source: str, line: int, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(source, line, f"{name} {text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(source, line, f"{name} must be a finite number >= 0, got {text.strip()!r}")
    return value


def parse_csv(text: str, nodes: int, source: str = "trace") -> list[FailureEvent]:
    """Events from CSV text; ``TraceError`` for the first bad line (1-based line numbers)."""
    events: list[FailureEvent] = []
    last = 0.0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            fields = next(csv.reader([stripped]))
        except csv.Error as exc:
            raise TraceError(source, number, f"malformed line: {exc}") from None
        fields = [f.strip() for f in fields]
        if not events and tuple(f.lower() for f in fields) == CSV_HEADER:
            continue
        if len(fields) != len(CSV_HEADER):
            raise TraceError(
                source, number, f"expected {len(CSV_HEADER)} fields ({','.join(CSV_HEADER)}), got {len(fields)}"
            )
        time_text, node_text, kind_text, repair_text = fields
        time_s = _number(source, number, "time_s", time_text)
        if time_s < last:
            raise TraceError(source, number, f"time_s {time_s:g} is before the previous event's {last:g}")
        try:
            node = int(node_text)
        except ValueError:
            raise TraceError(source, number, f"node {node_text!r} is not a node index") from None
        if not 0 <= node < nodes:
            raise TraceError(source, number, f"unknown node {node} (the cluster has nodes 0..{nodes - 1})")
        try:
            kind = kind_of(kind_text)
        except KeyError:
            raise TraceError(source, number, f"unknown failure kind {kind_text!r}") from None
        repair_s = _number(source, number, "repair_s", repair_text)
        events.append(FailureEvent(time_s, node, kind, repair_s))
        last = time_s
    return events


def load_csv(path: Path, nodes: int) -> list[FailureEvent]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument("trace", f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_csv(text, nodes, source=str(path))


def to_csv(events: Iterable[FailureEvent]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for e in events:
        # repr keeps every float exact, so a saved trace replays bit for bit.
        writer.writerow([repr(e.time_s), e.node, kind_name(e.kind), repr(e.repair_s)])  # type: ignore[arg-type]
    return out.getvalue()


def save_csv(path: Path, events: Sequence[FailureEvent]) -> None:
    path.write_text(to_csv(events))


def observed_rate(events: Sequence[FailureEvent], nodes: int, duration_s: float) -> float:
    """Failures per node per second in a trace (what a coordinator would be configured with)."""
    if duration_s <= 0 or nodes <= 0:
        return 0.0
    return len(events) / (nodes * duration_s)
