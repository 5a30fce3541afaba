"""The GPT example's model and forward step, written as a Megatron-Core user writes them
(Megatron-LM's pretrain_gpt.py has the same shape), and its synthetic data set.

Nothing here knows Unicron: ``train.py`` hands these to ``unicron.trainer.pretrain``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """GPT shape. ``ffn_hidden_size=0`` means Megatron's default of ``4 * hidden_size``."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 128
    ffn_hidden_size: int = 0
    # Megatron's defaults. Masks are drawn from generators the trainer library seeds per
    # micro-batch from the samples it holds, so every remedy stays exact with dropout on.
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # Megatron's sequence parallelism (needs tensor parallelism): layer norms and dropout on
    # each TP rank's slice of the sequence.
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads"
                f" ({self.num_attention_heads})"
            )
        if self.ffn_hidden_size < 0:
            raise ValueError(f"ffn_hidden_size must not be negative, got {self.ffn_hidden_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def shape(self) -> dict[str, int]:
        """What a checkpoint of this model must match: its shape (dropout and sequence
        parallelism are not part of it)."""
        return {k: v for k, v in asdict(self).items() if not k.endswith("_dropout") and k != "sequence_parallel"}

    def parameters(self) -> float:
        """Parameter count (bias-free linear layers with a 4h FFN, two layer norms per layer and a
        final one, untied embeddings, learned positions)."""
        layers, h, v, s = self.num_layers, self.hidden_size, self.vocab_size, self.seq_length
        return 12.0 * layers * h * h + 4.0 * layers * h + 2.0 * h + (2 * v + s) * h

    def flops_per_token(self) -> float:
        """Forward+backward model FLOPs per token (Narayanan et al. 2021):
        ``24*l*h^2 * (1 + s/(6h) + V/(16*l*h))``, which assumes a 4h FFN."""
        n, h, s, v = self.num_layers, self.hidden_size, self.seq_length, self.vocab_size
        return 24.0 * n * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * n * h))


def check_split(model: ModelConfig, tensor_parallel: int, pipeline_parallel: int) -> None:
    for name, value in (
        ("num_attention_heads", model.num_attention_heads),
        ("vocab_size", model.vocab_size),
        ("ffn_hidden_size", model.ffn_size),
    ):
        if value % tensor_parallel:
            raise ValueError(f"{name} ({value}) must be divisible by tensor_parallel ({tensor_parallel})")
    if model.num_layers % pipeline_parallel:
        raise ValueError(
            f"num_layers ({model.num_layers}) must be divisible by pipeline_parallel ({pipeline_parallel})"
        )


# Megatron-LM's --bf16 / --fp16: the TransformerConfig's flags and the parameters' dtype.
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_provider(model: ModelConfig, precision: str = "fp32") -> Callable[[bool, bool], GPTModel]:
    """Megatron's model provider for ``model``: this rank's (TP, PP) slice of the GPT, in
    ``precision`` (fp32, bf16 or fp16)."""
    dtype = PRECISION_DTYPES[precision]

    def provide(pre_process: bool, post_process: bool) -> GPTModel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        check_split(model, tp, pp)
        config = TransformerConfig(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            ffn_hidden_size=model.ffn_size,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            hidden_dropout=model.hidden_dropout,
            attention_dropout=model.attention_dropout,
            sequence_parallel=model.sequence_parallel,
            bf16=precision == "bf16",
            fp16=precision == "fp16",
            params_dtype=dtype,
            pipeline_dtype=dtype,
            # No biases in the linear layers (as in LLaMA and PaLM): the attention's key bias has
            # no gradient at all (softmax ignores a shift), so Adam would turn its rounding noise
            # into lr-sized steps, and runs under different DP degrees would drift apart there.
            add_bias_linear=False,
            # Every TP rank draws the full weight from the same seed and keeps its slice, so the
            # initial model does not depend on the TP degree (and it is required on CPU).
            use_cpu_initialization=True,
            # The default ("full") is deprecated and warns on every config; [] means the same.
            cuda_graph_scope=[],
        )
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=model.vocab_size,
            max_sequence_length=model.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            # Untied embeddings avoid the first/last-stage embedding all-reduce under PP.
            share_embeddings_and_output_weights=False,
        )

    return provide


def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Megatron's forward step: one micro-batch through the model, and the loss function."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    mask = batch.get("loss_mask")
    mask = torch.ones_like(labels, dtype=torch.float32) if mask is None else mask.to(device).float()
    position_ids = torch.arange(tokens.size(1), device=device).unsqueeze(0).expand_as(tokens)
    # attention_mask=None: the local attention builds its own causal mask.
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        # A sum and a token count (not a mean): the schedule divides by the tokens of the whole
        # global batch, so the update does not depend on how the batch is split.
        losses = output_tensor.float() * mask
        loss_sum = losses.sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach().clone(), num_tokens.float()])}

    return output, loss_func


class SyntheticData:
    """Arithmetic sequences modulo the vocabulary: sample ``i`` is a function of (seed, i).
    A random start and a stride from {1, 2, 3} give structure a small model learns in a few
    dozen steps."""

    def __init__(self, model: ModelConfig, seed: int, num_samples: int) -> None:
        self._model, self._seed, self._size = model, seed, num_samples

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> Batch:
        rng = np.random.default_rng([self._seed, index])
        start = int(rng.integers(self._model.vocab_size))
        stride = int(rng.integers(1, 4))
        seq = torch.from_numpy((start + stride * np.arange(self._model.seq_length + 1)) % self._model.vocab_size)
        seq = seq.to(torch.int64)
        return {"tokens": seq[:-1], "labels": seq[1:]}
