"""A small Llama-style decoder in plain PyTorch: RMSNorm before attention and MLP, rotary
position embeddings, a SwiGLU MLP, causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``; no dropout, no biases, and an output
head untied from the embedding. The layout follows Meta's reference Llama and torchtitan
(``layers`` is the list of blocks that ``fully_shard`` wraps one by one).

Nothing here knows FSDP or Unicron: ``train.py`` shards it and trains it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape. ``ffn_dim`` follows Llama: two thirds of ``4 * dim`` (SwiGLU has
    three matrices where a GELU MLP has two, so this keeps its parameter count), rounded up
    to a multiple of ``multiple_of``."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 1024
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64
    # Residual dropout after the attention and the feed-forward (0: none, Llama's own).
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"dim ({self.dim}) must split into {self.n_heads} heads of an even size (rotary embeddings"
                " rotate pairs of channels)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# The --size presets. The vocabulary is the tokenizer's: train.py replaces vocab_size by the
# size of the one the data was made with.
SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(dim=128, n_layers=4, n_heads=4),  # about 1.1M parameters at vocab 1024
    "10m": LlamaConfig(dim=256, n_layers=12, n_heads=8),  # about 10M
    "100m": LlamaConfig(dim=768, n_layers=14, n_heads=12, multiple_of=256),  # about 100M
}


def parameters(config: LlamaConfig) -> int:
    """The model's parameter count, from its shape alone (what ``Llama(config)`` holds)."""
    attention = 4 * config.dim * config.dim  # wq, wk, wv, wo
    mlp = 3 * config.dim * config.ffn_dim  # w1, w2, w3
    block = attention + mlp + 2 * config.dim  # and its two RMSNorm weights
    embedding_and_head = 2 * config.vocab_size * config.dim  # untied
    return config.n_layers * block + embedding_and_head + config.dim  # and the final norm


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias (Zhang & Sennrich, 2019).
    Computed in fp32 whatever the activations' dtype: the mean of squares of bf16 values
    loses too much precision."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_frequencies(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """``exp(i * position * theta^(-2k/head_dim))`` for every position and channel pair, as
    complex numbers (Meta's ``precompute_freqs_cis``): rotating a pair is multiplying by one."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inverse)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seq, heads, head_dim) with each consecutive channel pair rotated by its
    position's angle; in fp32, as complex multiplication needs, then back to ``x``'s dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_heads, self.head_dim)
        q, k = apply_rotary(q, freqs), apply_rotary(k, freqs)
        # SDPA takes (batch, heads, seq, head_dim) and picks the fastest kernel for the device.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer, 2020): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.attention(self.attention_norm(x), freqs), self.dropout, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.dropout, self.training)


class Llama(nn.Module):
    freqs: torch.Tensor  # the rotary table, a buffer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Derived from the shape, never trained: not persistent, so not in the state dict (nor
        # in what a checkpoint holds), and complex, so FSDP's mixed precision leaves it be.
        self.register_buffer(
            "freqs", rotary_frequencies(config.head_dim, config.max_seq_len, config.rope_theta), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialization: N(0, 0.02) weights, the projections into the residual
        stream (attention's ``wo``, the MLP's ``w2``) scaled down by ``sqrt(2 * n_layers)``
        so that the stream's variance does not grow with depth; norms start at one."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                residual = name.endswith(("attention.wo", "feed_forward.w2"))
                scale = math.sqrt(2 * self.config.n_layers) if residual else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std / scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of the next token at every position of ``tokens``
        (batch, seq); always fp32, so that the loss is."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"a sequence of {seq} tokens is longer than max_seq_len {self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[:seq]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h)).float()
