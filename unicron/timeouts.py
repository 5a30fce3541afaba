"""The timeouts that span processes, in one place: their defaults and the order they must
keep. Each is owned by one process's settings (the trainer's or the coordinator's), which
check at start the pairs they can see, so a setting that breaks the order stops the process
with one line naming it instead of a recovery that waits out the wrong clock.

Why the order: a rank stuck in a collective of a group its peers left leaves it (the reform
watchdog) before the collective times out; a hung collective fails, and a rank stops waiting
for a decision, before the coordinator gives up on the remedy; an agent's missing
acknowledgement is noticed before that too."""

from __future__ import annotations

from collections.abc import Mapping

from unicron.errors import InvalidArgument

# Trainer: a torch.distributed collective, Megatron's groups included.
COLLECTIVE_S = 120.0
# Trainer: waiting for the agent's answer to a reattemptable (SEV3) error it reported.
DECISION_WAIT_S = 60.0
# Trainer: a reform left unread this long (and REFORM_OVERDUE_STEPS steps) means the training
# thread is stuck in its old group; the rank exits so that it restarts from a peer.
REFORM_OVERDUE_S = 20.0
# Coordinator: an agent's acknowledgement of a start, stop or reform command.
ACK_S = 15.0
# Coordinator: a remedy's job brings back an iteration, else it counts as a new failure.
RECOVERY_S = 180.0

# (shorter, longer, why), by the names above in lowercase without the unit.
ORDER: tuple[tuple[str, str, str], ...] = (
    ("reform_overdue", "collective", "a rank stuck in its old group must leave it before the collective times out"),
    ("collective", "recovery", "a hung collective must fail before the coordinator gives the remedy up"),
    ("decision_wait", "recovery", "a rank must stop waiting for a decision before the coordinator gives the remedy up"),
    ("ack", "recovery", "a missing acknowledgement must be noticed before the remedy's deadline"),
)


def check_order(values: Mapping[str, tuple[str, float]], fixed: frozenset[str] = frozenset()) -> None:
    """Raises InvalidArgument naming the setting that breaks the order. ``values``: timeout
    (a name of ORDER) -> (the setting that holds it, its value in seconds); pairs with a
    timeout missing are not checked. ``fixed``: timeouts this process cannot set (another
    process's defaults), so the error names the other one of the pair."""
    for shorter, longer, why in ORDER:
        if shorter in values and longer in values:
            (name, value), (other, bound) = values[shorter], values[longer]
            if value < bound:
                continue
            if shorter in fixed:
                raise InvalidArgument(other, f"must exceed {name} ({bound:g} s is not above {value:g} s): {why}")
            raise InvalidArgument(name, f"must be below {other} ({value:g} s is not below {bound:g} s): {why}")
