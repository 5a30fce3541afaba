"""Priority classes: the weight w(t) a job gets in the planner's objective and whether it may be
preempted, set by the cluster's admins, not by whoever submits (docs/architecture.md: The cost
model). A job names its class (`spec.priority_class`; none: the default class); only an admin
may set a raw `spec.weight` instead. A pure rule over the spec and the classes, applied at
submit before anything is written.

The classes come from the coordinator's `--priority-classes-file` (YAML: a map of name to
`{weight, preemptible}`, and `default: NAME`), else the built-in ones below."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from unicron.errors import InvalidArgument, PermissionDenied
from unicron.v1 import common_pb2

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


@dataclass(frozen=True)
class PriorityClass:
    name: str
    weight: float
    # Its jobs may be paused or shrunk below their size to make room for heavier ones.
    preemptible: bool


@dataclass(frozen=True)
class PriorityClasses:
    classes: Mapping[str, PriorityClass]
    default: str

    def names(self) -> str:
        return ", ".join(sorted(self.classes))


# Weights as the paper's w(t) reads them: a production job is worth ten research jobs per FLOP.
# The default, research, keeps the weight 1.0 every job had before classes existed.
BUILT_IN = PriorityClasses(
    {
        "production": PriorityClass("production", 10.0, False),
        "research": PriorityClass("research", 1.0, False),
        "best-effort": PriorityClass("best-effort", 0.1, True),
    },
    default="research",
)


def load(path: str | Path) -> PriorityClasses:
    """The classes a YAML file defines; ValueError naming what is wrong."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("classes"), dict) or not data["classes"]:
        raise ValueError(f"{path}: expected 'classes: {{NAME: {{weight, preemptible}}, ...}}' and 'default: NAME'")
    classes = {name: _class(name, body, path) for name, body in data["classes"].items()}
    default = data.get("default", "")
    if default not in classes:
        raise ValueError(f"{path}: default {default!r} is not one of the classes ({', '.join(sorted(classes))})")
    return PriorityClasses(classes, default)


def _class(name: Any, body: Any, path: str | Path) -> PriorityClass:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{path}: class name {name!r} must be lowercase letters, digits and '-'")
    if not isinstance(body, dict) or set(body) - {"weight", "preemptible"}:
        raise ValueError(f"{path}: class {name}: takes weight and preemptible only")
    weight = body.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ValueError(f"{path}: class {name}: weight must be a number above 0, got {weight!r}")
    return PriorityClass(name, float(weight), bool(body.get("preemptible", False)))


# What `jobspec.normalized` fills in for a weight left unset: it counts as unset here.
UNSET_WEIGHT = 1.0


def apply(spec: common_pb2.JobSpec, classes: PriorityClasses, admin: bool) -> common_pb2.JobSpec:
    """``spec`` with its class resolved: its weight the class's, and preemptible if the class's
    jobs are (a user may offer preemption, not refuse it). An admin's raw weight is kept (one
    beside a named class only if it is not the unset default). INVALID_ARGUMENT for a class
    that does not exist; PERMISSION_DENIED for a raw weight from anyone but an admin."""
    name = spec.priority_class or classes.default
    chosen = classes.classes.get(name)
    if chosen is None:
        raise InvalidArgument("spec.priority_class", f"no class {name!r}: one of {classes.names()}")
    raw = spec.weight not in (0.0, UNSET_WEIGHT, chosen.weight)
    if raw and not admin:
        raise PermissionDenied(
            f"spec.weight: only an admin sets a raw weight; name a priority_class instead ({classes.names()})"
        )
    keep = admin and spec.weight and (raw or not spec.priority_class)
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    out.priority_class = name
    out.weight = spec.weight if keep else chosen.weight
    out.preemptible = spec.preemptible or chosen.preemptible
    return out
