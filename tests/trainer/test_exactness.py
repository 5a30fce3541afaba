"""Exactness through the library at a size that means something: the GPT example at about 1M
parameters over 20 iterations, with Megatron's default dropout (0.1) on, through real trainer
processes. Dropout's masks are drawn from generators seeded per micro-batch by the samples it
holds (``randomness.keyed_seed``), so no remedy changes them.

A remedy that keeps the layout ends bit-identical to a failure-free run of that layout, every
tensor of every (TP, PP) shard, none left out:

* reattempt by reform (an injected collective timeout inside the gradient all-reduce) under
  DP 2, TP 2 and PP 2;
* restart of a killed rank whose state comes from a live peer, from the node's snapshots, and
  from the persistent checkpoint (DP 2).

A resize changes the order in which gradients are summed, so the result moves by float
rounding: a shrink (DP 2 -> 1) and a grow (DP 1 -> 2), also with TP 2, end within twice the
distance between failure-free runs at the two data-parallel degrees (measured here, in the
same session; about 1.4e-5 relative for the largest tensor with dropout on, 4e-7 without).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.harness import (
    FakeAgent,
    ProcessKey,
    ReformAgent,
    free_port,
    leave_at_six,
    relative_difference,
    restart_rank_one_from_its_buddy,
    run_ranks,
    start_trainer,
)
from unicron.trainer import checkpoint
from unicron.trainer.optimizer_shards import SHARDS_KEY, cut
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2
from unicron_dev.localcluster import gpt_program

# Minutes of real training through every remedy: with the end-to-end suite (make test-e2e).
pytestmark = pytest.mark.e2e

ITERATIONS = 20
# 4 layers of hidden 128 and a 1024-token vocabulary: 1.05M parameters.
SHAPE = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 1024}
ALLREDUCE_TIMEOUT = "exception:collective_timeout:allreduce@7"


def spec_of(
    tensor: int = 1,
    pipeline: int = 1,
    checkpoint_interval: int = ITERATIONS,
    precision: str = "fp32",
    distributed_optimizer: bool = False,
) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name="exact", program=common_pb2.ProgramSpec(**gpt_program(**SHAPE)))  # type: ignore[arg-type]
    spec.parallelism.tensor, spec.parallelism.pipeline, spec.parallelism.data = tensor, pipeline, 1
    t = spec.training
    t.iterations, t.global_batch_size, t.micro_batch_size = ITERATIONS, 4, 1
    t.learning_rate, t.seed, t.checkpoint_interval = 2e-3, 5, checkpoint_interval
    t.lr_warmup_iterations, t.lr_decay_style, t.min_learning_rate = 3, "cosine", 2e-4
    t.precision, t.distributed_optimizer = precision, distributed_optimizer
    return spec


def shards(root: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Every (TP, PP) shard's model and optimizer state of the newest checkpoint, which must be
    of the last iteration."""
    (iteration, *_) = checkpoint.list_complete(root)
    assert iteration == ITERATIONS
    saved = checkpoint.read_manifest(root, iteration)["layout"]
    tp, pp = saved["tensor_parallel"], saved["pipeline_parallel"]
    layout = checkpoint.layout_of_config(saved["model"], tp, pp)
    out = {}
    for shard in [(t, p) for t in range(tp) for p in range(pp)]:
        found = checkpoint.find_latest(root, layout, *shard)
        assert found is not None and found[0] == ITERATIONS
        out[shard] = found[1]
    return out


def main_parameters(state: dict[str, Any]) -> dict[str, Any]:
    """The parameters the optimizer updates: in bf16 its fp32 main copies (Megatron's
    mixed-precision optimizer keeps them as ``fp32_from_fp16_params``, by group; the
    distributed optimizer in its data-parallel ranks' shards, put together here), in fp32 the
    model's own."""
    if SHARDS_KEY in state:
        names = {n: p["numel"] for shard in state[SHARDS_KEY] for n, p in shard["pieces"].items()}
        whole = cut(state[SHARDS_KEY], {name: (numel, 0, numel) for name, numel in names.items()})
        return {name: tensors["param"] for name, tensors in whole.items()}
    groups = state["optimizer"].get("fp32_from_fp16_params")
    if groups is None:
        return {k: v for k, v in state["model"].items() if hasattr(v, "numel")}
    return {f"group{g}.{i}": p for g, group in enumerate(groups) for i, p in enumerate(group)}


def _differing(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    assert sorted(got) == sorted(want)
    return sorted(k for k, v in want.items() if hasattr(v, "numel") and not v.equal(got[k]))


def assert_exact(got_root: Path, want: dict[tuple[int, int], dict[str, Any]]) -> None:
    """Every tensor of every shard bit-identical to ``want``'s: the model's parameters and, in
    bf16, the optimizer's fp32 main parameters."""
    got = shards(got_root)
    assert sorted(got) == sorted(want)
    for shard, state in want.items():
        params = sum(v.numel() for v in state["model"].values() if hasattr(v, "numel"))
        assert params > 100_000, "a model that means something"
        for part, read in (("model", lambda s: s["model"]), ("main", main_parameters)):
            mine, theirs = read(got[shard]), read(state)
            differ = _differing(mine, theirs)
            worst = relative_difference(mine, theirs)
            assert not differ, (
                f"shard {shard}: {len(differ)} {part} tensors differ ({worst:.2e} relative): {differ[:3]}"
            )
        assert got[shard]["scheduler"] == state["scheduler"]


def distance(a: dict[tuple[int, int], dict[str, Any]], b: dict[tuple[int, int], dict[str, Any]]) -> float:
    """The largest relative difference of one main parameter (fp32) between two runs' shards."""
    assert sorted(a) == sorted(b)
    return max(relative_difference(main_parameters(a[shard]), main_parameters(b[shard])) for shard in a)


def assert_within(got_root: Path, want: dict[tuple[int, int], dict[str, Any]], bound: float) -> None:
    got = shards(got_root)
    worst = distance(got, want)
    assert worst <= bound, f"a main parameter differs by {worst:.2e} relative, over the bound {bound:.2e}"
    for shard, state in want.items():
        assert got[shard]["scheduler"] == state["scheduler"]


def resize_bound(references: dict[str, Any], tensor: int = 1) -> tuple[dict[tuple[int, int], dict[str, Any]], float]:
    """The DP 1 reference of a layout and the bound a resize between DP 1 and DP 2 must keep:
    twice the distance between the failure-free runs at the two degrees."""
    one = references["get"](f"tp{tensor}dp1", tensor, tensor)
    two = references["get"](f"tp{tensor}dp2", 2 * tensor, tensor)
    measured = distance(one, two)
    print(f"TP {tensor}: failure-free DP 1 and DP 2 runs lie {measured:.3e} apart (largest main parameter, relative)")
    return one, 2 * measured


@pytest.fixture(scope="module", params=["fp32", "bf16", "bf16-distributed"])
def references(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every test once per precision, and in bf16 with Megatron's distributed optimizer too.
    ``get``: failure-free runs, (layout name) -> every shard of the final checkpoint; ``spec``:
    the job spec of a layout in this configuration; ``distributed``: whether its optimizer is."""
    made: dict[str, Any] = {}
    precision, _, optimizer = request.param.partition("-")
    distributed = optimizer == "distributed"

    def spec(tensor: int = 1, pipeline: int = 1, checkpoint_interval: int = ITERATIONS) -> common_pb2.JobSpec:
        return spec_of(tensor, pipeline, checkpoint_interval, precision, distributed)

    def reference(name: str, world: int, tensor: int = 1, pipeline: int = 1) -> dict[tuple[int, int], dict[str, Any]]:
        if name not in made:
            work = tmp_path_factory.mktemp(f"reference-{precision}-{name}")
            agent = FakeAgent()
            try:
                results = run_ranks(agent, spec(tensor, pipeline), world, work, work / "ckpt")
            finally:
                agent.stop()
            for result in results:
                assert result.returncode == 0, result.log[-3000:]
            made[name] = shards(work / "ckpt")
        return made[name]

    yield {"get": reference, "spec": spec, "distributed": distributed}


def _reattempt(tmp_path: Path, spec: common_pb2.JobSpec) -> Path:
    port, new_port = free_port(), free_port()
    keys: list[ProcessKey] = [(1, 0), (1, 1)]
    agent = ReformAgent({(1, 0): 0, (1, 1): 1}, generation=2, world_size=2, port=new_port, when=ReformAgent.any_error)
    root = tmp_path / "ckpt"
    fault = trainer_env(fault_injection=True, faults=(ALLREDUCE_TIMEOUT,))
    try:
        ranks = [
            start_trainer(agent.address, spec, k[1], 2, port, tmp_path, 1, root, fault if k[1] else None) for k in keys
        ]
        results = [r.wait() for r in ranks]
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    assert sorted(agent.hellos) == keys  # reformed in place: no process restarted
    for key in keys:
        assert [r.generation for r in agent.of(key, "iteration")][6] == 2
    return root


@pytest.mark.parametrize(("name", "tensor", "pipeline"), [("tp1dp2", 1, 1), ("tp2dp1", 2, 1), ("pp2", 1, 2)])
def test_a_reattempt_by_reform_is_exact(
    references: dict[str, Any], tmp_path: Path, name: str, tensor: int, pipeline: int
) -> None:
    want = references["get"](name, 2, tensor, pipeline)
    assert_exact(_reattempt(tmp_path, references["spec"](tensor, pipeline)), want)


def test_a_restart_from_a_live_peer_is_exact(references: dict[str, Any], tmp_path: Path) -> None:
    """Rank 1 is killed in iteration 9; rank 0 reforms into a new group with a new process
    for rank 1, which takes the state from it. Under the distributed optimizer no peer holds
    rank 1's optimizer shard: both ranks go back to their node's snapshots (every 2
    iterations) instead."""
    port, new_port = free_port(), free_port()
    agent = ReformAgent({(1, 0): 0}, generation=2, world_size=2, port=new_port, when=ReformAgent.any_error)
    root = tmp_path / "ckpt"
    snapshots = {"snapshot_dir": str(tmp_path / "snapshots")} if references["distributed"] else {}
    crash = trainer_env(fault_injection=True, faults=("crash@9",), **snapshots)
    try:
        spec = references["spec"]()
        plain = trainer_env(**snapshots) if snapshots else None
        old = [start_trainer(agent.address, spec, r, 2, port, tmp_path, 1, root, crash if r else plain) for r in (0, 1)]
        assert old[1].wait().returncode != 0
        restarted = start_trainer(
            agent.address, spec, 1, 2, new_port, tmp_path, 2, root, trainer_env(state_from_peer=True, **snapshots)
        )
        for result in (old[0].wait(), restarted.wait()):
            assert result.returncode == 0, result.log[-3000:]
    finally:
        agent.stop()
    first = agent.of((2, 1), "iteration")[0]
    if references["distributed"]:
        # The crash may cut the write of iteration 8's snapshot short: then 6 is the newest.
        assert (first.state_source, first.restored_iteration) in {("snapshot", 8), ("snapshot", 6)}
    else:
        assert (first.iteration, first.state_source, first.restored_iteration) == (9, "peer", 8)
    assert_exact(root, references["get"]("tp1dp2", 2))


def test_a_restart_of_every_rank_is_exact_from_snapshots_and_from_the_checkpoint(
    references: dict[str, Any], tmp_path: Path
) -> None:
    """Both ranks die in iteration 13 (rank 1 killed, rank 0 stopped in its broken group).
    Started again they resume from their node's snapshots (every 2 iterations: 12); started
    again from a copy of the same moment without the snapshots, from the persistent checkpoint
    (every 5: 10). Both end exact."""
    root, snapshots = tmp_path / "ckpt", tmp_path / "snapshots"
    env = trainer_env(snapshot_dir=str(snapshots))
    # Rank 0 reports its broken group; told to stop, it exits (143) instead of waiting.
    agent = FakeAgent(stop_on_error=True)
    spec = references["spec"](checkpoint_interval=5)
    try:
        crashed = run_ranks(agent, spec, 2, tmp_path / "a", root, faults={1: "crash@13"}, extra_env=env)
        assert all(r.returncode != 0 for r in crashed)
        shutil.copytree(root, tmp_path / "ckpt-copy")
        for source, checkpoints, extra in (("snapshot", root, env), ("checkpoint", tmp_path / "ckpt-copy", {})):
            resumed = run_ranks(agent, spec, 2, tmp_path / source, checkpoints, extra_env=extra)
            for result in resumed:
                assert result.returncode == 0, result.log[-3000:]
            first = [r for r in agent.of(0, "iteration") if r.state_source][-1]
            assert (first.state_source, first.restored_iteration) == (source, 12 if source == "snapshot" else 10)
            assert_exact(checkpoints, references["get"]("tp1dp2", 2))
    finally:
        agent.stop()


def _shrink_interval(references: dict[str, Any]) -> int:
    """Under the distributed optimizer the rank that leaves takes its optimizer shard with it:
    a shrink reshards the persistent checkpoint, taken every 5 iterations for that."""
    return 5 if references["distributed"] else ITERATIONS


def _assert_shrink_source(references: dict[str, Any], agent: ReformAgent, key: ProcessKey) -> None:
    if references["distributed"]:
        reports = [r for r in agent.of(key, "iteration") if r.generation == 2 and r.state_source]
        assert (reports[0].state_source, reports[0].restored_iteration) == ("checkpoint", 5)


def test_a_shrink_is_exact_against_one_rank(references: dict[str, Any], tmp_path: Path) -> None:
    """DP 2 -> 1 at iteration 6 (rank 1 exits; rank 0 reforms alone): the updates are those of
    one rank with the whole global batch, so the parameters equal a DP 1 run's."""
    spec = references["spec"](checkpoint_interval=_shrink_interval(references))
    root, agent = _shrink(spec, tmp_path)
    assert [r.generation for r in agent.of((1, 0), "iteration")][5] == 2
    _assert_shrink_source(references, agent, (1, 0))
    assert_within(root, *resize_bound(references))


def _shrink(spec: common_pb2.JobSpec, tmp_path: Path) -> tuple[Path, ReformAgent]:
    """DP 2 -> 1 at iteration 6: rank 1 exits, rank 0 reforms alone and trains to the end."""
    port, new_port = free_port(), free_port()
    root = tmp_path / "ckpt"
    agent = ReformAgent({(1, 0): 0}, generation=2, world_size=1, port=new_port, when=ReformAgent.any_error)
    exits = trainer_env(fault_injection=True, faults=("exit@6",))
    try:
        ranks = [
            start_trainer(agent.address, spec, r, 2, port, tmp_path, 1, root, exits if r else None) for r in (0, 1)
        ]
        assert ranks[1].wait().returncode == 3
        result = ranks[0].wait()
    finally:
        agent.stop()
    assert result.returncode == 0, result.log[-3000:]
    return root, agent


def test_a_shrink_reshards_a_megatron_checkpoint(references: dict[str, Any], tmp_path: Path) -> None:
    """The shrink of the distributed optimizer's job again, its persistent checkpoints in
    Megatron-Core's distributed format: the survivor reshards the DP 2 checkpoint of iteration
    5 through ``dist_checkpointing.load`` (dp_reshardable) and ends within the same bound."""
    if not references["distributed"]:
        pytest.skip("the replicated optimizer's shrink keeps the live state")
    spec = references["spec"](checkpoint_interval=5)
    spec.training.checkpoint_format = "megatron"
    root, agent = _shrink(spec, tmp_path)
    _assert_shrink_source(references, agent, (1, 0))
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
    # Against a failure-free DP 1 run in the same format: the fp32 main parameters, as the
    # checkpoint holds them (the optimizer's buckets), within the bound the resizes keep.
    plain = FakeAgent()
    try:
        results = run_ranks(plain, spec, 1, tmp_path / "reference", tmp_path / "reference-ckpt")
    finally:
        plain.stop()
    assert results[0].returncode == 0, results[0].log[-3000:]
    _, bound = resize_bound(references)
    got = megatron_main_buckets(root / f"iter_{ITERATIONS:07d}")
    want = megatron_main_buckets(tmp_path / "reference-ckpt" / f"iter_{ITERATIONS:07d}")
    worst = relative_difference(got, want)
    print(f"shrink through a Megatron checkpoint: main parameters {worst:.3e} from DP 1's (bound {bound:.3e})")
    assert worst <= bound, f"the main parameters differ by {worst:.2e} relative, over the bound {bound:.2e}"


def megatron_main_buckets(directory: Path) -> dict[str, Any]:
    """The distributed optimizer's fp32 main parameters in a Megatron-format checkpoint, one
    flat tensor per bucket, read with torch's own DCP converter (no process group needed)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    state = torch.load(out, weights_only=False)
    buckets = {k: v for k, v in state.items() if k.startswith("optimizer.") and k.endswith(".param")}
    assert buckets and sum(v.numel() for v in buckets.values()) > 1_000_000
    return buckets


def test_a_grow_is_exact_against_one_rank(references: dict[str, Any], tmp_path: Path) -> None:
    """DP 1 -> 2 at a boundary after iteration 6: a new process joins and takes the state from
    the live rank; the pair's updates equal one rank's with the whole global batch."""
    port, new_port = free_port(), free_port()
    root = tmp_path / "ckpt"
    joining: ProcessKey = (2, 1)

    def ready(agent: ReformAgent) -> bool:
        return joining in agent.hellos and len(agent.of((1, 0), "iteration")) >= 6

    agent = ReformAgent({(1, 0): 0}, generation=2, world_size=2, port=new_port, when=ready)
    slow = trainer_env(fault_injection=True, faults=("slow:0.3@6",))
    try:
        old = start_trainer(agent.address, references["spec"](), 0, 1, port, tmp_path, 1, root, slow)
        new = start_trainer(
            agent.address, references["spec"](), 1, 2, new_port, tmp_path, 2, root, trainer_env(state_from_peer=True)
        )
        results = [old.wait(), new.wait()]
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    assert agent.of(joining, "iteration")[0].state_source == "peer"
    assert_within(root, *resize_bound(references))


def test_a_tensor_parallel_shrink_keeps_each_shard_in_place(references: dict[str, Any], tmp_path: Path) -> None:
    """TP 2 x DP 2 -> DP 1 at iteration 6: the second replica (ranks 2, 3) exits, the first
    reforms alone, each rank with its own tensor shard; equal to a failure-free TP 2 run."""
    port, new_port = free_port(), free_port()
    root = tmp_path / "ckpt"
    agent = ReformAgent({(1, 0): 0, (1, 1): 1}, generation=2, world_size=2, port=new_port, when=ReformAgent.any_error)
    exits = trainer_env(fault_injection=True, faults=("exit@6",))
    try:
        spec = references["spec"](tensor=2, checkpoint_interval=_shrink_interval(references))
        ranks = [
            start_trainer(agent.address, spec, r, 4, port, tmp_path, 1, root, exits if r >= 2 else None)
            for r in range(4)
        ]
        assert [ranks[r].wait().returncode for r in (2, 3)] == [3, 3]
        results = [ranks[r].wait() for r in (0, 1)]
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    assert sorted(agent.hellos) == [(1, 0), (1, 1), (1, 2), (1, 3)]  # nobody restarted
    _assert_shrink_source(references, agent, (1, 1))
    assert_within(root, *resize_bound(references, tensor=2))


def test_a_tensor_parallel_grow_takes_each_shard_from_its_holder(references: dict[str, Any], tmp_path: Path) -> None:
    """TP 2 x DP 1 -> DP 2 after iteration 6: two new processes join as the second replica,
    each taking its tensor shard from the live rank that holds it."""
    port, new_port = free_port(), free_port()
    root = tmp_path / "ckpt"
    joining: list[ProcessKey] = [(2, 2), (2, 3)]

    def ready(agent: ReformAgent) -> bool:
        return all(k in agent.hellos for k in joining) and len(agent.of((1, 0), "iteration")) >= 6

    agent = ReformAgent({(1, 0): 0, (1, 1): 1}, generation=2, world_size=4, port=new_port, when=ready)
    slow = trainer_env(fault_injection=True, faults=("slow:0.3@6",))
    spec = references["spec"](tensor=2)
    try:
        old = [start_trainer(agent.address, spec, r, 2, port, tmp_path, 1, root, slow) for r in (0, 1)]
        new = [
            start_trainer(agent.address, spec, r, 4, new_port, tmp_path, 2, root, trainer_env(state_from_peer=True))
            for r in (2, 3)
        ]
        results = [p.wait() for p in (*old, *new)]
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    assert [agent.of(k, "iteration")[0].state_source for k in joining] == ["peer", "peer"]
    assert_within(root, *resize_bound(references, tensor=2))


def _on_nodes(*nodes: str) -> list[dict[str, str]]:
    """The trainer settings that put each rank on its own node: a buddy copy needs another."""
    return [trainer_env(node=node) for node in nodes]


def test_a_restart_takes_the_lost_shard_from_its_buddy(references: dict[str, Any], tmp_path: Path) -> None:
    """Under the distributed optimizer, with the ranks on two nodes: rank 1 is killed in
    iteration 9 and its replacement starts on a third node. Rank 0 kept a buddy copy of rank
    1's optimizer shard (of iteration 8, refreshed at the start of 9): the new rank takes its
    model slice from rank 0 and its shard from that copy. No snapshot, no checkpoint read; the
    run ends bit-identical."""
    if not references["distributed"]:
        pytest.skip("a buddy copy is of a distributed optimizer's shard")
    root = tmp_path / "ckpt"
    restart_rank_one_from_its_buddy(references["spec"](), tmp_path, root)
    assert_exact(root, references["get"]("tp1dp2", 2))


def test_a_shrink_reshards_in_memory_from_the_buddy(references: dict[str, Any], tmp_path: Path) -> None:
    """Rank 1 leaves (DP 2 -> 1 at iteration 6), and rank 0 cuts the whole optimizer state from
    its own shard and its buddy copy of rank 1's. Within the resize bound."""
    if not references["distributed"]:
        pytest.skip("a buddy copy is of a distributed optimizer's shard")
    on_a, on_b = _on_nodes("node-a", "node-b")
    agent, _ = leave_at_six(references["spec"](), tmp_path, on_a, on_b)
    reports = [r for r in agent.of((1, 0), "iteration") if r.generation == 2 and r.state_source]
    assert (reports[0].state_source, reports[0].restored_iteration) == ("buddy", 5)
    assert_within(tmp_path / "ckpt", *resize_bound(references))


def test_a_shrink_reshards_from_the_nodes_snapshots(references: dict[str, Any], tmp_path: Path) -> None:
    """Rank 1 leaves (DP 2 -> 1 at iteration 6) with both ranks on one node (so no buddy copy):
    rank 0 cuts the whole optimizer state from the two snapshots on its node, by the same piece
    moves as a peer transfer. Within the resize bound."""
    if not references["distributed"]:
        pytest.skip("resharding from snapshots is of a distributed optimizer's shards")
    on_a = {**_on_nodes("node-a")[0], **trainer_env(snapshot_dir=str(tmp_path / "snapshots"))}
    agent, result = leave_at_six(references["spec"](), tmp_path, on_a, on_a)
    reports = [r for r in agent.of((1, 0), "iteration") if r.generation == 2 and r.state_source]
    assert reports[0].state_source == "snapshot" and reports[0].restored_iteration >= 2, reports[0]
    assert "optimizer shard resharded" in result.log
    assert_within(tmp_path / "ckpt", *resize_bound(references))
