"""Megatron's distributed optimizer through the engine, in this process (world 1): a rank's
state carries its optimizer shard as named pieces, a state taken before the first step or
after a few loads back into a fresh trainer and trains on bit-identically, and a state copy of
the other optimizer kind is refused before anything is loaded. Resharding across ranks and
every remedy: tests/trainer/test_exactness.py."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from examples.gpt.model import ModelConfig
from examples.gpt.train import program
from unicron.trainer import checkpoint
from unicron.trainer.engine import MegatronTrainer
from unicron.trainer.optimizer_shards import SHARD_KEY, ShardError, ranges_of
from unicron.trainer.program import Training

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)
DISTRIBUTED = Training(
    iterations=12, global_batch_size=4, micro_batch_size=2, learning_rate=1e-2, seed=3, distributed_optimizer=True
)


def _trainer(training: Training = DISTRIBUTED) -> MegatronTrainer:
    return MegatronTrainer(program(MODEL, training.seed, precision=training.precision), training)


def _copy(state: dict) -> dict:
    return copy.deepcopy(state)


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_state_reloaded_trains_on_bit_identically(precision: str) -> None:
    training = replace(DISTRIBUTED, precision=precision)
    trainer = _trainer(training)
    try:
        fresh = _copy(trainer.state_dict())  # before the first step: Adam's state exists already
        shard = fresh[SHARD_KEY]
        # One rank owns every element of every parameter.
        assert {name: (n, s, e) for name, (n, s, e) in ranges_of(shard).items() if s == 0 and e == n} == ranges_of(
            shard
        )
        assert sum(n for n, _, _ in ranges_of(shard).values()) == sum(p.numel() for p in trainer.model.parameters())
        assert set(next(iter(shard["pieces"].values()))["tensors"]) == {"param", "exp_avg", "exp_avg_sq"}
        for _ in range(3):
            trainer.step()
        middle = _copy(trainer.state_dict())
        want = [trainer.step().loss for _ in range(4)]
        final = {k: v.clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
    finally:
        trainer.release()
    for state, steps in ((middle, 4), (fresh, 7)):
        again = _trainer(training)
        try:
            again.load_state_dict(state)
            got = [again.step().loss for _ in range(steps)]
            assert got[-4:] == want  # several steps after the load: Adam's step counts are right
            mine = again.model.state_dict()
            assert all(v.equal(mine[k]) for k, v in final.items())
        finally:
            again.release()


@pytest.mark.usefixtures("world1")
def test_a_state_of_the_other_optimizer_kind_is_refused_and_nothing_loaded() -> None:
    replicated = _trainer(replace(DISTRIBUTED, distributed_optimizer=False))
    try:
        replicated.step()
        theirs = _copy(replicated.state_dict())
    finally:
        replicated.release()
    trainer = _trainer()
    try:
        before = {k: v.clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
        with pytest.raises(checkpoint.CheckpointError, match="replicated optimizer, this job's is distributed"):
            checkpoint.fits(trainer.state_dict())(theirs)
        with pytest.raises(ShardError, match="misses what this rank owns"):
            trainer.load_state_dict(theirs)
        mine = _copy(trainer.state_dict())
        with pytest.raises(checkpoint.CheckpointError, match="distributed optimizer, this job's optimizer is repl"):
            checkpoint.fits(theirs)(mine)
        assert all(v.equal(trainer.model.state_dict()[k]) for k, v in before.items())
        assert trainer.iteration == 0
    finally:
        trainer.release()
