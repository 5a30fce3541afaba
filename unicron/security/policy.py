"""What each kind of caller may call: a rule per method, and whose jobs a caller sees."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from unicron.errors import PermissionDenied
from unicron.security.identity import Kind, Principal

log = logging.getLogger(__name__)


# ---- authorization --------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Who may call a method. `bound_field`: a caller bound to a node may only name that node
    in this request field."""

    kinds: frozenset[Kind]
    bound_field: str = ""
    public: bool = False  # no credentials needed (health checks, reflection)


PUBLIC = Rule(frozenset(), public=True)
_JOBS = Rule(frozenset({Kind.USER}))
_NODES = Rule(frozenset({Kind.NODE, Kind.AGENT}), bound_field="node_id")

# Every method of every Unicron server, by service or by method (a method's entry wins). A
# method in none of them is refused: a new RPC needs a line here before anyone can call it.
POLICY: Mapping[str, Rule] = {
    "/unicron.v1.JobService/": _JOBS,
    "/unicron.v1.NodeService/": _NODES,
    "/unicron.v1.PlannerService/": Rule(frozenset({Kind.SERVICE})),
    # The hello names the job, generation and rank: TrainerLink checks it against the token.
    "/unicron.v1.TrainerAgentService/": Rule(frozenset({Kind.WORKER})),
    # The agent serves its trainers' output to the coordinator alone (the agent admits no
    # service certificate but the coordinator's); users go through JobService.StreamLogs,
    # which checks that the job is theirs.
    "/unicron.v1.AgentLogService/": Rule(frozenset({Kind.SERVICE})),
    "/grpc.health.v1.Health/": PUBLIC,
    "/grpc.reflection.v1alpha.ServerReflection/": PUBLIC,
    "/grpc.reflection.v1.ServerReflection/": PUBLIC,
}


def rule_for(policy: Mapping[str, Rule], method: str) -> Rule | None:
    if method in policy:
        return policy[method]
    service = method[: method.rfind("/") + 1]
    return policy.get(service)


def authorize(principal: Principal, rule: Rule | None, method: str, request: Any = None) -> None:
    """Raises PermissionDenied unless `principal` may make this call."""
    if principal.kind == Kind.TRUSTED:
        return
    if rule is None:
        raise PermissionDenied(f"{method} is not open to anyone")
    if rule.public:
        return
    if principal.kind not in rule.kinds:
        raise PermissionDenied(f"{principal.kind} {principal.name or '(unnamed)'} may not call {method}")
    if rule.bound_field and principal.kind == Kind.NODE and request is not None:
        named = getattr(request, rule.bound_field, None)
        if named is not None and named != principal.name:
            raise PermissionDenied(f"{rule.bound_field}: node {principal.name} may not speak for {named!r}")


def owner_scope(principal: Principal) -> str | None:
    """Whose jobs a caller sees and may change: None (all) for an admin, else their own."""
    return None if principal.admin else principal.name
