"""bench.conversion's pure parts: the job it submits and how it judges a run."""

from __future__ import annotations

from bench.conversion import SCENARIOS, Outcome, judge, spec_of, table


def outcome(
    distance: float | None, loss: float = 1.5, bound: float | None = None, state: str = "JOB_STATE_SUCCEEDED"
) -> Outcome:
    return Outcome("x", state, loss, 200, 1.0, distance=distance, bound=bound)


def test_the_job_is_the_converted_example_with_megatrons_dropout() -> None:
    spec = spec_of(SCENARIOS[-1], 200)
    assert spec.program.entry_point == "examples.mcore_loop.converted:main"
    assert list(spec.program.args) == ["--dropout", "0.1"]
    assert (spec.parallelism.tensor, spec.parallelism.data, spec.parallelism.min_data) == (2, 2, 1)
    assert spec.training.iterations == 200
    assert spec.name == "conversion-shrink-to-data-1-node-loss"


def test_a_same_layout_remedy_passes_only_when_bit_identical() -> None:
    reference = outcome(None)
    assert judge(outcome(0.0), reference, 1e-4).startswith("PASS")
    assert judge(outcome(1e-12), reference, 1e-4).startswith("FAIL")
    assert judge(outcome(0.0, loss=1.5000001), reference, 1e-4).startswith("FAIL")
    assert judge(outcome(None, state="JOB_STATE_FAILED"), reference, 1e-4) == "FAIL: ended JOB_STATE_FAILED"


def test_a_resize_passes_within_twice_the_failure_free_distance() -> None:
    reference = outcome(None)
    assert judge(outcome(1.9e-4, bound=2e-4), reference, 1e-4).startswith("PASS")
    assert judge(outcome(2.1e-4, bound=2e-4), reference, 1e-4).startswith("FAIL")


def test_the_table_has_a_row_per_run() -> None:
    runs = [vars(outcome(None)), vars(outcome(0.0))]
    text = table({"iterations": 200, "dropout": 0.1, "runs": runs})
    assert len(text.splitlines()) == 2 + len(runs)
