"""HSDP's rule for the data-parallel degrees a job can be laid out at (unicron/hsdp.py), and the
places that follow it: the spec's check, the planner's sizes, the coordinator's plan request,
and the session's agreement with its spec."""

from __future__ import annotations

import pytest

from services.coordinator import decide, state
from services.planner.domain import FieldError, Job, allowed_sizes
from unicron import hsdp, jobspec
from unicron.errors import InvalidArgument
from unicron.trainer.program import ProgramError, Training
from unicron.trainer.session import Session
from unicron.v1 import common_pb2


@pytest.mark.parametrize(
    ("data_parallel", "shard_degree", "fits"),
    [
        (3, 0, True),  # no HSDP: any degree
        (3, 1, True),
        (4, 4, True),  # one group
        (8, 4, True),  # two groups
        (12, 4, True),
        (6, 4, False),  # one and a half groups: no 2-D mesh
        (2, 4, True),  # shrunk below a group: sharded whole, as plain FSDP
        (1, 4, True),
    ],
)
def test_which_degrees_hsdp_can_lay_out(data_parallel: int, shard_degree: int, fits: bool) -> None:
    assert hsdp.fits(data_parallel, shard_degree) is fits


def test_the_planner_offers_only_degrees_that_fit() -> None:
    job = Job("j", weight=1.0, tensor_parallel=1, pipeline_parallel=1, min_dp=1, max_dp=12, shard_degree=4)
    assert allowed_sizes(job) == [1, 2, 3, 4, 8, 12]
    with pytest.raises(FieldError, match="shard_degree"):
        Job("j", weight=1.0, tensor_parallel=1, pipeline_parallel=1, min_dp=5, max_dp=7, shard_degree=4)
    with pytest.raises(FieldError, match=r"throughput\[6\]"):
        Job("j", 1.0, 1, 1, 1, 8, throughput={4: 1.0, 6: 2.0}, shard_degree=4)


def _spec(**parallelism: int) -> common_pb2.JobSpec:
    spec = jobspec.spec_from_dict(
        {
            "name": "hsdp",
            "program": {"entry_point": "examples.llama_fsdp.train:main"},
            "parallelism": parallelism,
            "training": {"iterations": 10, "global_batch_size": 48},
        }
    )
    return jobspec.with_defaults(spec)


def test_the_spec_says_its_shard_degree_and_is_checked() -> None:
    spec = _spec(data=8, min_data=2, max_data=12, shard_degree=4)
    jobspec.validate(spec)
    assert jobspec.data_parallel_degrees(spec) == [2, 3, 4, 8, 12]
    assert jobspec.allowed_sizes(spec) == [2, 3, 4, 8, 12]
    for bad, says in (
        (_spec(data=6, shard_degree=4), "neither a multiple of it nor below it"),
        (_spec(data=4, tensor=2, shard_degree=2), "tensor and pipeline degrees are 1"),
    ):
        with pytest.raises(InvalidArgument, match=says) as error:
            jobspec.validate(bad)
        assert error.value.field == "spec.parallelism.shard_degree"


def test_the_plan_request_carries_it() -> None:
    job = common_pb2.Job(job_id="j", spec=_spec(data=4, min_data=1, max_data=8, shard_degree=4), state=state.PENDING)
    request = decide.plan_request([job], [], 1e-6, 1.0)
    assert request.jobs[0].shard_degree == 4


def test_a_program_that_disagrees_with_its_spec_is_refused() -> None:
    session = Session.__new__(Session)  # only the settings are read
    session.training = Training(shard_degree=4)
    assert session._shard_degree(None) == 4
    assert session._shard_degree(4) == 4
    with pytest.raises(ProgramError, match=r"register\(shard_degree=2\) disagrees .*parallelism.shard_degree 4"):
        session._shard_degree(2)
    session.training = Training()
    assert session._shard_degree(2) == 2  # under torchrun, or a spec that says none
