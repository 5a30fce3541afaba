"""Detection and transition times the strategies use: this project's own measurements
(``bench/results/detection.json``, ``bench/results/transition.json``) when present, documented
defaults otherwise. Every number says where it came from (``Timings.sources``).

From detection.json (per fault, ``p50_s``): ``exception`` (a caught exception classified in
band), ``crash`` (a process that died), ``hang`` and ``stuck-collective`` (no iteration within
k x the running mean), ``agent-loss`` (a node's heartbeat stops), and the polling supervisor's
measured p50 (the ``exception`` row's ``baseline_s``: what a supervisor that polls processes
every 5 s sees). From transition.json (per action, ``p50_s``): ``reattempt``, ``restart`` and
``resize`` (a reconfigure that shrinks a job onto the nodes it has left).

Measured on a tiny job on one machine: process start-up dominates there, and hang detection
scales with the iteration time, which is far longer at scale. So a hang is noticed at
max(measured p50, k x the job's iteration time) (k = 3, the monitor's default), and the
transition times are used as measured (the fast paths keep processes and state in place, so
they do not grow with the model; restart does, which this does not model).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.planner.domain import Transition

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"

# Defaults when no measurement exists. Detection: what the detection bench's targets allow
# (0.5 s process-level, 3.5 s node loss, hang about 3 iterations); transitions: the planner's
# own defaults (services.planner.domain.Transition), reattempt about one collective re-form.
DEFAULT_DETECTION_S: dict[str, float] = {
    "exception": 0.5,
    "crash": 0.5,
    "hang": 2.0,
    "stuck-collective": 2.0,
    "agent-loss": 3.5,
    "poll": 5.0,
}
_planner = Transition()
DEFAULT_TRANSITION_S: dict[str, float] = {
    "reattempt": 1.0,
    "restart": _planner.restart_s,
    "resize": _planner.resize_s,
}

# The monitor's hang threshold: k x the running mean iteration time (docs/architecture.md: Detection).
HANG_K = 3.0


@dataclass(frozen=True)
class Timings:
    detection_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_DETECTION_S))
    transition_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TRANSITION_S))
    sources: Mapping[str, str] = field(default_factory=dict)
    hang_k: float = HANG_K

    def __post_init__(self) -> None:
        for table in (self.detection_s, self.transition_s):
            for name, value in table.items():
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ValueError(f"timing {name!r} must be a finite number >= 0, got {value!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "detection_s": dict(self.detection_s),
            "transition_s": dict(self.transition_s),
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


def load(results_dir: Path = RESULTS_DIR) -> Timings:
    """Measured p50s where the result files have them, defaults for the rest."""
    detection = dict(DEFAULT_DETECTION_S)
    transition = dict(DEFAULT_TRANSITION_S)
    sources = {f"detection.{k}": "default" for k in detection} | {f"transition.{k}": "default" for k in transition}
    found = _read(results_dir / "detection.json")
    if found is not None:
        for name in ("exception", "crash", "hang", "stuck-collective", "agent-loss"):
            value = _p50(found.get("faults"), "kind", name)
            if value is not None:
                detection[name] = value
                sources[f"detection.{name}"] = "detection.json p50"
        rows = found.get("faults")
        poll = next(
            (r.get("baseline_s") for r in rows or [] if isinstance(r, dict) and r.get("kind") == "exception"), None
        )
        if isinstance(poll, (int, float)) and math.isfinite(poll) and poll >= 0:
            detection["poll"] = float(poll)
            sources["detection.poll"] = "detection.json polling supervisor p50"
    found = _read(results_dir / "transition.json")
    if found is not None:
        for name in ("reattempt", "restart", "resize"):
            value = _p50(found.get("actions"), "action", name)
            if value is not None:
                transition[name] = value
                sources[f"transition.{name}"] = "transition.json p50"
    return Timings(detection, transition, sources)
