"""Who may report for a rank: the node the job's assignment places it on. Pure.

The guard already keeps a node certificate to its own node_id (security/policy.py); an agent
with the join token names any node it likes. What keeps a node from speaking for another's
ranks (ending a job with made-up exits, escalating remedies with made-up failures, moving
its progress) is this check against the job's assignment."""

from __future__ import annotations

import logging

from unicron.errors import InvalidArgument, PermissionDenied
from unicron.v1 import common_pb2

log = logging.getLogger(__name__)


def ranks_on(assignment: common_pb2.Assignment, node_id: str) -> set[int]:
    return {rank for placement in assignment.workers if placement.node_id == node_id for rank in placement.ranks}


def check_reporter(job: common_pb2.Job, node_id: str, generation: int, rank: int | None, field: str) -> None:
    """Refuses (PERMISSION_DENIED, logged) a report from `node_id` about `rank` of the job's
    current generation that the assignment places on another node; with no rank (a job-wide
    report), one from a node that hosts none of the generation's ranks. `field` names the
    rank in the request, for a rank the generation does not have (INVALID_ARGUMENT).

    A report of an older generation passes: it is stale, and only the current assignment is
    kept, not who hosted which rank before. Stale reports change little (reports.py and
    intake.py: they join an incident already open, or record the progress rank 0 made before
    a remedy overtook it), and the node that sends one is the node that hosted the rank."""
    if not node_id:
        raise InvalidArgument("node_id", "is required")
    assignment = job.assignment
    if generation != assignment.generation:
        return
    if rank is not None and rank >= assignment.world_size:
        raise InvalidArgument(
            field,
            f"job {job.job_id} has no rank {rank} in generation {generation} (world size {assignment.world_size})",
        )
    hosted = ranks_on(assignment, node_id)
    if rank is None and hosted:
        return
    if rank is not None and rank in hosted:
        return
    what = f"rank {rank}" if rank is not None else "any rank"
    problem = f"node {node_id} does not host {what} of job {job.job_id} in generation {generation}"
    log.warning(
        "report refused: node speaks for ranks it does not host",
        extra={"node_id": node_id, "job_id": job.job_id, "generation": generation, "rank": rank, "field": field},
    )
    raise PermissionDenied(problem)
