"""The plain PyTorch level (unicron.trainer.Session) through real trainer processes: the
digits example (examples/digits, an MLP of 1.1M parameters) after a shrink, a grow and a
restart from a checkpoint ends with the parameters of a failure-free run, every tensor within
1e-6 relative, with the optimizer, LR scheduler and data position carried along."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.harness import (
    FakeAgent,
    ProcessKey,
    ReformAgent,
    free_port,
    relative_difference,
    run_ranks,
    start_trainer,
)
from unicron.trainer import checkpoint
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2

ITERATIONS = 20


def digits_spec(checkpoint_interval: int = ITERATIONS) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name="digits")
    spec.program.entry_point = "examples.digits.train:main"
    spec.parallelism.data = 1
    t = spec.training
    t.iterations, t.global_batch_size, t.micro_batch_size = ITERATIONS, 64, 1
    t.learning_rate, t.seed, t.checkpoint_interval = 1e-3, 11, checkpoint_interval
    return spec


def final_state(root: Path) -> dict[str, Any]:
    """The model and optimizer of the newest checkpoint under ``root``, at the last iteration."""
    iteration = checkpoint.list_complete(root)[0]
    assert iteration == ITERATIONS
    manifest = checkpoint.read_manifest(root, iteration)
    layout = checkpoint.layout_of_config(
        manifest["layout"]["model"], manifest["layout"]["tensor_parallel"], manifest["layout"]["pipeline_parallel"]
    )
    found = checkpoint.find_latest(root, layout)
    assert found is not None
    return found[1]


def distance(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest per-tensor relative difference of the parameters and Adam's moments (a
    state copy that dropped the moments would diverge later, not now)."""
    worst = relative_difference(got["model"], want["model"])
    for index, moments in want["optimizer"]["state"].items():
        theirs = got["optimizer"]["state"][index]
        for name in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, relative_difference({name: theirs[name]}, {name: moments[name]}))
    return worst


def assert_same_state(got: dict[str, Any], want: dict[str, Any], tolerance: float = 1e-6) -> None:
    assert distance(got, want) <= tolerance
    assert got["scheduler"]["last_epoch"] == want["scheduler"]["last_epoch"] == ITERATIONS
    assert got["scheduler"]["_last_lr"] == pytest.approx(want["scheduler"]["_last_lr"], rel=1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("reference")
    agent = FakeAgent()
    try:
        (result,) = run_ranks(agent, digits_spec(), 1, work, checkpoint_dir=work / "ckpt")
    finally:
        agent.stop()
    assert result.returncode == 0, result.log[-3000:]
    reports = agent.of(0, "iteration")
    assert [r.iteration for r in reports] == list(range(1, ITERATIONS + 1))
    assert reports[-1].loss < 0.5 * reports[0].loss, [round(r.loss, 3) for r in reports]
    return final_state(work / "ckpt")


# Each rank's loss per iteration in the failure-free run at data-parallel 2: where a run that
# ends elsewhere first left it says which iteration went wrong.
DP2_LOSSES: dict[int, list[float]] = {}


@pytest.fixture(scope="module")
def reference_dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of a failure-free run at data-parallel 2."""
    work = tmp_path_factory.mktemp("reference-dp2")
    agent = FakeAgent()
    try:
        results = run_ranks(agent, digits_spec(), 2, work, checkpoint_dir=work / "ckpt")
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    for rank in (0, 1):
        DP2_LOSSES[rank] = [r.loss for r in agent.of(rank, "iteration")]
    return final_state(work / "ckpt")


@pytest.fixture(scope="module")
def data_parallel_rounding(reference: dict[str, Any], reference_dp2: dict[str, Any]) -> float:
    """How far a failure-free run at data-parallel 2 ends from the one at 1: the same
    mathematics, summed in another order (each rank's half-batch matmul, then the all-reduce).
    On a CPU whose kernels block the sums differently this alone can pass 1e-6 over 20 Adam
    steps (seen: 1.4e-6 on an AVX2 machine), so a run that changed its degree is held to
    what changing the degree costs by itself, and never to less than 1e-6."""
    return distance(reference_dp2, reference)


@pytest.fixture
def agents() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for agent in made:
        agent.stop()


def fail_rank_1(
    moves: dict[ProcessKey, int], fault: str, tmp_path: Path, agents: list[Any]
) -> tuple[ReformAgent, list[Any]]:
    """Two ranks train, checkpointing under tmp_path/ckpt; `fault` is injected into rank 1,
    and at the first error the agent reforms `moves` (process -> new rank) into a new group
    of that many ranks. Returns the agent and both ranks' results."""
    port, new_port = free_port(), free_port()
    agent = ReformAgent(moves, generation=2, world_size=len(moves), port=new_port, when=ReformAgent.any_error)
    agents.append(agent)
    faults = trainer_env(fault_injection=True, faults=(fault,))
    ranks = [
        start_trainer(agent.address, digits_spec(), r, 2, port, tmp_path, 1, tmp_path / "ckpt", faults if r else None)
        for r in (0, 1)
    ]
    return agent, [t.wait() for t in ranks]


def test_a_failure_free_run_learns_and_checkpoints_its_whole_state(reference: dict[str, Any]) -> None:
    params = sum(t.numel() for t in reference["model"].values())
    assert params > 1_000_000
    assert {"model", "optimizer", "scheduler", "rng"} <= set(reference)


def test_shrink_by_reform_keeps_the_state_exact(
    reference: dict[str, Any], data_parallel_rounding: float, tmp_path: Path, agents: list[Any]
) -> None:
    """World 2; rank 1 exits inside iteration 8's gradient all-reduce; rank 0 reports the
    broken group, reforms into world 1 and trains on with the whole global batch: it ends
    where a failure-free run at 1 does, up to the rounding that 7 steps at 2 bring."""
    agent, results = fail_rank_1({(1, 0): 0}, "exit@8", tmp_path, agents)
    root = tmp_path / "ckpt"
    assert results[1].returncode == 3, results[1].log[-2000:]
    assert results[0].returncode == 0, results[0].log[-3000:]
    reports = agent.of((1, 0), "iteration")
    assert [(r.iteration, r.generation) for r in reports] == [(i, 1 if i < 8 else 2) for i in range(1, ITERATIONS + 1)]
    assert (reports[7].state_source, reports[7].restored_iteration) == ("live", 7)
    assert_same_state(final_state(root), reference, max(1e-6, data_parallel_rounding))


def test_a_reattempt_finishes_the_iteration_from_its_gradients(
    reference_dp2: dict[str, Any], tmp_path: Path, agents: list[Any]
) -> None:
    """World 2; rank 1's all-reduce of iteration 8 raises a collective timeout and the agent
    answers with a reform of the same two ranks (a reattempt). Rank 1 takes it inside
    all_reduce_gradients and does only the all-reduce again, in the new group, from the
    gradients it had computed: its loop never sees the failure, and the run ends where a
    failure-free run at 2 does."""
    agent, results = fail_rank_1({(1, 0): 0, (1, 1): 1}, "exception:collective_timeout:allreduce@8", tmp_path, agents)
    root = tmp_path / "ckpt"
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    # Rank 1 failed inside the all-reduce; rank 0 is there too, or (when the reform reached
    # it first) takes it at the iteration's start and computes the iteration in the new group.
    assert "finishing the interrupted iteration from its computed gradients" in results[1].log, results[1].log[-3000:]
    reports = agent.of((1, 0), "iteration")
    assert [(r.iteration, r.generation) for r in reports] == [(i, 1 if i < 8 else 2) for i in range(1, ITERATIONS + 1)]
    # Equal up to float rounding: when rank 0 computes iteration 8 in the new group, after a
    # teardown, its buffers are allocated elsewhere, and MKL's sgemm rounds by alignment.
    # Measured: 1.10e-6 once in a loaded CI run (every local run, where rank 0 finished from
    # its gradients too, within 1e-6); a wrongly computed iteration would be off by far more.
    got = final_state(root)
    if distance(got, reference_dp2) > 5e-6:
        # What to look at when it is not (seen once in CI, 3.2e-3, never reproduced): the
        # first iteration whose loss left the reference's, and what each rank did.
        losses = {rank: [r.loss for r in agent.of((1, rank), "iteration")] for rank in (0, 1)}
        first = {
            rank: next((i + 1 for i, (a, b) in enumerate(zip(mine, DP2_LOSSES[rank], strict=False)) if a != b), None)
            for rank, mine in losses.items()
        }
        events = [[line[:300] for line in r.log.splitlines() if '"msg": "iteration"' not in line] for r in results]
        pytest.fail(
            f"distance {distance(got, reference_dp2):.3g}; first loss off at {first};"
            f" losses {losses}, reference {DP2_LOSSES}; logs {events}"
        )
    assert_same_state(got, reference_dp2, tolerance=5e-6)


def test_grow_takes_the_state_from_a_live_peer(reference: dict[str, Any], tmp_path: Path, agents: list[Any]) -> None:
    """One rank trains; a second process started with state_from_peer joins at a boundary
    after iteration 5 (rank 0 slowed from there, so the reform lands mid-run); both finish."""
    port, new_port = free_port(), free_port()
    new: ProcessKey = (2, 1)

    def ready(agent: ReformAgent) -> bool:
        return new in agent.hellos and len(agent.of((1, 0), "iteration")) >= 5

    agent = ReformAgent({(1, 0): 0}, generation=2, world_size=2, port=new_port, when=ready)
    agents.append(agent)
    root = tmp_path / "ckpt"
    slow = trainer_env(fault_injection=True, faults=("slow:0.3@5",))
    old = start_trainer(agent.address, digits_spec(), 0, 1, port, tmp_path, 1, root, slow)
    joining = start_trainer(
        agent.address, digits_spec(), 1, 2, new_port, tmp_path, 2, root, trainer_env(state_from_peer=True)
    )
    results = [old.wait(), joining.wait()]
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    joined = agent.of(new, "iteration")
    at = joined[0].iteration - 1
    assert 5 <= at < ITERATIONS and (joined[0].state_source, joined[0].restored_iteration) == ("peer", at)
    assert [r.iteration for r in agent.of((1, 0), "iteration")] == list(range(1, ITERATIONS + 1))
    assert_same_state(final_state(root), reference)


def test_a_restart_resumes_from_the_checkpoint_exactly(
    reference: dict[str, Any], tmp_path: Path, agents: list[Any]
) -> None:
    """The rank crashes in iteration 13; started again, it resumes from the checkpoint of
    iteration 10 and redoes 11-13 on the same samples."""
    root = tmp_path / "ckpt"
    agent = FakeAgent()
    agents.append(agent)
    spec = digits_spec(checkpoint_interval=5)
    (crashed,) = run_ranks(agent, spec, 1, tmp_path / "a", root, faults={0: "crash@13"})
    assert crashed.returncode != 0
    (resumed,) = run_ranks(agent, spec, 1, tmp_path / "b", root)
    assert resumed.returncode == 0, resumed.log[-3000:]
    first = [r for r in agent.of(0, "iteration") if r.state_source][-1]
    assert (first.iteration, first.state_source, first.restored_iteration) == (11, "checkpoint", 10)
    assert_same_state(final_state(root), reference)


def test_the_example_sharded_with_fsdp2_trains_the_same_model_under_torchrun(tmp_path: Path) -> None:
    """``examples/digits --fsdp`` under plain torchrun (no Unicron): the same MLP sharded with
    FSDP2 ends where the replicated one does, within float reordering (FSDP2 averages the
    gradients in its reduce-scatter, the replicated loop in Session's all-reduce)."""
    import os
    import subprocess
    import sys

    from bench.peers import _load_params
    from unicron_dev.localcluster import ROOT

    finals = []
    for variant in ([], ["--fsdp"]):
        root = tmp_path / ("fsdp" if variant else "replicated")
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            "-m", "bench.peers_torchrun", "--iterations", "20", "--hidden", "256", "--checkpoint-dir", str(root),
            *variant,
        ]  # fmt: skip
        done = subprocess.run(
            argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        finals.append(_load_params(root / "iter_00000020" / "tp0_pp0.pt"))
    replicated, sharded = finals
    assert sorted(sharded) == sorted(replicated) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert relative_difference(sharded, replicated) < 1e-5
