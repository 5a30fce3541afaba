"""The GPT example's data pipeline: stdlib corpus -> BPE -> Megatron indexed dataset -> GPTDataset."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset

from examples.gpt.data import Prepared, Tokenizer, load, prepare, tokenizer_beside

REPO = Path(__file__).resolve().parents[2]
VOCAB = 300
FILES = 30
SEQ = 32


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    return prepare(tmp_path_factory.mktemp("gpt-data"), vocab_size=VOCAB, max_files=FILES)


def _load(p: Prepared, seed: int = 7, num_samples: int = 64, model_vocab_size: int = VOCAB) -> GPTDataset:
    return load(p.prefix, p.tokenizer_path, SEQ, num_samples, seed, model_vocab_size)


def test_prepare_describes_what_it_built(prepared: Prepared) -> None:
    assert prepared.vocab_size == VOCAB
    assert prepared.documents == FILES
    assert prepared.tokens > prepared.documents * 10
    assert Path(f"{prepared.prefix}.bin").stat().st_size == 2 * prepared.tokens  # uint16
    assert prepared.tokenizer_path == tokenizer_beside(prepared.prefix)
    assert Tokenizer(prepared.tokenizer_path).eod == prepared.eod


def test_second_prepare_reuses_the_manifest(prepared: Prepared) -> None:
    out = Path(prepared.prefix).parent
    before = Path(f"{prepared.prefix}.bin").stat().st_mtime_ns
    started = time.monotonic()
    again = prepare(out, vocab_size=VOCAB, max_files=FILES)
    assert time.monotonic() - started < 2.0
    assert again == prepared
    assert Path(f"{prepared.prefix}.bin").stat().st_mtime_ns == before


def test_prepare_with_other_parameters_is_refused(prepared: Prepared) -> None:
    out = Path(prepared.prefix).parent
    with pytest.raises(ValueError, match="already holds a corpus prepared with"):
        prepare(out, vocab_size=VOCAB + 1, max_files=FILES)
    with pytest.raises(ValueError, match="below 257"):
        prepare(out / "small", vocab_size=200)


def _waiters(lock: Path) -> int:
    inode = f":{os.stat(lock).st_ino} "
    return sum(" -> FLOCK " in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def test_concurrent_prepare_builds_once(tmp_path: Path) -> None:
    # Hold the lock until both processes block on it, so they really do race for the build.
    lock = tmp_path / ".lock"
    cmd = [sys.executable, "-m", "examples.gpt.data", "--out", str(tmp_path), "--vocab-size", "280"]
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen([*cmd, "--max-files", "10"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(2)
        ]
        deadline = time.monotonic() + 60
        while _waiters(lock) < 2:
            assert time.monotonic() < deadline, "the two processes never reached the lock"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        fcntl.flock(handle, fcntl.LOCK_UN)
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    stdouts = [out.decode() for out, _ in results]
    stderrs = "".join(err.decode() for _, err in results)
    assert stdouts[0].split(", sha256")[0] == stdouts[1].split(", sha256")[0]
    assert stderrs.count(": built ") == 1 and stderrs.count(": reusing ") == 1, stderrs
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]
    p = prepare(tmp_path, vocab_size=280, max_files=10)
    ds = load(p.prefix, p.tokenizer_path, SEQ, 16, 0, 280)
    assert len(ds) >= 16 and ds[0]["tokens"].max() < 280


def test_samples_depend_only_on_data_seed_and_index(prepared: Prepared) -> None:
    a, b = _load(prepared, seed=7), _load(prepared, seed=7)
    other = _load(prepared, seed=8)
    fewer = _load(prepared, seed=7, num_samples=8)  # same single epoch, so the same order
    for i in range(8):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(a[i][key], b[i][key])
            assert torch.equal(a[i][key], fewer[i][key])
    assert any(not torch.equal(a[i]["tokens"], other[i]["tokens"]) for i in range(8))


def test_samples_are_shifted_windows_within_the_vocabulary(prepared: Prepared) -> None:
    ds = _load(prepared)
    assert len(ds) >= 64
    for i in range(len(ds)):
        s = ds[i]
        tokens, labels = s["tokens"], s["labels"]
        assert tokens.dtype == labels.dtype == torch.int64
        assert tokens.shape == labels.shape == (SEQ,)
        assert s["loss_mask"].dtype == torch.float32
        assert torch.equal(s["position_ids"], torch.arange(SEQ))
        assert torch.equal(labels[:-1], tokens[1:])
        assert 0 <= int(tokens.min()) and int(torch.maximum(tokens, labels).max()) < prepared.vocab_size
    assert "attention_mask" not in ds[0]


def test_load_builds_no_shared_cache_even_on_a_non_zero_rank(
    prepared: Prepared, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Megatron's own cache logic would have rank 1 read files only rank 0 writes; without the cache
    # rank 1 builds its indices itself, the same ones as a process outside torch.distributed.
    reference = _load(prepared)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    on_rank_1 = _load(prepared)
    assert all(torch.equal(reference[i]["tokens"], on_rank_1[i]["tokens"]) for i in range(8))
    data_dir = Path(prepared.prefix).parent
    assert not (data_dir / "stdlib").exists() and not (data_dir / "cache").exists()


def test_load_names_what_is_wrong(prepared: Prepared, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data path .*nowhere\.bin does not exist"):
        load(str(tmp_path / "nowhere"), prepared.tokenizer_path, SEQ, 8, 0, VOCAB)
    with pytest.raises(ValueError, match=r"tokenizer .*missing\.json does not exist"):
        load(prepared.prefix, str(tmp_path / "missing.json"), SEQ, 8, 0, VOCAB)
    with pytest.raises(ValueError, match=f"has {VOCAB} tokens, the model's vocab_size is {VOCAB - 1}"):
        _load(prepared, model_vocab_size=VOCAB - 1)


def test_decode_inverts_encode(prepared: Prepared) -> None:
    tok = Tokenizer(prepared.tokenizer_path)
    snippet = 'def greet(name: str) -> str:\n    """Say hello."""\n\treturn f"héllo, {name}! ✓"\n'
    ids = tok.encode(snippet)
    assert ids and max(ids) < tok.vocab_size and tok.eod not in ids
    assert tok.decode(ids) == snippet
    assert tok.decode([*ids, tok.eod]) == snippet + "<|endoftext|>"
