from __future__ import annotations

from pathlib import Path

import pytest

from unicron import jobspec
from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2

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
        ({"model": {"num_layers": 2}}, "model"),  # the shape is the program's own now
        ({"program": {"entrypoint": "a:b"}}, "program.entrypoint"),
        ({"program": {"args": "--lr 3"}}, "program.args"),
        ({"program": {"args": [{"lr": 3}]}}, "program.args[0]"),
        ({"program": {"env": {"A": ["x"]}}}, "program.env[A]"),
        ({"program": {"env": ["A=1"]}}, "program.env"),
        ({"training": {"iterations": -1}}, "training.iterations"),
        ({"training": {"iterations": True}}, "training.iterations"),
        ({"program": 3}, "program"),
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


def test_program_and_data_are_read_as_given() -> None:
    spec = jobspec.spec_from_dict(
        {
            "program": {"entry_point": "pkg.train:main", "args": ["--lr", 3e-4, 7], "env": {"OMP_NUM_THREADS": 1}},
            "data": {"path": "/data/corpus", "tokenizer": "/data/tok.json", "options": {"split": "99,1,0"}},
            "estimate": {"parameters": 1.2e9, "tokens_per_step": 524288},
        }
    )
    assert list(spec.program.args) == ["--lr", "0.0003", "7"]
    assert dict(spec.program.env) == {"OMP_NUM_THREADS": "1"}
    assert spec.data.options["split"] == "99,1,0" and spec.estimate.parameters == 1.2e9


@pytest.mark.parametrize(
    ("program", "field"),
    [
        ({}, "spec.program"),
        ({"entry_point": "a:b", "command": ["python", "t.py"]}, "spec.program"),
        ({"entry_point": "train.py"}, "spec.program.entry_point"),
        ({"entry_point": "pkg.mod:"}, "spec.program.entry_point"),
        ({"command": [" "]}, "spec.program.command"),
        ({"entry_point": "a:b", "env": {"1X": "y"}}, "spec.program.env[1X]"),
        ({"entry_point": "a:b", "env": {"UNICRON_TRAINER_SPEC": "{}"}}, "spec.program.env[UNICRON_TRAINER_SPEC]"),
    ],
)
def test_a_bad_program_names_the_field(program: dict, field: str) -> None:
    spec = jobspec.load_spec_file(EXAMPLE)
    spec.ClearField("program")
    spec.MergeFrom(jobspec.spec_from_dict({"program": program}))
    with pytest.raises(InvalidArgument) as error:
        jobspec.normalized(spec)
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


def _large(data: int, max_data: int, batch: int, profile: dict[int, float] | None = None) -> common_pb2.JobSpec:
    spec = jobspec.load_spec_file(EXAMPLE)
    spec.parallelism.tensor, spec.parallelism.pipeline = 8, 16
    spec.parallelism.data = spec.parallelism.min_data = data
    spec.parallelism.max_data = max_data
    spec.training.global_batch_size = batch
    spec.training.micro_batch_size = 1
    for size, flops in (profile or {}).items():
        spec.throughput[size] = flops
    return spec


@pytest.mark.parametrize(
    ("data", "max_data", "ok"),
    [
        (12, 12, True),  # Llama 3 405B on 16,384 GPUs is 1,536 ranks per 405B job here
        (781, 781, True),  # 99,968 ranks: a 100,000-GPU run
        (1024, 1024, True),  # 131,072 ranks: the limit
        (1024, 1025, False),
    ],
)
def test_world_sizes_of_real_runs_are_accepted(data: int, max_data: int, ok: bool) -> None:
    spec = _large(data, max_data, batch=data * (max_data if max_data != data else 1))
    if ok:
        assert jobspec.world_size(jobspec.normalized(spec)) == 128 * data
    else:
        with pytest.raises(InvalidArgument) as error:
            jobspec.normalized(spec)
        assert error.value.field == "spec.parallelism"


def test_a_profile_names_the_degrees_that_must_split_the_batch() -> None:
    """The planner offers a job with a profile only the profile's sizes, so only those must
    split the batch; without a profile every degree in the range must."""
    unit = 8 * 16
    spec = _large(9, 12, batch=2520, profile={unit * dp: 1e15 * dp for dp in (9, 10, 12)})
    assert jobspec.data_parallel_degrees(jobspec.normalized(spec)) == [9, 10, 12]
    spec = _large(9, 12, batch=2520, profile={unit * dp: 1e15 * dp for dp in (9, 11, 12)})
    with pytest.raises(InvalidArgument, match=r"1 x 11"):
        jobspec.normalized(spec)
    with pytest.raises(InvalidArgument, match=r"1 x 11"):
        jobspec.normalized(_large(9, 12, batch=2520))


# YAML 1.1 (PyYAML's safe_load) reads a float only with a dot and a signed exponent; a spec
# is read with YAML 1.2's floats as well.
@pytest.mark.parametrize(
    ("written", "value"),
    [
        ("1.0e9", 1.0e9),
        ("1e9", 1.0e9),
        ("1E+9", 1.0e9),
        ("1.5e+12", 1.5e12),
        ("2.5e-3", 2.5e-3),
        (".5e3", 500.0),
        ("4_000e6", 4.0e9),
        ("1000", 1000.0),
        ("123.5", 123.5),
    ],
)
def test_yaml_numbers_read_as_numbers(tmp_path: Path, written: str, value: float) -> None:
    file = tmp_path / "spec.yaml"
    file.write_text(f"throughput: {{1: {written}}}\nweight: {written}\ntraining: {{learning_rate: {written}}}\n")
    spec = jobspec.load_spec_file(file)
    assert spec.throughput[1] == spec.weight == spec.training.learning_rate == value


@pytest.mark.parametrize(
    ("written", "text"),
    [
        ('"1e9"', "1e9"),  # quoted: a string
        ("1e9", "1e9"),  # a number, but where a string is expected it reads as written
        ("-2.5e-3", "-2.5e-3"),
        ("3e4567", "3e4567"),  # a hash prefix, not an overflowed number
        ("1.10", "1.10"),
        ("1.2.3", "1.2.3"),
        ("e9", "e9"),
        ("1e", "1e"),
    ],
)
def test_strings_stay_as_written(tmp_path: Path, written: str, text: str) -> None:
    file = tmp_path / "spec.yaml"
    file.write_text(
        f"program: {{image: {written}, args: [--x, {written}], env: {{X: {written}}}}}\n"
        f"data: {{options: {{x: {written}}}}}\n"
    )
    spec = jobspec.load_spec_file(file)
    assert spec.program.image == spec.program.args[1] == spec.program.env["X"] == spec.data.options["x"] == text


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("throughput: {1: 1.0e9x}", "throughput[1]"),
        ("throughput: {1: '1e9'}", "throughput[1]"),  # quoted: a string, not a number
        ("weight: 1e", "weight"),
        ("weight: 1.0.0", "weight"),
        ("training: {iterations: 1e3}", "training.iterations"),  # a float is no integer
        ("parallelism: {data: 2.5}", "parallelism.data"),
    ],
)
def test_bad_yaml_numbers_name_the_field(tmp_path: Path, yaml_text: str, field: str) -> None:
    file = tmp_path / "spec.yaml"
    file.write_text(yaml_text + "\n")
    with pytest.raises(InvalidArgument) as error:
        jobspec.load_spec_file(file)
    assert error.value.field == field


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("weight: 3e4567", "spec.weight"),  # inf
        ("throughput: {4: -1e9}", "spec.throughput[4]"),
        ("estimate: {parameters: -1e9}", "spec.estimate.parameters"),
    ],
)
def test_numbers_out_of_range_are_refused_by_validation(tmp_path: Path, yaml_text: str, field: str) -> None:
    file = tmp_path / "spec.yaml"
    file.write_text(EXAMPLE.read_text() + "\n" + yaml_text + "\n")
    with pytest.raises(InvalidArgument) as error:
        jobspec.normalized(jobspec.load_spec_file(file))
    assert error.value.field == field


def _with_training(**values: object) -> common_pb2.JobSpec:
    spec = jobspec.load_spec_file(EXAMPLE)
    for name, value in values.items():
        setattr(spec.training, name, value)
    return spec


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"optimizer": "lamb"}, "spec.training.optimizer"),
        ({"adam_beta1": 1.0}, "spec.training.adam_beta1"),
        ({"adam_beta2": -0.1}, "spec.training.adam_beta2"),
        ({"adam_beta2": float("nan")}, "spec.training.adam_beta2"),
        ({"adam_eps": 0.0}, "spec.training.adam_eps"),
        ({"sgd_momentum": 1.5}, "spec.training.sgd_momentum"),
        ({"clip_grad": -1.0}, "spec.training.clip_grad"),
        ({"clip_grad": float("inf")}, "spec.training.clip_grad"),
        ({"replication": 3}, "spec.training.replication"),
        ({"optimizer": "sgd", "distributed_optimizer": True}, "spec.training.optimizer"),
        ({"checkpoint_format": "nemo"}, "spec.training.checkpoint_format"),
        ({"initial_checkpoint_weights_only": True}, "spec.training.initial_checkpoint_weights_only"),
        ({"lr_decay_style": "WSD"}, "spec.training.lr_wsd_decay_iterations"),  # WSD needs its anneal
        ({"lr_decay_style": "WSD", "lr_wsd_decay_iterations": 61}, "spec.training.lr_wsd_decay_iterations"),
        (
            {"lr_decay_style": "WSD", "lr_wsd_decay_iterations": 5, "lr_wsd_decay_style": "step"},
            "spec.training.lr_wsd_decay_style",
        ),
        ({"lr_decay_style": "cosine", "lr_warmup_iterations": 60}, "spec.training.lr_decay_iterations"),
        (
            {"lr_decay_style": "linear", "lr_decay_iterations": 10, "lr_warmup_iterations": 10},
            "spec.training.lr_decay_iterations",
        ),
    ],
)
def test_optimizer_settings_out_of_range_name_the_field(values: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        jobspec.normalized(_with_training(**values))
    assert error.value.field == field


def test_tuned_optimizer_settings_are_accepted_and_unset_ones_defaulted() -> None:
    spec = jobspec.normalized(
        _with_training(
            adam_beta2=0.95,
            clip_grad=0.0,
            lr_decay_style="WSD",
            lr_decay_iterations=50,
            lr_wsd_decay_iterations=10,
            overlap_grad_reduce=True,
        )
    )
    train = spec.training
    assert (train.optimizer, train.adam_beta1, train.adam_beta2, train.adam_eps) == ("adam", 0.9, 0.95, 1e-8)
    assert (train.clip_grad, train.sgd_momentum, train.lr_wsd_decay_style) == (0.0, 0.9, "linear")
    assert train.overlap_grad_reduce and train.lr_decay_iterations == 50
