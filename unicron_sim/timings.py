"""Detection and transition times the strategies use. Every number says where it came from
(``Timings.sources``).

Detection: this project's own measurements (``bench/results/detection.json``) when present,
documented defaults otherwise. Per fault, ``p50_s``: ``exception`` (a caught exception
classified in band), ``crash`` (a process that died), ``hang`` and ``stuck-collective`` (no
iteration within k x the running mean), ``agent-loss`` (a node's heartbeat stops), and the
polling supervisor's measured p50 (the ``exception`` row's ``baseline_s``: what a supervisor
that polls processes every 5 s sees). Measured on a tiny job, where hang detection is bounded
by the iteration time: at scale a hang is noticed at max(measured p50, k x the job's
iteration time) (k = 3, the monitor's default; ``strategies.inband_detection_s``).

Transitions: fitted lines, not the tiny job's p50s. A transition moves (or reloads) every
rank's share of the training state, so its time grows with that share; and it forms a new
process group, whose rendezvous grows with the world. Each action costs

    fixed_s + per_byte_s x state bytes per rank + rendezvous_per_rank_s x world size

with ``fixed_s`` and ``per_byte_s`` per action read from ``data/transition_fit.json``
(``{"source", "measured", "actions": {action: {"fixed_s", "per_byte_s"}}}``, fitted by
bench/transition.py over model sizes; the committed file says ``"source": "placeholder"`` until
it is). Which action a change is, and the work it loses, is ``transitions``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "results"
FIT_PATH = Path(__file__).resolve().parent / "data" / "transition_fit.json"

# Defaults when no measurement exists: what the detection bench's targets allow (0.5 s
# process-level, 3.5 s node loss, hang about 3 iterations).
DEFAULT_DETECTION_S: dict[str, float] = {
    "exception": 0.5,
    "crash": 0.5,
    "hang": 2.0,
    "stuck-collective": 2.0,
    "agent-loss": 3.5,
    "poll": 5.0,
}

# The monitor's hang threshold: k x the running mean iteration time (docs/architecture.md: Detection).
HANG_K = 3.0

# The transitions a job can take (architecture.md, Transitions): the same ranks form a new group
# (reattempt); a replaced rank takes its state from a live peer (restart_peer) or every rank
# restarts from its node's in-memory snapshot (restart_snapshot); ranks are dropped (shrink) or
# added and fetch their shard from a peer (grow); every rank reloads the newest checkpoint
# (checkpoint_restart).
ACTIONS = ("reattempt", "restart_peer", "restart_snapshot", "shrink", "grow", "checkpoint_restart")

# Rendezvous at scale. A reform creates a new process group: a TCPStore rendezvous and NCCL
# communicator initialization, whose bootstrap and connection setup grow with the ranks. Meta's
# NCCLX paper (Si et al., "Collective Communication for 100k+ GPUs", arXiv:2510.20171) puts stock
# NCCL's initialization at about 265 s on 96k GPUs, growing super-linearly, and NCCLX's at about
# 11x less. Caveat: both numbers are as secondary summaries of the paper report them; they were
# not checked against the paper's own figures here. Taken linear through that point, 265 s /
# 96,000 ranks is 2.8 ms per rank: 4 s for a 1,536-rank job, 25 s for 9,216 ranks. Linear
# overstates small worlds if the growth is really super-linear, which errs against Unicron
# (every one of its transitions pays it). The fitted fixed_s already hold the bench's own
# two-rank rendezvous.
RENDEZVOUS_PER_RANK_S = 265.0 / 96_000


@dataclass(frozen=True)
class Line:
    """One action's fitted cost: ``fixed_s + per_byte_s x state bytes per rank``."""

    fixed_s: float
    per_byte_s: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_byte_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def seconds(self, state_bytes_per_rank: float) -> float:
        return self.fixed_s + self.per_byte_s * state_bytes_per_rank


# The placeholder lines of data/transition_fit.json, for when the file is absent (an install
# without the package data) and for tests that must not depend on a fit someone re-ran.
DEFAULT_LINES: dict[str, Line] = {
    "reattempt": Line(0.45, 0.0),
    "restart_peer": Line(0.4, 1e-9),  # peer copy at 1 GB/s per rank
    "restart_snapshot": Line(3.0, 5e-10),  # every process restarts; tmpfs load at 2 GB/s
    "shrink": Line(0.27, 0.0),  # the kept ranks keep their state
    "grow": Line(0.4, 1e-9),
    "checkpoint_restart": Line(3.0, 2e-9),  # checkpoint load at 0.5 GB/s per rank
}


@dataclass(frozen=True)
class TransitionFit:
    """The fitted line of every action, plus the rendezvous term."""

    lines: Mapping[str, Line] = field(default_factory=lambda: dict(DEFAULT_LINES))
    rendezvous_per_rank_s: float = RENDEZVOUS_PER_RANK_S
    source: str = "placeholder (built in)"
    measured: str = ""

    def __post_init__(self) -> None:
        missing = [a for a in ACTIONS if a not in self.lines]
        if missing:
            raise ValueError(f"transition fit lacks actions: {', '.join(missing)}")
        if not (math.isfinite(self.rendezvous_per_rank_s) and self.rendezvous_per_rank_s >= 0):
            raise ValueError("rendezvous_per_rank_s must be a finite number >= 0")

    def rendezvous_s(self, world: int) -> float:
        return self.rendezvous_per_rank_s * world

    def seconds(self, action: str, state_bytes_per_rank: float, world: int) -> float:
        """What ``action`` costs a job of ``world`` ranks holding ``state_bytes_per_rank`` each
        (the work it loses is added by ``transitions``)."""
        if action not in self.lines:
            raise ValueError(f"unknown transition action {action!r}; known: {', '.join(ACTIONS)}")
        return self.lines[action].seconds(state_bytes_per_rank) + self.rendezvous_s(world)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "measured": self.measured,
            "rendezvous_per_rank_s": self.rendezvous_per_rank_s,
            "actions": {a: {"fixed_s": line.fixed_s, "per_byte_s": line.per_byte_s} for a, line in self.lines.items()},
        }


def fit_from_dict(data: Any, where: str = "transition fit") -> TransitionFit:
    """A fit from its JSON form; ValueError naming the bad field. Unknown actions are refused
    (a misspelt one would silently keep its default)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: must be a JSON object")
    actions = data.get("actions")
    if not isinstance(actions, Mapping):
        raise ValueError(f"{where}: 'actions' must be an object of {', '.join(ACTIONS)}")
    unknown = sorted(set(actions) - set(ACTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown actions {', '.join(unknown)}; known: {', '.join(ACTIONS)}")
    lines: dict[str, Line] = {}
    for action in ACTIONS:
        row = actions.get(action)
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: actions.{action} is missing or not an object")
        try:
            lines[action] = Line(row.get("fixed_s"), row.get("per_byte_s"))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"{where}: actions.{action}.{exc}") from None
    rendezvous = data.get("rendezvous_per_rank_s", RENDEZVOUS_PER_RANK_S)
    if isinstance(rendezvous, bool) or not isinstance(rendezvous, (int, float)):
        raise ValueError(f"{where}: rendezvous_per_rank_s must be a number")
    return TransitionFit(
        lines=lines,
        rendezvous_per_rank_s=float(rendezvous),
        source=str(data.get("source", "")),
        measured=str(data.get("measured", "")),
    )


def load_fit(path: Path = FIT_PATH) -> TransitionFit | None:
    """The fit in ``path``; None when there is no such file; ValueError when it is malformed."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    return fit_from_dict(data, str(path))


@dataclass(frozen=True)
class Timings:
    detection_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_DETECTION_S))
    fit: TransitionFit = field(default_factory=TransitionFit)
    sources: Mapping[str, str] = field(default_factory=dict)
    hang_k: float = HANG_K

    def __post_init__(self) -> None:
        for name, value in self.detection_s.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"timing {name!r} must be a finite number >= 0, got {value!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "detection_s": dict(self.detection_s),
            "transition_fit": self.fit.as_dict(),
            "sources": dict(self.sources),
            "hang_k": self.hang_k,
        }


def _p50(rows: Any, key: str, name: str) -> float | None:
    if not isinstance(rows, list):
        return None
    for row in rows:
        if isinstance(row, dict) and row.get(key) == name:
            value = row.get("p50_s")
            if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
                return float(value)
    return None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _detection(results_dir: Path, sources: dict[str, str]) -> dict[str, float]:
    detection = dict(DEFAULT_DETECTION_S)
    sources.update({f"detection.{k}": "default" for k in detection})
    found = _read(results_dir / "detection.json")
    if found is None:
        return detection
    for name in ("exception", "crash", "hang", "stuck-collective", "agent-loss"):
        value = _p50(found.get("faults"), "kind", name)
        if value is not None:
            detection[name] = value
            sources[f"detection.{name}"] = "detection.json p50"
    rows = found.get("faults")
    poll = next((r.get("baseline_s") for r in rows or [] if isinstance(r, dict) and r.get("kind") == "exception"), None)
    if isinstance(poll, (int, float)) and math.isfinite(poll) and poll >= 0:
        detection["poll"] = float(poll)
        sources["detection.poll"] = "detection.json polling supervisor p50"
    return detection


def load(results_dir: Path = RESULTS_DIR, fit_path: Path = FIT_PATH) -> Timings:
    """Measured detection p50s where the result files have them, defaults for the rest; the
    transition fit from ``fit_path`` (the built-in placeholder when the file is absent)."""
    sources: dict[str, str] = {}
    detection = _detection(results_dir, sources)
    fit = load_fit(fit_path)
    if fit is None:
        fit = TransitionFit()
        sources["transition_fit"] = f"built-in placeholder ({fit_path} absent)"
    else:
        sources["transition_fit"] = f"{fit_path.name} (source: {fit.source})"
    return Timings(detection, fit, sources)
