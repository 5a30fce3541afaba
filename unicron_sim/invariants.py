"""What must hold after every simulated run, whatever the models' numbers: a broken one is a bug
in the simulator (or in the decision code it runs), so it stops the run with the reason rather
than report a number that cannot be true.

- No strategy trains more than its own failure-free run: failures only take capacity away, and
  a failure-free run is already where the strategy puts the jobs (for Unicron, where the
  planner puts them on arrival). An efficiency above 1 means capacity appeared from nowhere or
  the failure-free reference is not the best the strategy does.
- A strategy that re-plans on node loss (Unicron) re-plans after every node a failure took out,
  within the longest time it can take to notice a SEV1 failure in band: a node out that no plan
  saw is capacity the cluster thinks it still has.
- ETTR lies in [0, 1] and no incident costs less than nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Floating-point slack: the WAF integral sums many products in another order than the reference.
RELATIVE_TOLERANCE = 1e-9


class InvariantError(RuntimeError):
    """A simulated run broke an invariant; the message names the strategy and what broke."""


def check_efficiency(strategy: str, waf_seconds: float, failure_free_waf_seconds: float) -> None:
    if waf_seconds > failure_free_waf_seconds * (1.0 + RELATIVE_TOLERANCE):
        raise InvariantError(
            f"{strategy}: trained {waf_seconds:.6e} WAF-seconds, more than its failure-free run's "
            f"{failure_free_waf_seconds:.6e} (efficiency {waf_seconds / failure_free_waf_seconds:.6f} > 1)"
        )


def check_replans(
    strategy: str, taken_out: Sequence[float], plan_times: Sequence[float], bound_s: float, duration_s: float
) -> None:
    """Every node taken out at t (before duration_s - bound_s, when the re-plan is still due
    within the run) is followed by a re-plan in [t, t + bound_s]."""
    plans = sorted(plan_times)
    for t in taken_out:
        if t + bound_s >= duration_s:
            continue
        i = bisect.bisect_left(plans, t)
        if i == len(plans) or plans[i] > t + bound_s + RELATIVE_TOLERANCE * max(1.0, t):
            raise InvariantError(
                f"{strategy}: a node taken out at t={t:.3f} s was not re-planned within {bound_s:.3f} s "
                f"({len(taken_out)} nodes out, {len(plans)} re-plans)"
            )


def check_ettr(strategy: str, ettr: float) -> None:
    if not 0.0 <= ettr <= 1.0 + RELATIVE_TOLERANCE:
        raise InvariantError(f"{strategy}: ETTR {ettr} outside [0, 1]")


def check_costs(strategy: str, costs: Sequence[float]) -> None:
    # Exact zero is the floor; a tiny negative is float noise in cost.accrue_sub_healthy.
    worst = min(costs, default=0.0)
    if worst < -1e-6 * max(1.0, max((abs(c) for c in costs), default=1.0)):
        raise InvariantError(f"{strategy}: an incident costs {worst} WAF-seconds, less than nothing")
