"""Job specs: reading them from YAML, filling defaults, and the one validation that the
coordinator applies (the CLI reuses it so users see errors before any RPC)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from unicron import hsdp
from unicron.config import YAMLFloat, load_yaml
from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2

NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# Ranks one job may ask for: the largest published training runs use 16k-100k GPUs (Llama 3
# 405B: 16,384), so 2^17. Only a bound on what one spec may ask: the cluster's capacity check
# refuses what does not fit.
MAX_WORLD_SIZE = 131_072

_INTEGER_TYPES = {
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
}


def _fill(message: Message, data: Any, path: str) -> None:
    descriptor: Any = message.DESCRIPTOR
    if not isinstance(data, Mapping):
        raise InvalidArgument(path or "spec", "must be a mapping")
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        field = descriptor.fields_by_name.get(str(key))
        if field is None:
            expected = ", ".join(f.name for f in descriptor.fields)
            raise InvalidArgument(where, f"unknown field (expected one of: {expected})")
        if value is None:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            _fill_map(getattr(message, field.name), field.message_type, value, where)
        elif field.label == FieldDescriptor.LABEL_REPEATED:
            _fill_strings(getattr(message, field.name), value, where)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            _fill(getattr(message, field.name), value, where)
        else:
            setattr(message, field.name, _scalar(field.type, value, where))


def _scalar(kind: int, value: Any, where: str) -> Any:
    """``value`` as a scalar field of protobuf type ``kind``, checked."""
    if kind in _INTEGER_TYPES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(where, f"must be an integer, got {value!r}")
        if value < 0:
            raise InvalidArgument(where, f"must not be negative, got {value}")
        if value >= 2**31:
            raise InvalidArgument(where, f"is too large: {value}")
        return value
    if kind == FieldDescriptor.TYPE_DOUBLE:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(where, f"must be a number, got {value!r}")
        return float(value)
    if kind == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise InvalidArgument(where, f"must be true or false, got {value!r}")
        return value
    if kind == FieldDescriptor.TYPE_STRING:
        if isinstance(value, YAMLFloat):  # read as a number, meant as its text (a version, a hash)
            return str(value)
        if not isinstance(value, str):
            raise InvalidArgument(where, f"must be a string, got {value!r}")
        return value
    raise InvalidArgument(where, "unsupported field type")  # pragma: no cover - the spec has no others


def _fill_strings(target: Any, data: Any, path: str) -> None:
    """Lists of strings (a program's command and arguments)."""
    if not isinstance(data, list):
        raise InvalidArgument(path, "must be a list of strings")
    for index, value in enumerate(data):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise InvalidArgument(f"{path}[{index}]", f"must be a string, got {value!r}")
        target.append(str(value))


def _fill_map(target: Any, entry: Any, data: Any, path: str) -> None:
    """Maps of integer keys to numbers (the throughput profile) and of names to strings (a
    program's environment, data options)."""
    if not isinstance(data, Mapping):
        raise InvalidArgument(path, "must be a mapping")
    key_type = entry.fields_by_name["key"].type
    if entry.fields_by_name["value"].type == FieldDescriptor.TYPE_STRING:
        for key, value in data.items():
            if not isinstance(key, str) or not key:
                raise InvalidArgument(f"{path}[{key}]", "key must be a non-empty string")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise InvalidArgument(f"{path}[{key}]", f"must be a string, got {value!r}")
            target[key] = str(value)
        return
    for key, value in data.items():
        where = f"{path}[{key}]"
        if key_type in _INTEGER_TYPES and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
            raise InvalidArgument(where, f"key must be a non-negative integer, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(where, f"must be a number, got {value!r}")
        target[key] = float(value)


def spec_from_dict(data: Any) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec()
    _fill(spec, data, "")
    return spec


def load_spec_file(path: str | Path) -> common_pb2.JobSpec:
    try:
        data = load_yaml(Path(path).read_text())
    except OSError as exc:
        raise InvalidArgument("spec", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise InvalidArgument("spec", f"{path} is not valid YAML: {exc}") from None
    return spec_from_dict(data)


# Iterations between persistent checkpoints: the restart of last resort recomputes at most this many.
DEFAULT_CHECKPOINT_INTERVAL = 10


def with_defaults(spec: common_pb2.JobSpec) -> common_pb2.JobSpec:
    """A copy with the documented defaults filled in (zero means 'default' in proto3)."""
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    par = out.parallelism
    par.tensor = par.tensor or 1
    par.pipeline = par.pipeline or 1
    par.min_data = par.min_data or par.data
    par.max_data = par.max_data or par.data
    train = out.training
    train.micro_batch_size = train.micro_batch_size or 1
    train.learning_rate = train.learning_rate or 1e-3
    train.checkpoint_interval = train.checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL
    train.lr_decay_style = train.lr_decay_style or "constant"
    train.lr_wsd_decay_style = train.lr_wsd_decay_style or OPTIMIZER_DEFAULTS["lr_wsd_decay_style"]
    train.optimizer = train.optimizer or OPTIMIZER_DEFAULTS["optimizer"]
    train.precision = train.precision or OPTIMIZER_DEFAULTS["precision"]
    train.eval_iterations = train.eval_iterations or 1
    train.checkpoint_format = train.checkpoint_format or OPTIMIZER_DEFAULTS["checkpoint_format"]
    for name in OPTIONAL_OPTIMIZER_SETTINGS:
        if not train.HasField(name):
            setattr(train, name, OPTIMIZER_DEFAULTS[name])
    out.weight = out.weight or 1.0
    return out


def _require(condition: bool, field: str, problem: str) -> None:
    if not condition:
        raise InvalidArgument(field, problem)


def validate(spec: common_pb2.JobSpec) -> None:
    """Raises InvalidArgument naming the first bad field. Expects defaults filled."""
    _require(bool(spec.name), "spec.name", "is required")
    _require(
        bool(NAME_PATTERN.match(spec.name)),
        "spec.name",
        f"{spec.name!r} must be lowercase letters, digits and '-', 1-63 characters",
    )
    validate_program(spec.program)
    par = spec.parallelism
    _require(par.data > 0, "spec.parallelism.data", "is required and must be positive")
    _require(
        par.min_data <= par.data <= par.max_data,
        "spec.parallelism.data",
        f"must lie within min_data..max_data ({par.min_data}..{par.max_data})",
    )
    world = par.tensor * par.pipeline * par.max_data
    _require(world <= MAX_WORLD_SIZE, "spec.parallelism", f"asks for {world} ranks, over {MAX_WORLD_SIZE}")
    _validate_shard_degree(par)
    train = spec.training
    _require(train.iterations > 0, "spec.training.iterations", "is required and must be positive")
    _require(train.global_batch_size > 0, "spec.training.global_batch_size", "is required and must be positive")
    _require(train.learning_rate > 0, "spec.training.learning_rate", "must be positive")
    _require(math.isfinite(spec.weight) and spec.weight > 0, "spec.weight", "must be a positive number")
    _require(math.isfinite(train.learning_rate), "spec.training.learning_rate", "must be a finite number")
    est = spec.estimate
    for name in ("parameters", "tokens_per_step"):
        value = getattr(est, name)
        _require(math.isfinite(value) and value >= 0, f"spec.estimate.{name}", "must be a non-negative number")
    problem = training_problem({name: getattr(train, name) for name in TRAINING_CHECKED})
    if problem is not None:
        raise InvalidArgument(f"spec.training.{problem[0]}", problem[1])
    allowed = set(allowed_sizes(spec))
    for size, flops in spec.throughput.items():
        _require(
            size in allowed,
            f"spec.throughput[{size}]",
            f"is not an allowed size (tensor x pipeline x data: {sorted(allowed)})",
        )
        _require(math.isfinite(flops) and flops > 0, f"spec.throughput[{size}]", "must be a positive FLOP/s value")
    for dp in data_parallel_degrees(spec):
        # Every data-parallel degree the job may run at must split the global batch evenly, or
        # a resize would change what the optimizer sees.
        _require(
            train.global_batch_size % (train.micro_batch_size * dp) == 0,
            "spec.training.global_batch_size",
            f"{train.global_batch_size} is not divisible by micro_batch_size x data ({train.micro_batch_size} x {dp})",
        )


ENTRY_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Settings of the trainer runtime itself, which a program's environment must not override.
RESERVED_ENV_PREFIX = "UNICRON_TRAINER_"
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
OPTIMIZERS = ("adam", "sgd")
# The optimizer settings a spec or a Training may leave out, and what they then are: Megatron-
# Core's own defaults.
OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "optimizer": "adam",
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "sgd_momentum": 0.9,
    "clip_grad": 1.0,
    "lr_wsd_decay_style": "linear",
    "precision": "fp32",
    "checkpoint_format": "unicron",
}
CHECKPOINT_FORMATS = ("unicron", "megatron", "dcp")
PRECISIONS = ("fp32", "bf16", "fp16")
# The spec's settings with presence: unset means the default, a set 0 is a 0.
OPTIONAL_OPTIMIZER_SETTINGS = ("adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad")
# The settings ``training_problem`` checks, by their names in both the spec and ``Training``.
TRAINING_CHECKED = (
    "iterations",
    "learning_rate",
    "min_learning_rate",
    "weight_decay",
    "lr_warmup_iterations",
    "lr_decay_iterations",
    "lr_decay_style",
    "lr_wsd_decay_iterations",
    "lr_wsd_decay_style",
    "optimizer",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "sgd_momentum",
    "clip_grad",
    "precision",
    "distributed_optimizer",
    "checkpoint_format",
    "initial_checkpoint",
    "initial_checkpoint_weights_only",
    "replication",
)


def _finite_at_least(value: float, low: float) -> bool:
    return math.isfinite(value) and value >= low


def training_problem(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first bad optimizer or schedule setting in ``values`` (the ``TRAINING_CHECKED``
    names, defaults filled) as (field, problem), or None. One rule set for the job spec (checked
    at submit) and for ``Training`` (runs without Unicron)."""
    rules: list[tuple[str, bool, str]] = [
        (
            "optimizer",
            values["optimizer"] in OPTIMIZERS,
            f"{values['optimizer']!r} is not one of {', '.join(OPTIMIZERS)}",
        ),
        (
            "lr_decay_style",
            values["lr_decay_style"] in LR_DECAY_STYLES,
            f"{values['lr_decay_style']!r} is not one of {', '.join(LR_DECAY_STYLES)}",
        ),
        (
            "lr_wsd_decay_style",
            values["lr_wsd_decay_style"] in LR_WSD_DECAY_STYLES,
            f"{values['lr_wsd_decay_style']!r} is not one of {', '.join(LR_WSD_DECAY_STYLES)}",
        ),
        (
            "precision",
            values["precision"] in PRECISIONS,
            f"{values['precision']!r} is not one of {', '.join(PRECISIONS)}",
        ),
        ("min_learning_rate", _finite_at_least(values["min_learning_rate"], 0), "must be a non-negative number"),
        ("weight_decay", _finite_at_least(values["weight_decay"], 0), "must be a non-negative number"),
        ("min_learning_rate", values["min_learning_rate"] <= values["learning_rate"], "must not exceed learning_rate"),
        ("adam_beta1", _finite_at_least(values["adam_beta1"], 0) and values["adam_beta1"] < 1, "must lie in [0, 1)"),
        ("adam_beta2", _finite_at_least(values["adam_beta2"], 0) and values["adam_beta2"] < 1, "must lie in [0, 1)"),
        ("adam_eps", _finite_at_least(values["adam_eps"], 0) and values["adam_eps"] > 0, "must be a positive number"),
        (
            "sgd_momentum",
            _finite_at_least(values["sgd_momentum"], 0) and values["sgd_momentum"] < 1,
            "must lie in [0, 1)",
        ),
        ("clip_grad", _finite_at_least(values["clip_grad"], 0), "must be a non-negative number (0: no clipping)"),
        (
            "checkpoint_format",
            values["checkpoint_format"] in CHECKPOINT_FORMATS,
            f"{values['checkpoint_format']!r} is not one of {', '.join(CHECKPOINT_FORMATS)}",
        ),
        (
            "initial_checkpoint_weights_only",
            bool(values["initial_checkpoint"]) or not values["initial_checkpoint_weights_only"],
            "is set without an initial_checkpoint to take the weights from",
        ),
        (
            "replication",
            values["replication"] in (0, 1, 2),
            f"must be 1 (no buddy copy) or 2 (one buddy copy), got {values['replication']} (0: the default)",
        ),
        (
            "optimizer",
            not (values["distributed_optimizer"] and values["optimizer"] != "adam"),
            f"{values['optimizer']!r} cannot run under distributed_optimizer: Megatron-Core's distributed"
            " optimizer keeps and saves Adam's state only",
        ),
    ]
    decay = values["lr_decay_iterations"] or values["iterations"]
    style = values["lr_decay_style"]
    if style != "constant":
        rules.append(
            (
                "lr_decay_iterations",
                decay > values["lr_warmup_iterations"],
                f"the decay span ({decay} iterations) must be longer than lr_warmup_iterations"
                f" ({values['lr_warmup_iterations']}) for lr_decay_style {style}",
            )
        )
    if style == "WSD":
        wsd = values["lr_wsd_decay_iterations"]
        rules.append(
            (
                "lr_wsd_decay_iterations",
                0 < wsd <= decay - values["lr_warmup_iterations"],
                f"must lie in [1, {decay - values['lr_warmup_iterations']}] (the decay span after warm-up)"
                " for lr_decay_style WSD",
            )
        )
    for field, ok, problem in rules:
        if not ok:
            return field, problem
    return None


def validate_program(program: common_pb2.ProgramSpec) -> None:
    """The program's own fields: exactly one of entry point and command, well formed."""
    _require(
        bool(program.entry_point) != bool(program.command),
        "spec.program",
        "needs exactly one of entry_point (module:function) and command",
    )
    if program.entry_point:
        _require(
            bool(ENTRY_POINT.match(program.entry_point)),
            "spec.program.entry_point",
            f"{program.entry_point!r} is not of the form package.module:function",
        )
    if program.command:
        _require(bool(program.command[0].strip()), "spec.program.command", "must start with the program to run")
    for name in program.env:
        _require(bool(ENV_NAME.match(name)), f"spec.program.env[{name}]", "is not a valid environment variable name")
        _require(
            not name.startswith(RESERVED_ENV_PREFIX),
            f"spec.program.env[{name}]",
            f"{RESERVED_ENV_PREFIX}* are the runtime's own settings",
        )
    for field, text in (("working_dir", program.working_dir), ("image", program.image)):
        _require("\x00" not in text, f"spec.program.{field}", "must not contain NUL")


def _validate_shard_degree(par: common_pb2.ParallelismSpec) -> None:
    if par.shard_degree <= 1:
        return
    field = "spec.parallelism.shard_degree"
    _require(
        par.tensor == 1 and par.pipeline == 1,
        field,
        "is HSDP's, for a program sharded with FSDP2, whose tensor and pipeline degrees are 1",
    )
    _require(
        hsdp.fits(par.data, par.shard_degree),
        field,
        f"{par.shard_degree}: the data-parallel degree {par.data} is neither a multiple of it nor below it",
    )


def allowed_sizes(spec: common_pb2.JobSpec) -> list[int]:
    par = spec.parallelism
    unit = par.tensor * par.pipeline
    return [unit * dp for dp in range(par.min_data, par.max_data + 1) if hsdp.fits(dp, par.shard_degree)]


def data_parallel_degrees(spec: common_pb2.JobSpec) -> list[int]:
    """The data-parallel degrees a job may run at: its throughput profile's sizes when it
    declares one (the planner offers a job only those: services.planner.domain.allowed_sizes),
    else every degree from min_data to max_data. A job whose batch only some degrees split
    lists those in its profile."""
    par = spec.parallelism
    if spec.throughput:
        unit = max(1, par.tensor * par.pipeline)
        return sorted(size // unit for size in spec.throughput)
    return [dp for dp in range(par.min_data, par.max_data + 1) if hsdp.fits(dp, par.shard_degree)]


# fp32 parameters, gradients and Adam's two moments.
STATE_BYTES_PER_PARAMETER = 16
_PARAMETER_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def state_bytes_per_parameter(training: common_pb2.TrainingSpec, data_parallel: int = 1) -> float:
    """A rank's state per model parameter of its slice in the job's layout: its parameters in
    the job's precision, gradients reduced in fp32 (4), the optimizer's fp32 main copy where
    the parameters are low precision (4), and the optimizer's moments (Adam 8; SGD 4 with
    momentum, 0 without). fp32 Adam: 16; bf16 Adam: 18. Under the distributed optimizer the
    main copy and the moments are sharded over the ``data_parallel`` ranks: bf16 Adam at DP 8
    holds 2 + 4 + 12/8 = 7.5."""
    precision = training.precision or OPTIMIZER_DEFAULTS["precision"]
    main = 0 if precision == "fp32" else 4
    if (training.optimizer or "adam") == "sgd":
        momentum = training.sgd_momentum if training.HasField("sgd_momentum") else OPTIMIZER_DEFAULTS["sgd_momentum"]
        moments = 4 if momentum else 0
    else:
        moments = 8
    sharded: float = main + moments
    if training.distributed_optimizer:
        sharded /= max(1, data_parallel)
    return _PARAMETER_BYTES.get(precision, 4) + 4 + sharded


# How fast a rank that joins a job fetches its state: from a live data-parallel peer holding
# the same (tensor, pipeline) shard, every shard at once, each over one GPU's NIC (400 Gb/s).
STATE_TRANSFER_BYTES_PER_S = 50e9


def world_size(spec: common_pb2.JobSpec, data_parallel: int | None = None) -> int:
    par = spec.parallelism
    return par.tensor * par.pipeline * (data_parallel or par.data)


def normalized(spec: common_pb2.JobSpec) -> common_pb2.JobSpec:
    full = with_defaults(spec)
    validate(full)
    return full
