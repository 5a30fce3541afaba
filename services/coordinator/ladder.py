"""The severity ladder (docs/architecture.md: Detection): which remedy an incident gets, given the
remedies the job already had. Pure code, the clock passed in, tested by tables.

SEV3 starts at reattempt in place, SEV2 at restart, SEV1 at reconfigure. A remedy applied
`attempts_per_remedy` times within the window is not tried again: the next heavier one is.
After reconfigure there is nothing heavier, and after `max_remedies` remedies of any kind
within the window the job fails with the reason, so no job loops forever."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from unicron.config import require
from unicron.failures import Action, classify, escalate, kind_name
from unicron.v1 import common_pb2 as pb

REMEDY_OF_ACTION: dict[Action, int] = {
    Action.REATTEMPT: pb.REMEDY_REATTEMPT,
    Action.RESTART: pb.REMEDY_RESTART,
    Action.RECONFIGURE: pb.REMEDY_RECONFIGURE,
}
ACTION_OF_REMEDY = {remedy: action for action, remedy in REMEDY_OF_ACTION.items()}


def remedy_name(remedy: int) -> str:
    return pb.Remedy.Name(remedy).removeprefix("REMEDY_").lower()


@dataclass(frozen=True)
class LadderPolicy:
    attempts_per_remedy: int = 2
    window_s: float = 600.0
    max_remedies: int = 6

    def __post_init__(self) -> None:
        require(self.attempts_per_remedy >= 1, "attempts_per_remedy", "must be at least 1")
        require(self.window_s > 0, "window_s", "must be positive")
        require(self.max_remedies >= 1, "max_remedies", "must be at least 1")


@dataclass(frozen=True)
class Decision:
    """remedy is REMEDY_* or None when the job must fail; reason says why, in words."""

    remedy: int | None
    reason: str


def choose(
    kind: int,
    past: Sequence[pb.RemedyAttempt],
    now: float,
    policy: LadderPolicy,
    ranks_alive: bool = True,
    placement_ready: bool = True,
) -> Decision:
    """The remedy for a new incident of root-cause `kind` on a job whose earlier remedies are
    `past`. ranks_alive=False means a rank of the current generation already exited, so
    there is nothing left to reattempt in place; placement_ready=False means a node of the
    job is lost or isolated, so nothing can restart in place either."""
    recent = [a for a in past if now - a.started.ToNanoseconds() / 1e9 <= policy.window_s]
    window = f"{policy.window_s:g}s"
    if len(recent) >= policy.max_remedies:
        return Decision(None, f"{len(recent)} remedies within {window} did not keep the job healthy")
    failure = classify(kind)  # type: ignore[arg-type]
    name = kind_name(kind)  # type: ignore[arg-type]
    if failure.action is Action.FAIL:
        return Decision(None, f"{name}: the program fails the same way on every retry")
    if failure.action not in REMEDY_OF_ACTION:
        return Decision(None, f"{name} has no remedy")
    action: Action | None = failure.action
    steps = [f"{name} ({failure.description}) calls for {failure.action.value}"]
    if action is Action.REATTEMPT and not ranks_alive:
        action = Action.RESTART
        steps.append(f"a rank already exited, so {action.value}")
    if action in (Action.REATTEMPT, Action.RESTART) and not placement_ready:
        action = Action.RECONFIGURE
        steps.append(f"a node of the job is not ready, so {action.value}")
    while action is not None:
        used = sum(1 for a in recent if a.remedy == REMEDY_OF_ACTION[action])
        if used < policy.attempts_per_remedy:
            return Decision(REMEDY_OF_ACTION[action], "; ".join(steps))
        heavier = escalate(action)
        steps.append(
            f"{action.value} already tried {used}x within {window}"
            + (f", escalating to {heavier.value}" if heavier else "")
        )
        action = heavier
    return Decision(None, "; ".join(steps) + ": no heavier remedy left")
