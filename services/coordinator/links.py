"""Which node's links a stalled job blames. Pure.

A job whose every node still beats but whose collectives stall may be stalled by one host's
network: a host cut off from its peers while the control plane still hears it. Each agent's
hang report says which of the job's other nodes it could not reach (`unreachable_peers`)
and which it reached (`reachable_peers`; services/agent/peers.py). A node whose links fail
to more of its peers than they work to is the one parted from the job: it reaches none,
while every other node reaches all but it. When every node looks parted (the job split in halves), nothing
is blamed: no host is the odd one out. Nor is anything blamed before every node of the job
has given its account: one side of a link alone cannot tell which end failed."""

from __future__ import annotations

from unicron.v1 import common_pb2

# How long a hang naming an unreachable peer waits for every node's account (their agents
# see the same stall within a monitor period or two; one whose verdict is held, or whose
# host is silent, is not waited for longer).
LINK_HOLD_S = 1.0


def names_a_link(incident: common_pb2.Incident) -> bool:
    """Whether a report of the incident's generation says a peer could not be reached."""
    return any(r.unreachable_peers for r in incident.reports if r.generation == incident.generation)


def reporters(incident: common_pb2.Incident) -> set[str]:
    """The nodes with a hang report of the incident's generation."""
    return {
        r.node_id
        for r in incident.reports
        if r.generation == incident.generation and r.kind == common_pb2.FAILURE_KIND_TASK_HANG
    }


def accounts_pending(incident: common_pb2.Incident, job_nodes: set[str]) -> bool:
    """Whether a hang names an unreachable peer and a node of the job has yet to report:
    which end of a failing link is cut off takes every node's account. A hang whose
    reports all reach their peers is the program's, answered at once."""
    return names_a_link(incident) and not job_nodes <= reporters(incident)


def parted_nodes(incident: common_pb2.Incident, job_nodes: set[str]) -> set[str]:
    """The job's nodes whose links to the others fail, by the hang reports of the incident's
    generation, once every node of the job has given one."""
    if not names_a_link(incident) or not job_nodes <= reporters(incident):
        return set()
    bad: dict[str, set[str]] = {n: set() for n in job_nodes}
    good: dict[str, set[str]] = {n: set() for n in job_nodes}
    for report in incident.reports:
        here = report.node_id
        if report.generation != incident.generation or report.kind != common_pb2.FAILURE_KIND_TASK_HANG:
            continue
        for table, peers in ((bad, report.unreachable_peers), (good, report.reachable_peers)):
            for there in peers:
                if there in job_nodes and there != here:
                    table[here].add(there)
                    table[there].add(here)
    for node in job_nodes:  # a pair one side says fails is not a working link
        good[node] -= bad[node]
    parted = {n for n in job_nodes if bad[n] and len(bad[n]) > len(good[n])}
    return parted if parted != job_nodes else set()
