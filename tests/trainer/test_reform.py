"""Reform: a rank moves to a new process group without restarting, keeping its training state
in memory; ranks without state receive it from a live peer (services/trainer/reform.py).

The planning, the snapshot checksum and the trainer's decision logic are tested without
processes. The real cases run trainer ranks (`python -m services.trainer`, gloo) against a
fake agent (harness.ReformAgent) that sends one AgentReform to chosen processes once a
condition holds, and compare the result with a fault-free run: shrink (a rank exits, the
survivors reform into world 2), grow (a new process joins with state_from_peer), a reattempt
done as a reform on a new rendezvous, and a corrupted peer transfer that falls back to the
persistent checkpoint. The global batch is 12, so DP 2 and DP 3 both divide it. Last, two
spawned processes check that a rank leaving its group breaks a waiting peer's collective at
once (gloo closes a group's connections only when nothing refers to it any more).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tests.trainer.harness import (
    ProcessKey,
    RankResult,
    ReformAgent,
    assert_same_params,
    free_port,
    reference_run,
    start_trainer,
    tiny_spec,
    trainer_configs,
)
from unicron.faults import EXCEPTION_TEXTS
from unicron.trainer import checkpoint
from unicron.trainer.agent_link import AgentLink, LinkCallbacks
from unicron.trainer.faults import FaultInjector, InjectedFailure
from unicron.trainer.reform import NO_STATE, make_plan
from unicron.trainer.runtime import (
    Decision,
    Run,
    TrainerConfig,
    after_failure,
    enter_generation,
    interrupt_collectives,
    poll_reform,
    reform_overdue,
    watch_reforms,
)
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2
from unicron.v1 import trainer_service_pb2 as pb

ITERATIONS = 6
# Well under the trainers' collective timeout (60 s in the harness): a rank that leaves its
# group must break its peers' collectives at once, not let them wait for the timeout.
QUICK_S = 30.0
TIMEOUT_TEXT = EXCEPTION_TEXTS[common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT]
RESET_TEXT = EXCEPTION_TEXTS[common_pb2.FAILURE_KIND_CONNECTION_RESET]


# --- without processes ------------------------------------------------------------------------


def test_the_plan_picks_the_lowest_rank_holding_the_newest_state_per_shard() -> None:
    grow = make_plan([(3, 0, 0), (3, 0, 0), (NO_STATE, 0, 0)])
    assert (grow.target, grow.sources, grow.receivers, grow.problem) == (3, {(0, 0): 0}, {(0, 0): [2]}, "")
    # A rank whose step completed where its peer's did not: the newer state wins.
    lagging = make_plan([(3, 0, 0), (4, 0, 0)])
    assert (lagging.target, lagging.sources, lagging.receivers) == (4, {(0, 0): 1}, {(0, 0): [0]})
    everyone = make_plan([(5, 0, 0), (5, 0, 0)])
    assert everyone.receivers == {} and not everyone.problem
    tp2 = make_plan([(2, 0, 0), (2, 1, 0), (NO_STATE, 0, 0), (NO_STATE, 1, 0)])
    assert tp2.sources == {(0, 0): 0, (1, 0): 1} and tp2.receivers == {(0, 0): [2], (1, 0): [3]}
    assert "(1, 0)" in make_plan([(2, 0, 0), (NO_STATE, 1, 0), (NO_STATE, 0, 0), (NO_STATE, 1, 0)]).problem
    assert make_plan([(NO_STATE, 0, 0), (NO_STATE, 0, 0)]).problem == "no rank holds state"


class FakeLink:
    def __init__(self) -> None:
        self.sent: list[pb.ConnectRequest] = []

    def send(self, message: pb.ConnectRequest) -> None:
        self.sent.append(message)


def _run(wait_s: float = 5.0) -> tuple[Run, FakeLink]:
    config = TrainerConfig(job_id="job-1", agent="127.0.0.1:1", spec="{}", generation=1, reattempt_wait_s=wait_s)
    link = FakeLink()
    stop = threading.Event()
    injector = FaultInjector(False, lambda fault, at: None, stop)
    return Run(config, common_pb2.JobSpec(), cast(AgentLink, link), stop, injector, iteration=1), link


def _reform(generation: int, rank: int = 0, world: int = 2, port: int = 29600) -> pb.AgentReform:
    return pb.AgentReform(
        incident_id="inc", generation=generation, rank=rank, world_size=world, master_addr="h", master_port=port
    )


def test_a_reform_is_an_answer_to_a_reported_error() -> None:
    run, link = _run()
    timer = threading.Timer(0.05, lambda: run.reforms.put(_reform(2)))
    timer.start()
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.REFORM
    assert [m.WhichOneof("message") for m in link.sent] == ["error"]
    assert run.pending_reform is not None and run.pending_reform.generation == 2
    assert run.reattempt_count == 1


def test_a_pending_reform_takes_a_broken_group_without_a_new_incident() -> None:
    run, link = _run()
    run.reforms.put(_reform(2))
    # Even a step that cannot be redone joins (without its state: the caller passes that on).
    assert after_failure(run, RuntimeError(RESET_TEXT), redoable=False) is Decision.REFORM
    assert link.sent == []
    # An error of the rank's own is reported all the same (the coordinator decides on it); the
    # decision it waits for is the reform already pending.
    assert after_failure(run, RuntimeError("CUDA error: an illegal memory access was encountered")) is Decision.REFORM
    assert [m.error.kind for m in link.sent] == [common_pb2.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS]


def test_stale_and_malformed_reforms_are_ignored_and_the_newest_wins() -> None:
    run, _ = _run(wait_s=0.2)
    for bad in (_reform(1), _reform(0), _reform(3, rank=2, world=2), _reform(3, port=0)):
        run.reforms.put(bad)
    assert poll_reform(run) is None
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.GIVE_UP
    run.reforms.put(_reform(3, rank=1))
    run.reforms.put(_reform(2))
    newest = poll_reform(run)
    assert newest is not None and (newest.generation, newest.rank) == (3, 1)


@pytest.mark.parametrize(
    ("waited_s", "step_seconds", "overdue"),
    [(5.0, 0.0, False), (21.0, 0.0, True), (21.0, 10.0, False), (31.0, 10.0, True)],
)
def test_a_reform_is_overdue_after_a_while_and_several_steps(
    waited_s: float, step_seconds: float, overdue: bool
) -> None:
    assert reform_overdue(waited_s, step_seconds) is overdue


def test_a_rank_stuck_in_its_old_group_with_a_reform_waiting_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    from unicron.trainer import runtime as trainer_main

    monkeypatch.setattr(trainer_main, "REFORM_OVERDUE_MIN_S", 0.2)
    run, _ = _run()
    exits: list[int] = []
    run.reforms.put(_reform(2))  # never read: the training thread is stuck
    watch_reforms(run, period_s=0.05, exit_process=exits.append)
    assert exits == [1]
    # A reform read in time (the queue drained) is no reason to exit.
    run, _ = _run()
    stopper = threading.Timer(0.5, run.stop.set)
    stopper.start()
    watch_reforms(run, period_s=0.05, exit_process=exits.append)
    assert exits == [1]


def test_the_link_delivers_the_agents_reform() -> None:
    agent = ReformAgent({(1, 3): 2}, generation=2, world_size=3, port=29611, when=lambda a: True)
    got: list[pb.AgentReform] = []
    answered = threading.Event()

    def on_reform(reform: pb.AgentReform) -> None:
        got.append(reform)
        answered.set()

    link = AgentLink(
        agent.address,
        pb.TrainerHello(job_id="j", generation=1, rank=3),
        LinkCallbacks(on_stop=lambda r: None, on_inject=lambda f: None, on_lost=lambda r: None, on_reform=on_reform),
    )
    try:
        link.open(timeout_s=10)
        assert answered.wait(10)
        assert [(r.generation, r.rank, r.world_size, r.master_port) for r in got] == [(2, 2, 3, 29611)]
    finally:
        link.close()
        agent.stop()
    LinkCallbacks(on_stop=lambda r: None, on_inject=lambda f: None, on_lost=lambda r: None).on_reform(_reform(2))


def test_a_reform_superseded_while_waiting_for_its_group_joins_the_newer_one_with_its_state(
    tmp_path: Path,
) -> None:
    """Generation 2's rank 0 died before its store came up (as when a second failure hits a
    restart); the agent's next reform, generation 3, ends the wait, and the rank joins that
    one with the state it had instead of failing."""
    import torch.distributed as dist

    from tests.trainer.gpt import gpt_trainer
    from unicron.trainer.loop import apply_reform

    run, link = _run()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        trainer = gpt_trainer(*trainer_configs(tiny_spec(4)))
        trainer.step()
        before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
        nobody = free_port()  # generation 2's store never comes up
        newer = _reform(3, rank=0, world=1, port=free_port())
        first = _reform(2, rank=1, world=2, port=nobody)
        newer.master_addr = first.master_addr = "127.0.0.1"
        timer = threading.Timer(0.3, lambda: run.reforms.put(newer))
        timer.start()
        new = apply_reform(run, trainer, first, keep_state=True)
        try:
            after = {k: v for k, v in new.model.state_dict().items() if isinstance(v, torch.Tensor)}
            assert (run.generation, run.rank, run.world_size) == (3, 0, 1)
            assert run.source == ("live", 1) and new.iteration == 1
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
            assert link.sent == []  # superseded, not a failure: nothing to report
        finally:
            new.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_reform_that_cannot_form_its_group_and_gets_no_newer_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from unicron.trainer import reform as reforming
    from unicron.trainer.loop import apply_reform

    with pytest.raises(reforming.Superseded):
        reforming.join(1, 2, "127.0.0.1", free_port(), timeout=30, superseded=lambda: True)
    error = RuntimeError(TIMEOUT_TEXT)

    def broken_group(*args: Any, **kwargs: Any) -> Any:
        raise reforming.ReformFailed(error, reforming.Parked(None, "gloo", None))

    monkeypatch.setattr(reforming, "reform", broken_group)
    run, link = _run(wait_s=0.2)
    with pytest.raises(RuntimeError) as raised:
        apply_reform(run, cast(Any, SimpleNamespace(iteration=1)), _reform(2), keep_state=True)
    assert raised.value is error
    # Reported as the new generation's error; no answer came within the wait.
    assert [(m.error.kind, m.error.generation) for m in link.sent] == [(common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT, 2)]


# --- real trainer processes -------------------------------------------------------------------


def reform_spec(iterations: int = ITERATIONS, checkpoint_interval: int = ITERATIONS) -> common_pb2.JobSpec:
    spec = tiny_spec(iterations, checkpoint_interval)
    spec.training.global_batch_size = 12
    return spec


def two_ports() -> tuple[int, int]:
    first = free_port()
    while (second := free_port()) == first:
        pass
    return first, second


def _check_ok(results: dict[ProcessKey, RankResult], keys: list[ProcessKey]) -> None:
    for key in keys:
        assert results[key].returncode == 0, f"{key} exited {results[key].returncode}:\n{results[key].log[-4000:]}"


def _summary(reports: list[Any]) -> list[tuple[int, int, int, str, int]]:
    return [(r.iteration, r.generation, r.rank, r.state_source, r.restored_iteration) for r in reports]


def _compare_with_reference(
    spec: common_pb2.JobSpec, losses: dict[int, float], root: Path, store: Path, tensor_parallel: int = 1
) -> None:
    want_losses, want_params = reference_run(spec, store)
    for i, want in enumerate(want_losses, start=1):
        assert math.isclose(losses[i], want, rel_tol=1e-5), f"iteration {i}: loss {losses[i]} != {want}"
    found = checkpoint.find_latest(
        root, checkpoint.layout_of_config(trainer_configs(spec)[0].shape(), tensor_parallel, 1)
    )
    assert found is not None and found[0] == spec.training.iterations
    assert_same_params(found[1]["model"], want_params)


def _losses(agent: ReformAgent, keys: list[ProcessKey]) -> dict[int, float]:
    """Loss per iteration, checked identical on every process that reported it (the last
    report of an iteration counts when one was redone after a checkpoint fallback)."""
    per_key = [{r.iteration: r.loss for r in agent.of(key, "iteration")} for key in keys]
    merged: dict[int, float] = {}
    for losses in per_key:
        for iteration, loss in losses.items():
            assert merged.setdefault(iteration, loss) == loss, f"iteration {iteration}: ranks disagree"
    return merged


def test_shrink_without_restart(tmp_path: Path) -> None:
    """3 ranks train 3 iterations; rank 2 exits at the start of iteration 4 while ranks 0 and
    1 wait for it in the gradient all-reduce; they report the broken group, the agent answers
    reform into world 2 on a new port, and they redo iteration 4 there and train on to 6."""
    spec = reform_spec()
    root = tmp_path / "ckpt"
    port, new_port = two_ports()
    survivors: list[ProcessKey] = [(1, 0), (1, 1)]
    agent = ReformAgent({(1, 0): 0, (1, 1): 1}, generation=2, world_size=2, port=new_port, when=ReformAgent.any_error)
    try:
        faults = trainer_env(fault_injection=True, faults=("exit@4",))
        trainers = {
            (1, rank): start_trainer(
                agent.address, spec, rank, 3, port, tmp_path, checkpoint_dir=root, env=faults if rank == 2 else None
            )
            for rank in range(3)
        }
        results = {key: t.wait() for key, t in trainers.items()}
    finally:
        agent.stop()
    assert results[(1, 2)].returncode == 3, results[(1, 2)].log[-3000:]
    _check_ok(results, survivors)

    assert [r.iteration for r in agent.of((1, 2), "iteration")] == [1, 2, 3]
    errors = [e for key in survivors for e in agent.of(key, "error")]
    # The first survivor to see the broken group reports it; the other may find the reform
    # already pending and then takes it without a new incident.
    assert 1 <= len(errors) <= 2
    assert all((e.kind, e.iteration) == (common_pb2.FAILURE_KIND_CONNECTION_RESET, 4) for e in errors)
    for rank, key in enumerate(survivors):
        assert _summary(agent.of(key, "iteration")) == [
            (1, 1, rank, "fresh", 0),
            (2, 1, rank, "", 0),
            (3, 1, rank, "", 0),
            (4, 2, rank, "live", 3),
            (5, 2, rank, "", 0),
            (6, 2, rank, "", 0),
        ]
        assert [f.iterations for f in agent.of(key, "finished")] == [ITERATIONS]
        assert "reformed" in results[key].log
        assert agent.seconds_to_new_generation(key) < QUICK_S, "a survivor waited for the collective timeout"
    _compare_with_reference(spec, _losses(agent, survivors), root, tmp_path / "store")


def _grow(tmp_path: Path, root: Path, checkpoint_interval: int, corrupt: bool) -> tuple[ReformAgent, int]:
    """Ranks 0 and 1 (generation 1, world 2) and a new process started for world 3 with
    state_from_peer (generation 2, rank 2). From iteration 3 on, ranks 0 and 1 are slowed by
    an injected 0.5 s delay in their gradient sync; the fault announces itself as iteration 3
    starts (after the boundary of iteration 2, its checkpoint included). Once rank 0 announced
    it and the new process is connected, the agent asks 0 and 1 to reform into world 3: the
    reform arrives while iteration 3 is in flight, and they take it at the boundary after it.
    Returns the agent and that iteration."""
    spec = reform_spec(checkpoint_interval=checkpoint_interval)
    port, new_port = two_ports()
    old: list[ProcessKey] = [(1, 0), (1, 1)]
    new: ProcessKey = (2, 2)

    def ready(agent: ReformAgent) -> bool:
        return new in agent.hellos and bool(agent.of((1, 0), "fault_fired"))

    agent = ReformAgent({(1, 0): 0, (1, 1): 1}, generation=2, world_size=3, port=new_port, when=ready)
    env = trainer_env(fault_injection=True, faults=("slow:0.5@3",))
    if corrupt:
        env["UNICRON_TRAINER_CORRUPT_PEER_STATE"] = "1"
    try:
        trainers = {key: start_trainer(agent.address, spec, key[1], 2, port, tmp_path, 1, root, env) for key in old}
        trainers[new] = start_trainer(
            agent.address, spec, 2, 3, new_port, tmp_path, 2, root, {"UNICRON_TRAINER_STATE_FROM_PEER": "1"}
        )
        results = {key: t.wait() for key, t in trainers.items()}
    finally:
        agent.stop()
    _check_ok(results, [*old, new])
    for key in [*old, new]:
        assert agent.of(key, "error") == []
        assert [f.iterations for f in agent.of(key, "finished")] == [ITERATIONS]
    last_of_generation_1 = [max(r.iteration for r in agent.of(key, "iteration") if r.generation == 1) for key in old]
    assert last_of_generation_1[0] == last_of_generation_1[1]
    at = last_of_generation_1[0]
    # Rank 0's fault at the start of iteration 3 triggers the reform, so this is 3 as a rule;
    # 2 when rank 1 was still before iteration 3 as the reform reached it: it took it at that
    # boundary, rank 0's iteration 3 broke as rank 1 left, and both redid it in the new group.
    assert 2 <= at < ITERATIONS, [_summary(agent.of(k, "iteration")) for k in [*old, new]]
    if corrupt:
        assert "corrupt" in results[new].log
    return agent, at


def test_grow_without_restart(tmp_path: Path) -> None:
    """2 ranks train; a 3rd process started with state_from_peer joins; all three train to 6
    in world 3. The new rank's first report says "peer", the others' "live"."""
    root = tmp_path / "ckpt"
    agent, at = _grow(tmp_path, root, checkpoint_interval=ITERATIONS, corrupt=False)
    after = list(range(at + 1, ITERATIONS + 1))
    for rank in (0, 1):
        summary = _summary(agent.of((1, rank), "iteration"))
        assert [s[0] for s in summary] == list(range(1, ITERATIONS + 1))
        assert summary[at] == (at + 1, 2, rank, "live", at)
        assert [s[1] for s in summary] == [1] * at + [2] * len(after)
    new_reports = _summary(agent.of((2, 2), "iteration"))
    assert [s[0] for s in new_reports] == after
    assert new_reports[0] == (at + 1, 2, 2, "peer", at)
    _compare_with_reference(reform_spec(), _losses(agent, [(1, 0), (1, 1), (2, 2)]), root, tmp_path / "store")


def test_a_corrupted_peer_transfer_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    """As the grow, but the source flips a byte of what it sends: the new rank's checksum
    fails, and all three ranks restore the last persistent checkpoint together (the replicas
    must stay identical) and redo the iterations after it."""
    root = tmp_path / "ckpt"
    agent, at = _grow(tmp_path, root, checkpoint_interval=2, corrupt=True)
    saved = at // 2 * 2
    for rank in (0, 1):
        summary = _summary(agent.of((1, rank), "iteration"))
        assert [s[0] for s in summary] == list(range(1, at + 1)) + list(range(saved + 1, ITERATIONS + 1))
        assert summary[at] == (saved + 1, 2, rank, "checkpoint", saved)
    new_reports = _summary(agent.of((2, 2), "iteration"))
    assert [s[0] for s in new_reports] == list(range(saved + 1, ITERATIONS + 1))
    assert new_reports[0] == (saved + 1, 2, 2, "checkpoint", saved)
    spec = reform_spec(checkpoint_interval=2)
    _compare_with_reference(spec, _losses(agent, [(1, 0), (1, 1), (2, 2)]), root, tmp_path / "store")


@pytest.mark.parametrize(("tensor", "where"), [(1, "before"), (1, "allreduce"), (2, "before"), (2, "allreduce")])
def test_reattempt_by_reform(tmp_path: Path, tensor: int, where: str) -> None:
    """World 2 (data-parallel, or one tensor-parallel pair); rank 1 raises an injected
    collective timeout (SEV3) at iteration 2, before the iteration or inside its gradient
    all-reduce, while rank 0 waits in a collective; the agent answers with a reform into the
    same world on a new port. Rank 1 leaving the old group breaks rank 0's collective; both
    redo iteration 2 in the new group and finish, in the same processes. A rank that had
    computed its micro-batches does not compute them again: it finishes the iteration from the
    gradients it had."""
    spec = tiny_spec(iterations=4, checkpoint_interval=4)
    spec.parallelism.tensor = tensor
    root = tmp_path / "ckpt"
    port, new_port = two_ports()
    keys: list[ProcessKey] = [(1, 0), (1, 1)]
    agent = ReformAgent({(1, 0): 0, (1, 1): 1}, generation=2, world_size=2, port=new_port, when=ReformAgent.any_error)
    fault = "exception:collective_timeout:allreduce@2" if where == "allreduce" else "exception:collective_timeout@2"
    faults = trainer_env(fault_injection=True, faults=(fault,))
    try:
        trainers = {
            key: start_trainer(agent.address, spec, key[1], 2, port, tmp_path, 1, root, faults if key[1] else None)
            for key in keys
        }
        results = {key: t.wait() for key, t in trainers.items()}
    finally:
        agent.stop()
    _check_ok(results, keys)
    [error] = agent.of((1, 1), "error")
    assert (error.kind, error.iteration) == (common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT, 2)
    # Rank 0 sees its all-reduce break; it reports that only if its reform had not arrived yet.
    assert all(e.iteration == 2 for e in agent.of((1, 0), "error"))
    for rank, key in enumerate(keys):
        assert _summary(agent.of(key, "iteration")) == [
            (1, 1, rank, "fresh", 0),
            (2, 2, rank, "live", 1),
            (3, 2, rank, "", 0),
            (4, 2, rank, "", 0),
        ]
        assert [f.iterations for f in agent.of(key, "finished")] == [4]
        assert agent.seconds_to_new_generation(key) < QUICK_S, "a rank waited for the collective timeout"
    assert sorted(agent.hellos) == keys  # one hello each: no process was restarted
    # Rank 1 had its gradients only when it failed in the all-reduce. (Rank 0 may take the
    # reform at the boundary before iteration 2 or in it, as its answer arrives: either way.)
    finished = "finished the interrupted iteration from its computed gradients"
    assert (finished in results[(1, 1)].log) == (where == "allreduce")
    if tensor == 1:
        _compare_with_reference(spec, _losses(agent, keys), root, tmp_path / "store")
    else:  # the checkpoint holds slices: the losses say it (TP 2 and TP 1 agree up to rounding)
        want, _ = reference_run(spec, tmp_path / "store")
        got = _losses(agent, keys)
        assert all(math.isclose(got[i], w, rel_tol=1e-5) for i, w in enumerate(want, start=1)), (got, want)


# --- leaving a group frees it at once -----------------------------------------------------------


def _leave_inside_a_step(rank: int, port: int, results: Any, done: Any) -> None:
    """Both ranks train a step; in the second, rank 1 fails inside its gradient sync (its
    exception's frames hold the model) and leaves the group, staying alive; rank 0 waits for it
    in the all-reduce and must fail at once, not at the 30 s timeout."""
    import time
    from datetime import timedelta

    from tests.trainer.gpt import gpt_trainer
    from unicron.trainer import reform

    model, train = trainer_configs(reform_spec())
    reform.join(rank, 2, "127.0.0.1", port, 30)
    trainer = gpt_trainer(model, train, timeout=timedelta(seconds=30))
    trainer.step()
    if rank == 1:

        def fail() -> None:
            raise RuntimeError(RESET_TEXT)

        trainer.grad_sync_hook = fail
        try:
            trainer.step()
        except RuntimeError:
            pass
        reform.teardown(trainer)
        results.put(("left", 0.0))
        done.wait(60)
        return
    start = time.monotonic()
    try:
        trainer.step()
        results.put(("completed", time.monotonic() - start))
    except RuntimeError:
        results.put(("failed", time.monotonic() - start))


def test_leaving_a_group_breaks_a_waiting_peers_collective_at_once() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    done = context.Event()
    port = free_port()
    procs = [context.Process(target=_leave_inside_a_step, args=(rank, port, results, done)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=90) for _ in procs)
    finally:
        done.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert "left" in got
    assert "failed" in got and got["failed"] < 15.0, got


def test_an_interrupted_group_takes_the_pending_reform_whatever_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # On NCCL, interrupt_collectives aborts the old group when a reform answers an incident;
    # the training thread's next error (whatever NCCL calls it) is that abort, not news.
    from unicron.trainer import reform as reforming

    run, link = _run()
    monkeypatch.setattr(reforming, "abort_communicators", lambda: True)
    reform = _reform(2)
    run.reforms.put(reform)
    interrupt_collectives(run, reform)
    assert run.interrupted
    assert after_failure(run, RuntimeError("Default process group has not been initialized")) is Decision.REFORM
    assert link.sent == []
    enter_generation(run, reform)
    assert not run.interrupted


def test_aborting_communicators_leaves_a_gloo_group_alone(world1: None) -> None:
    # Gloo has nothing to abort (its blocked collectives ignore abort): the group stays usable.
    import torch.distributed as dist

    from unicron.trainer import reform as reforming

    assert not reforming.abort_communicators()
    assert dist.is_initialized()
    flag = torch.ones(1)
    dist.all_reduce(flag)
    assert flag.item() == 1.0


def test_a_group_on_a_store_that_outlives_it_counts_only_its_own_attempt() -> None:
    """Under torchrun the store at MASTER_PORT is the elastic agent's and outlives a restart:
    a dead attempt's keys are still there. Joined as a client under the new attempt's
    namespace, the group forms with the ranks of this attempt only."""
    from datetime import timedelta

    import torch.distributed as dist

    from unicron.redisutil import free_port
    from unicron.trainer import reform

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    # Attempt 0 had two ranks arrive, then died.
    dist.PrefixStore("unicron/torchelastic-attempt-0/", agent_store).add("unicron/arrived", 2)
    try:
        reform.join(
            0, 1, "127.0.0.1", port, timedelta(seconds=10), "gloo",
            namespace="unicron/torchelastic-attempt-1/", store_exists=True,
        )  # fmt: skip
        assert dist.get_world_size() == 1
        arrived = dist.PrefixStore("unicron/torchelastic-attempt-1/", agent_store).add("unicron/arrived", 0)
        assert arrived == reform._SEALED + 1  # one rank in, and sealed
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- counting in: a rank that leaves takes its count back, unless the group is sealed ----------


def _arrival_store() -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    from unicron.redisutil import free_port

    return dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def test_a_superseded_rank_takes_its_count_back_so_the_group_never_forms_without_it() -> None:
    import time

    from unicron.trainer import reform

    store = _arrival_store()
    store.add(reform._ARRIVED_KEY, 1)  # of three ranks, one is in and waits
    with pytest.raises(reform.Superseded):
        reform._arrive(store, 3, lambda: True, time.monotonic() + 10, "here", 10)
    assert store.add(reform._ARRIVED_KEY, 0) == 1
    with pytest.raises(TimeoutError, match="2 of 3 ranks arrived"):
        reform._arrive(store, 3, lambda: False, time.monotonic() - 1, "here", 10)
    assert store.add(reform._ARRIVED_KEY, 0) == 1


def test_the_last_rank_in_seals_the_group_even_when_a_newer_reform_is_waiting() -> None:
    import time

    from unicron.trainer import reform

    store = _arrival_store()
    store.add(reform._ARRIVED_KEY, 1)  # the other rank of two is in, about to form the group
    reform._arrive(store, 2, lambda: True, time.monotonic() + 10, "here", 10)
    assert store.add(reform._ARRIVED_KEY, 0) == reform._SEALED + 2


def test_a_rank_sealed_in_while_it_was_leaving_stays() -> None:
    """The last other rank comes in and seals between this rank's look at the count and its
    leaving: the others are already forming the group with it, so it stays."""
    import time

    from unicron.trainer import reform

    store = _arrival_store()
    store.add(reform._ARRIVED_KEY, 1)

    def sealed_meanwhile() -> bool:
        store.add(reform._ARRIVED_KEY, 1)
        store.compare_set(reform._ARRIVED_KEY, "3", str(reform._SEALED + 3))
        return True

    reform._arrive(store, 3, sealed_meanwhile, time.monotonic() + 10, "here", 10)
    assert store.add(reform._ARRIVED_KEY, 0) == reform._SEALED + 3


def test_a_group_after_a_failed_one_has_the_name_its_peers_expect() -> None:
    """A failed ``init_process_group`` counts a group but leaves no world to destroy; the
    next group must still be named "0", as on its peers that had no failure, or each side
    waits for the other's address under another name until the timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    from unicron.redisutil import free_port
    from unicron.trainer import reform

    dist.distributed_c10d._world.group_count = 1  # as a failed attempt leaves it
    reform.join(0, 1, "127.0.0.1", free_port(), timedelta(seconds=10), "gloo", namespace="unicron/gen-3/")
    try:
        assert dist.distributed_c10d._get_process_group_name(dist.distributed_c10d._get_default_group()) == "0"
    finally:
        dist.destroy_process_group()
