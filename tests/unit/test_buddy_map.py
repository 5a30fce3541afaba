"""Who keeps whose buddy copy (unicron/buddy_map.py), and the map the coordinator writes into a
job's assignment (services/coordinator/decide.py)."""

from __future__ import annotations

import pytest

from services.coordinator import decide
from unicron.buddy_map import NO_KEEPER, choose_shift, data_parallel_groups, keepers, smallest_shift
from unicron.v1 import common_pb2


@pytest.mark.parametrize(
    ("nodes", "shift"),
    [
        (["a", "b"], 1),
        (["a", "a", "b", "b"], 2),  # the next rank shares the node: two places on
        (["a", "b", "a", "b"], 1),
        (["a", "a", "a", "b"], 0),  # no shift puts every rank's buddy elsewhere
        (["a", "a"], 0),  # one node: no buddy
        (["a"], 0),
    ],
)
def test_a_buddy_runs_on_another_node(nodes: list[str], shift: int) -> None:
    assert smallest_shift(nodes) == shift


@pytest.mark.parametrize(
    ("nodes", "domains", "chosen"),
    [
        # Four nodes in two racks, rack-major: shift 1 leaves the rack for half the ranks only.
        (["a", "b", "c", "d"], ["r1", "r1", "r2", "r2"], (2, "failure domain")),
        (["a", "b", "c", "d"], ["r1", "r2", "r1", "r2"], (1, "failure domain")),
        # One rack for all: apart by node.
        (["a", "b", "c", "d"], ["r1", "r1", "r1", "r1"], (1, "node")),
        # No domains given: apart by node.
        (["a", "a", "b", "b"], ["", "", "", ""], (2, "node")),
        # Three racks of uneven size: no shift separates racks, nodes still can.
        (["a", "b", "c", "d"], ["r1", "r1", "r1", "r2"], (1, "node")),
        (["a", "a"], ["r1", "r1"], (0, "")),
    ],
)
def test_another_failure_domain_first_then_another_node(
    nodes: list[str], domains: list[str], chosen: tuple[int, str]
) -> None:
    assert choose_shift(nodes, domains) == chosen


def test_the_data_parallel_groups_follow_megatrons_rank_order() -> None:
    # TP 2, PP 2, DP 2: tensor-fastest, then data-parallel, then pipeline.
    assert data_parallel_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert data_parallel_groups(3, 1, 1) == [[0, 1, 2]]


def test_each_slice_keeps_its_copies_in_its_own_group() -> None:
    # TP 2 x DP 2 on two nodes of two slots: node a holds ranks 0, 1 (DP rank 0 of both
    # tensor slices), node b ranks 2, 3.
    keeper, note = keepers(["a", "a", "b", "b"], ["", "", "", ""], 2, 1)
    assert keeper == [2, 3, 0, 1]
    assert note == "each optimizer shard's buddy copy in another node"


def test_a_group_on_one_node_has_no_copy_and_says_so() -> None:
    keeper, note = keepers(["a", "a", "b", "b"], ["", "", "", ""], 1, 1)
    assert keeper == [2, 3, 0, 1]  # shift 2: a's ranks to b
    keeper, note = keepers(["a", "a"], ["", ""], 1, 1)
    assert keeper == [NO_KEEPER, NO_KEEPER]
    assert note.startswith("no buddy copy for some shards (every data-parallel rank of slice (0, 0) on node a)")


def _node(node_id: str, domain: str) -> common_pb2.Node:
    return common_pb2.Node(node_id=node_id, address=f"127.0.0.1:{5000 + ord(node_id[-1])}", failure_domain=domain)


def _spec(distributed: bool, replication: int = 0) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name="j")
    spec.parallelism.tensor = spec.parallelism.pipeline = 1
    spec.training.distributed_optimizer = distributed
    spec.training.replication = replication
    return spec


def test_the_assignment_carries_the_domains_and_the_map() -> None:
    nodes = {
        n.node_id: n
        for n in (_node("n1", "rack-1"), _node("n2", "rack-1"), _node("n3", "rack-2"), _node("n4", "rack-2"))
    }
    assignment = decide.assignment_for(_spec(True), {n: 1 for n in nodes}, nodes, 1)
    assert [w.failure_domain for w in assignment.workers] == ["rack-1", "rack-1", "rack-2", "rack-2"]
    assert list(assignment.copy_kept_by) == [2, 3, 0, 1]
    assert assignment.copies == "each optimizer shard's buddy copy in another failure domain"


@pytest.mark.parametrize(("distributed", "replication"), [(False, 0), (True, 1)])
def test_no_map_without_copies(distributed: bool, replication: int) -> None:
    nodes = {n.node_id: n for n in (_node("n1", ""), _node("n2", ""))}
    assignment = decide.assignment_for(_spec(distributed, replication), {"n1": 1, "n2": 1}, nodes, 1)
    assert list(assignment.copy_kept_by) == [] and assignment.copies == ""


def test_a_placement_without_copies_for_some_shards_says_so_in_its_reason() -> None:
    from services.coordinator.replan import _copies_lacking

    nodes = {"n1": _node("n1", "")}
    alone = decide.assignment_for(_spec(True), {"n1": 2}, nodes, 1)
    assert _copies_lacking(alone) == (
        "; training.replication 2: no buddy copy for some shards (every data-parallel rank of slice (0, 0)"
        " on node n1): a lost rank's shard comes from a snapshot or the checkpoint"
    )
    apart = decide.assignment_for(_spec(True), {"n1": 1, "n2": 1}, {**nodes, "n2": _node("n2", "")}, 1)
    assert _copies_lacking(apart) == ""


def test_a_job_that_says_replication_2_gets_the_map_without_the_distributed_optimizer() -> None:
    """An FSDP2 program keeps copies by default, but its spec cannot say it is one: said, 2 maps."""
    nodes = {n.node_id: n for n in (_node("n1", ""), _node("n2", ""))}
    assignment = decide.assignment_for(_spec(False, 2), {"n1": 1, "n2": 1}, nodes, 1)
    assert list(assignment.copy_kept_by) == [1, 0]
