from __future__ import annotations

from pathlib import Path

import pytest

from unicron import jobspec
from unicron.errors import InvalidArgument

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt-tiny.yaml"


def test_example_spec_is_valid() -> None:
    spec = jobspec.normalized(jobspec.load_spec_file(EXAMPLE))
    assert spec.name == "gpt-tiny"
    assert jobspec.world_size(spec) == 4
    assert spec.parallelism.min_data == spec.parallelism.max_data == 4


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"nmae": "x"}, "nmae"),
        ({"model": {"layers": 2}}, "model.layers"),
        ({"model": {"num_layers": "two"}}, "model.num_layers"),
        ({"model": {"num_layers": -1}}, "model.num_layers"),
        ({"model": {"num_layers": True}}, "model.num_layers"),
        ({"model": 3}, "model"),
        ({"weight": "heavy"}, "weight"),
        ({"preemptible": "yes"}, "preemptible"),
        ({"name": 5}, "name"),
        ([1, 2], "spec"),
    ],
)
def test_malformed_yaml_names_the_field(data: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        jobspec.spec_from_dict(data)
    assert error.value.field == field


def test_unreadable_and_invalid_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        jobspec.load_spec_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed")
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        jobspec.load_spec_file(broken)


def test_defaults_are_filled() -> None:
    spec = jobspec.with_defaults(jobspec.spec_from_dict({"parallelism": {"data": 2}}))
    assert (spec.parallelism.tensor, spec.parallelism.pipeline) == (1, 1)
    assert (spec.parallelism.min_data, spec.parallelism.max_data) == (2, 2)
    assert spec.weight == 1.0 and spec.training.micro_batch_size == 1


def test_every_allowed_data_parallel_degree_must_split_the_batch() -> None:
    spec = jobspec.load_spec_file(EXAMPLE)
    spec.parallelism.min_data = 3  # 16 samples do not split over 3 x 2
    spec.parallelism.max_data = 4
    with pytest.raises(InvalidArgument) as error:
        jobspec.normalized(spec)
    assert error.value.field == "spec.training.global_batch_size"
