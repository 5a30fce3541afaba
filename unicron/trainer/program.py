"""What a user's Megatron-Core program gives the runtime, and the training settings the
runtime owns. Megatron's own ``pretrain()`` has the same three parts: a model provider, a
data provider and a forward step (see docs/trainer-library.md).

Errors that are the program's own (a provider that raises, a forward step that returns the
wrong thing, a model that does not fit the job's layout) are ``ProgramError``: deterministic,
so the job fails once with the traceback instead of being restarted into the same error."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from unicron.jobspec import OPTIMIZER_DEFAULTS, TRAINING_CHECKED, training_problem

if TYPE_CHECKING:
    import torch

ModelProvider = Callable[[bool, bool], "torch.nn.Module"]
DatasetProvider = Callable[[int], Any]
ForwardStep = Callable[[Iterator[Any], "torch.nn.Module"], tuple["torch.Tensor", Callable[..., Any]]]


class ProgramError(Exception):
    """An error of the user's program, not of the cluster: retrying it would fail the same way."""


@dataclass(frozen=True)
class Training:
    """The optimization settings the runtime owns. Under Unicron the job spec's values are used
    (the planner sized the job by them); under plain ``torchrun`` these are.

    iterations: optimizer iterations to run. global_batch_size: samples per iteration over all
    data-parallel ranks, kept across every resize. micro_batch_size: samples per forward pass on
    one rank. learning_rate: the peak learning rate. seed: of the model's initialization.
    tensor_parallel, pipeline_parallel: the model's split; the data-parallel degree is what the
    world size leaves. checkpoint_interval: iterations between persistent checkpoints (0: none,
    when run without Unicron). lr_warmup_iterations, lr_decay_iterations (0: iterations),
    lr_decay_style (constant, linear, cosine, inverse-square-root, WSD), lr_wsd_decay_iterations
    and lr_wsd_decay_style (WSD's anneal), min_learning_rate, weight_decay: Megatron's
    OptimizerParamScheduler. optimizer (adam, sgd), adam_beta1, adam_beta2, adam_eps,
    sgd_momentum, clip_grad (0: no clipping): Megatron-Core's OptimizerConfig, with its
    defaults. overlap_grad_reduce: Megatron DDP's overlap of the gradient reduce with the
    backward pass. precision: fp32, bf16 or fp16 (with a dynamic loss scale), as Megatron-LM's
    --bf16 / --fp16 train; the model's TransformerConfig must say the same.
    distributed_optimizer: Megatron's distributed optimizer (Adam's state sharded over the
    data-parallel ranks). eval_interval: evaluate on the program's validation data every this
    many iterations (0: never), over eval_iterations global batches. tensorboard_dir: rank 0
    writes TensorBoard event files there ("": none). checkpoint_format: "unicron", "megatron"
    (Megatron-Core's distributed checkpoint) or "dcp" (torch's, for an FSDP2 program under
    Session). initial_checkpoint: a Megatron-LM checkpoint to
    start from (initial_checkpoint_weights_only: its weights only). replication: 2 keeps a
    buddy copy of each rank's optimizer shard on a peer of another node, 1 none (0: 2 under
    the distributed optimizer or an FSDP2 model, else 1). shard_degree: HSDP's ranks per shard
    group for an FSDP2 model under Session (0: FSDP over every rank; the job spec's
    ``parallelism.shard_degree``, so that the planner picks only sizes it can lay out)."""

    iterations: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 1
    learning_rate: float = 1e-3
    seed: int = 1234
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    checkpoint_interval: int = 0
    lr_warmup_iterations: int = 0
    lr_decay_iterations: int = 0
    lr_decay_style: str = "constant"
    min_learning_rate: float = 0.0
    weight_decay: float = 0.0
    lr_wsd_decay_iterations: int = 0
    lr_wsd_decay_style: str = OPTIMIZER_DEFAULTS["lr_wsd_decay_style"]
    optimizer: str = OPTIMIZER_DEFAULTS["optimizer"]
    adam_beta1: float = OPTIMIZER_DEFAULTS["adam_beta1"]
    adam_beta2: float = OPTIMIZER_DEFAULTS["adam_beta2"]
    adam_eps: float = OPTIMIZER_DEFAULTS["adam_eps"]
    sgd_momentum: float = OPTIMIZER_DEFAULTS["sgd_momentum"]
    clip_grad: float = OPTIMIZER_DEFAULTS["clip_grad"]
    overlap_grad_reduce: bool = False
    precision: str = OPTIMIZER_DEFAULTS["precision"]
    distributed_optimizer: bool = False
    eval_interval: int = 0
    eval_iterations: int = 1
    tensorboard_dir: str = ""
    checkpoint_format: str = OPTIMIZER_DEFAULTS["checkpoint_format"]
    initial_checkpoint: str = ""
    initial_checkpoint_weights_only: bool = False
    replication: int = 0
    shard_degree: int = 0

    @property
    def copies(self) -> int:
        """The replication in force: ``replication``, else 2 under the distributed optimizer."""
        return self.replication or (2 if self.distributed_optimizer else 1)

    def __post_init__(self) -> None:
        for name in ("iterations", "global_batch_size", "micro_batch_size", "tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ProgramError(f"training.{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "checkpoint_interval",
            "lr_warmup_iterations",
            "lr_decay_iterations",
            "lr_wsd_decay_iterations",
            "seed",
            "eval_interval",
            "shard_degree",
        ):
            if getattr(self, name) < 0:
                raise ProgramError(f"training.{name} must not be negative, got {getattr(self, name)}")
        if self.eval_iterations < 1:
            raise ProgramError(f"training.eval_iterations must be at least 1, got {self.eval_iterations}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ProgramError(f"training.learning_rate must be a positive number, got {self.learning_rate}")
        problem = training_problem({name: getattr(self, name) for name in TRAINING_CHECKED})
        if problem is not None:
            raise ProgramError(f"training.{problem[0]} {problem[1]}")
        if self.global_batch_size % self.micro_batch_size:
            raise ProgramError(
                f"training.global_batch_size ({self.global_batch_size}) must be divisible by"
                f" micro_batch_size ({self.micro_batch_size})"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MegatronProgram:
    """A user's Megatron-Core training program, as ``pretrain()`` takes it.

    model_provider(pre_process, post_process): builds this rank's slice of the model (a
    MegatronModule whose ``config`` is its TransformerConfig) after Megatron's parallel state
    is initialized and the seed set; the same call as in Megatron-LM's ``pretrain_gpt.py``.
    dataset_provider(num_samples): a data set addressed by global sample index (``len`` and
    ``ds[i]``, a dict or tuple of tensors), such as Megatron-Core's ``GPTDataset``; sample
    ``i`` must depend on ``i`` alone, which is what makes restarts and resizes see every
    sample exactly once. forward_step(data_iterator, model): Megatron's forward step; the
    iterator yields collated micro-batches, and the loss function returns (loss_sum,
    num_tokens, report). seq_length: tokens per sample (default: the first sample's
    ``tokens`` length). describe: what identifies the model for checkpoints (its shape).
    flops_per_token: model FLOPs per token of one iteration (default: 6 x parameters).
    valid_dataset_provider(num_samples): the validation data, addressed like the training
    data, evaluated every ``Training.eval_interval`` iterations (None: no evaluation)."""

    model_provider: ModelProvider
    dataset_provider: DatasetProvider
    forward_step: ForwardStep
    seq_length: int = 0
    description: Mapping[str, Any] = field(default_factory=dict)
    flops_per_token: float = 0.0
    valid_dataset_provider: DatasetProvider | None = None

    def build_model(self, pre_process: bool, post_process: bool) -> torch.nn.Module:
        import torch

        model = _user_call("model_provider", self.model_provider, pre_process, post_process)
        if not isinstance(model, torch.nn.Module):
            raise ProgramError(f"model_provider must return a torch.nn.Module, got {type(model).__name__}")
        return model

    def check_model(
        self, model: torch.nn.Module, tensor_parallel: int, pipeline_parallel: int, precision: str = "fp32"
    ) -> Any:
        """The model's TransformerConfig, checked against the job's split and precision."""
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "tensor_model_parallel_size"):
            raise ProgramError(
                "model_provider must return a Megatron-Core module whose .config is its TransformerConfig"
            )
        for name, want in (
            ("tensor_model_parallel_size", tensor_parallel),
            ("pipeline_model_parallel_size", pipeline_parallel),
        ):
            if getattr(config, name) != want:
                raise ProgramError(f"the model's TransformerConfig has {name}={getattr(config, name)}, the job {want}")
        check_precision(config, precision, pipeline_parallel)
        # What the runtime's schedule and data split do not handle yet: refused at start, in one
        # line, rather than trained wrong.
        if getattr(config, "virtual_pipeline_model_parallel_size", None):
            raise ProgramError(
                "the model's TransformerConfig sets virtual_pipeline_model_parallel_size (interleaved pipeline"
                " stages), which Unicron does not run yet; leave it None"
            )
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ProgramError(
                f"the model's TransformerConfig sets context_parallel_size={config.context_parallel_size}, which"
                " Unicron does not run yet; leave it 1"
            )
        return config

    def build_dataset(self, num_samples: int) -> Any:
        dataset = _user_call("dataset_provider", self.dataset_provider, num_samples)
        size = dataset_size(dataset)
        if size < 1:
            raise ProgramError("dataset_provider returned an empty data set")
        return dataset

    def build_valid_dataset(self, num_samples: int) -> Any:
        """The validation data; a ProgramError when the program has none."""
        if self.valid_dataset_provider is None:
            raise ProgramError(
                "training.eval_interval is set but the program has no validation data: pass"
                " valid_dataset_provider to pretrain(), or set eval_interval to 0"
            )
        dataset = _user_call("valid_dataset_provider", self.valid_dataset_provider, num_samples)
        if dataset_size(dataset) < 1:
            raise ProgramError("valid_dataset_provider returned an empty data set")
        return dataset

    def describe(self) -> dict[str, Any]:
        return dict(self.description)

    def flops(self, tokens: int, parameters: float) -> float:
        per_token = self.flops_per_token or 6.0 * parameters
        return per_token * tokens


def check_precision(config: Any, precision: str, pipeline_parallel: int) -> None:
    """A ProgramError naming the first setting of the model's TransformerConfig that disagrees
    with the job's precision (Megatron-LM sets them all from its --bf16 / --fp16)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    wants = [("bf16", precision == "bf16"), ("fp16", precision == "fp16"), ("params_dtype", dtype)]
    if pipeline_parallel > 1:
        wants.append(("pipeline_dtype", dtype))  # what the stages send each other
    for name, want in wants:
        have = getattr(config, name, None)
        if have != want:
            raise ProgramError(
                f"the job trains in {precision} (training.precision), but the model's TransformerConfig has"
                f" {name}={have}; set {name}={want}"
            )


def _user_call(name: str, function: Callable[..., Any], *args: Any) -> Any:
    """Calls the user's ``function``; an exception it raises becomes a ProgramError that names
    it and keeps the original (and its traceback) as the cause."""
    try:
        return function(*args)
    except ProgramError:
        raise
    except Exception as exc:
        raise ProgramError(f"{name} raised {type(exc).__name__}: {exc}") from exc


def dataset_size(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise ProgramError(
            f"dataset_provider must return a data set with len() and ds[index], got {type(dataset).__name__}"
        ) from None


def collate(samples: Sequence[Any]) -> Any:
    """Stacks samples (dicts or tuples of tensors, or tensors) into one micro-batch."""
    import numpy as np
    import torch

    first = samples[0]

    def stack(values: list[Any]) -> Any:
        if isinstance(values[0], np.ndarray):
            values = [torch.from_numpy(np.asarray(v)) for v in values]
        if isinstance(values[0], torch.Tensor):
            return torch.stack(values)
        if isinstance(values[0], (int, float)):
            return torch.tensor(values)
        raise ProgramError(f"samples must hold tensors or arrays, got {type(values[0]).__name__}")

    if isinstance(first, Mapping):
        return {key: stack([s[key] for s in samples]) for key in first}
    if isinstance(first, (tuple, list)):
        return tuple(stack([s[i] for s in samples]) for i in range(len(first)))
    return stack(list(samples))


def sample_length(sample: Any) -> int:
    """Tokens per sample: the length of its ``tokens`` entry (or of its first tensor)."""
    value = sample.get("tokens", next(iter(sample.values()))) if isinstance(sample, Mapping) else sample
    if isinstance(value, (tuple, list)):
        value = value[0]
    shape = getattr(value, "shape", None)
    if not shape:
        raise ProgramError("cannot tell the sequence length from the data set's samples; give seq_length")
    return int(shape[-1])
