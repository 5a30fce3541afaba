"""A user's program that breaks the library's contract fails once, with its cause and
traceback reported as FAILURE_KIND_PROGRAM_ERROR: real trainer processes
(`python -m services.trainer`) against a fake agent."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.harness import FakeAgent, run_ranks, tiny_spec
from unicron.v1 import common_pb2


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    fake = FakeAgent()
    yield fake
    fake.stop()


def _spec(entry_point: str, args: list[str] | None = None, data_path: str = "") -> common_pb2.JobSpec:
    spec = tiny_spec(iterations=3)
    spec.program.entry_point = entry_point
    if args is not None:
        del spec.program.args[:]
        spec.program.args.extend(args)
    spec.data.path = data_path
    return spec


@pytest.mark.parametrize(
    ("entry_point", "args", "data_path", "cause"),
    [
        ("no_such_package.train:main", None, "", "importing no_such_package.train failed: No module named"),
        ("tests.examples.programs.broken:provider_raises", None, "", "dataset_provider raised FileNotFoundError"),
        (
            "tests.examples.programs.broken:loss_returns_a_mean",
            None,
            "",
            "must return (loss_sum, num_tokens, report), or (loss, report)",
        ),
        ("tests.examples.programs.broken:returns_early", None, "", "returned after iteration 0 of 3"),
        ("tests.examples.programs.broken:exits_zero", None, "", "exited 0 after iteration 0"),
        ("examples.gpt.train:main", None, "/nowhere/corpus", "data path /nowhere/corpus.bin does not exist"),
        # The GPT example's own check of its shape, raised before anything trained.
        ("examples.gpt.train:main", ["--num-attention-heads", "4", "--hidden-size", "30"], "", "divisible"),
    ],
)
def test_a_broken_program_is_reported_once_as_the_programs_error(
    agent: FakeAgent, tmp_path: Path, entry_point: str, args: list[str] | None, data_path: str, cause: str
) -> None:
    (result,) = run_ranks(agent, _spec(entry_point, args, data_path), 1, tmp_path)
    assert result.returncode == 1, result.log[-3000:]
    errors = agent.of(0, "error")
    assert len(errors) == 1, errors
    assert errors[0].kind == common_pb2.FAILURE_KIND_PROGRAM_ERROR, errors[0]
    assert cause in errors[0].message, errors[0].message
    assert "ProgramError" in errors[0].traceback or "Traceback" in errors[0].traceback
    assert not agent.of(0, "iteration")


@pytest.mark.parametrize("entry_point", ["gpt", "loss_as_mean_and_report"])
def test_programs_that_keep_the_contract_train(agent: FakeAgent, tmp_path: Path, entry_point: str) -> None:
    (result,) = run_ranks(agent, _spec(f"tests.examples.programs.working:{entry_point}"), 1, tmp_path)
    assert result.returncode == 0, result.log[-3000:]
    reports = agent.of(0, "iteration")
    assert [r.iteration for r in reports] == [1, 2, 3]
    # An untrained model is near-uniform over its 64 tokens; every sample's 16 tokens count.
    assert abs(reports[0].loss - math.log(64)) < 0.3 and reports[0].tokens == 4 * 16
    assert [f.iterations for f in agent.of(0, "finished")] == [3]
