"""Real text for the GPT example: the Python standard library, BPE-tokenized into a Megatron dataset.

CPython's own ``.py`` sources lie on every machine that runs Unicron, so the example trains on real
text with nothing to download. ``prepare`` builds the corpus once per directory (safe when several
ranks race to build it), ``load`` wraps it in Megatron-Core's ``GPTDataset``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import Split
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

log = logging.getLogger("examples.gpt.data")

EOD_TOKEN = "<|endoftext|>"
PREFIX = "stdlib"
# 400 files (sorted paths) are about 6 MB of source and 3M tokens at vocab 512: far more than a tiny
# GPT sees in a demo, yet the whole preparation stays around 5-10 s on two cores.
DEFAULT_MAX_FILES = 400
# Tests are a large share of the stdlib and much of it is data, not code; encodings/ is mechanical
# codec tables whose hex literals would crowd the BPE merges.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"})
_FORMAT = 1
_MIN_VOCAB = 257  # the 256 byte-level symbols plus EOD: a smaller BPE vocabulary cannot exist


@dataclass(frozen=True)
class Prepared:
    prefix: str  # the .bin/.idx path without its suffix, as Megatron names datasets
    tokenizer_path: str
    vocab_size: int  # the trained tokenizer's real size, which may differ from the one asked for
    eod: int
    documents: int
    tokens: int
    sha256: str  # of the .bin: ranks on machines without a shared disk can compare their data


class Tokenizer:
    """The saved BPE tokenizer, for turning prompts into ids and generated ids back into text."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._tok = _HFTokenizer.from_file(self.path)
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"tokenizer {self.path} has no {EOD_TOKEN} token")
        self.eod: int = eod
        self.vocab_size: int = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        # EOD stays visible so that a generated document boundary shows in the printed text.
        return str(self._tok.decode(ids, skip_special_tokens=False))


class _MegatronTokenizer:
    """Exactly what GPTDataset reads from ``config.tokenizer``, and picklable for loader workers.

    ``vocab_size`` picks the token dtype, ``eod`` the loss/position masks, ``pad`` what padding is
    masked, ``unique_identifiers`` goes into the dataset's description.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        # The vocabulary has no pad token; -1 is Megatron's own never-a-real-id sentinel, so padding
        # (only ever at the very end of the data) gets loss_mask 0 and never aliases EOD.
        self.pad = -1
        self.unique_identifiers = {"class": "BPETokenizer", "tokenizer_path": tokenizer.path}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # flock, not a create-exclusive marker file: the kernel drops it when its holder dies, so a
    # rank killed mid-build never leaves the others waiting on a stale lock.
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _corpus(max_files: int | None) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        (p for p in root.rglob("*.py") if _SKIP_DIRS.isdisjoint(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    texts: list[str] = []
    for path in paths:
        if max_files is not None and len(texts) >= max_files:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a handful of stdlib files are deliberately not UTF-8
        if text.strip():  # empty __init__.py files would only be lone EOD documents
            texts.append(text)
    if not texts:
        raise ValueError(f"no Python source found under {root}")
    return texts


def _build(out: Path, params: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    texts = _corpus(params["max_files"])
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=params["vocab_size"],
        special_tokens=[EOD_TOKEN],
        # The full byte alphabet, so any text (generated prompts included) encodes without unknowns.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    vocab_size, eod = tok.get_vocab_size(), tok.token_to_id(EOD_TOKEN)
    dtype = numpy.uint16 if vocab_size < 65500 else numpy.int32

    # Temp names then os.replace: a reader never sees a half-written file under a final name.
    tmp = f".tmp{os.getpid()}"
    names = {"tokenizer": "tokenizer.json", "bin": f"{PREFIX}.bin", "idx": f"{PREFIX}.idx"}
    tok.save(str(out / (names["tokenizer"] + tmp)))
    builder = IndexedDatasetBuilder(str(out / (names["bin"] + tmp)), dtype=dtype)
    tokens = 0
    for encoding in tok.encode_batch(texts):
        ids = [*encoding.ids, eod]
        builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
        tokens += len(ids)
    builder.finalize(str(out / (names["idx"] + tmp)))
    sha = {name: _sha256(out / (name + tmp)) for name in names.values()}
    for name in names.values():
        os.replace(out / (name + tmp), out / name)

    manifest = {
        "params": params,
        "vocab_size": vocab_size,
        "eod": eod,
        "documents": len(texts),
        "tokens": tokens,
        "dtype": numpy.dtype(dtype).name,
        "sha256": sha,
        "source": {"stdlib": sysconfig.get_paths()["stdlib"], "python": platform.python_version()},
    }
    # The manifest is written last: its presence is what marks the preparation finished.
    (out / ("manifest.json" + tmp)).write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(out / ("manifest.json" + tmp), out / "manifest.json")
    log.info("built %s: %d documents, %d tokens in %.1fs", out / PREFIX, len(texts), tokens, time.monotonic() - started)
    return manifest


def _read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # absent, or torn by a crash: either way the build is not known to be finished
    return manifest


def _intact(out: Path, manifest: dict[str, Any]) -> bool:
    try:
        return all(_sha256(out / name) == digest for name, digest in manifest["sha256"].items())
    except OSError:
        return False


def prepare(out_dir: str | Path, vocab_size: int = 512, max_files: int | None = DEFAULT_MAX_FILES) -> Prepared:
    """Builds the corpus in ``out_dir`` unless a finished build with these parameters is there.

    Several processes may call this on one directory at once: one builds, the others wait and reuse.
    A finished build with *other* parameters raises ValueError rather than being rebuilt, because
    ranks still training on it would have their data replaced underneath them; use another dir.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is below {_MIN_VOCAB} (256 byte symbols plus {EOD_TOKEN})")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be positive or None, not {max_files}")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    params = {"format": _FORMAT, "vocab_size": vocab_size, "max_files": max_files}
    with _locked(out / ".lock"):
        manifest = _read_manifest(out)
        if manifest is not None and manifest.get("params") != params:
            raise ValueError(
                f"{out} already holds a corpus prepared with {manifest.get('params')}, not {params}: "
                "prepare into another directory or delete this one"
            )
        if manifest is not None and _intact(out, manifest):
            log.info("reusing %s: %d documents, %d tokens", out / PREFIX, manifest["documents"], manifest["tokens"])
        else:
            if manifest is not None:
                log.warning("%s does not match its manifest; rebuilding it", out)
            manifest = _build(out, params)
    return Prepared(
        prefix=str(out / PREFIX),
        tokenizer_path=tokenizer_beside(str(out / PREFIX)),
        vocab_size=manifest["vocab_size"],
        eod=manifest["eod"],
        documents=manifest["documents"],
        tokens=manifest["tokens"],
        sha256=manifest["sha256"][f"{PREFIX}.bin"],
    )


def tokenizer_beside(prefix: str) -> str:
    """Where ``prepare`` saves the tokenizer of the data at ``prefix``."""
    return str(Path(prefix).parent / "tokenizer.json")


class _DropNoCacheWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to save" not in record.getMessage()


def load(
    prefix: str, tokenizer_path: str, seq_length: int, num_samples: int, seed: int, model_vocab_size: int
) -> GPTDataset:
    """All documents of ``prefix`` as one shuffled training split; sample i depends only on
    (data, seed, seq_length, i) while num_samples stays within the same number of epochs."""
    for path in (f"{prefix}.bin", f"{prefix}.idx"):
        if not os.path.isfile(path):
            raise ValueError(f"data path {path} does not exist (run examples.gpt.data.prepare first)")
    if not os.path.isfile(tokenizer_path):
        raise ValueError(f"tokenizer {tokenizer_path} does not exist")
    if seq_length < 1 or num_samples < 1:
        raise ValueError(f"seq_length ({seq_length}) and num_samples ({num_samples}) must be positive")
    tokenizer = Tokenizer(tokenizer_path)
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens, the model's vocab_size is "
            f"{model_vocab_size}: every token id needs an embedding row"
        )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="1,0,0",
        # "" (not None, which Megatron replaces by <prefix>/cache) turns the index cache off. Its
        # cache is written non-atomically and, under torch.distributed, only by rank 0 with no
        # barrier of its own, so another rank can read a missing or half-written file; and ranks
        # here come and go with every reform. The indices take milliseconds to build at this size,
        # so every process builds its own, identically, from the seed.
        path_to_cache="",
        tokenizer=_MegatronTokenizer(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    indexed = GPTDataset.build_low_level_dataset(prefix, config)
    documents = GPTDataset.numel_low_level_dataset(indexed)
    if documents == 0:
        raise ValueError(f"data path {prefix} holds no documents")
    largest = int(numpy.memmap(f"{prefix}.bin", dtype=indexed.index.dtype, mode="r").max())
    if largest >= model_vocab_size:
        raise ValueError(f"data {prefix} holds token id {largest}, the model's vocab_size is {model_vocab_size}")
    quiet = _DropNoCacheWarning()
    megatron_log = logging.getLogger("megatron.core.datasets.gpt_dataset")
    megatron_log.addFilter(quiet)  # the no-cache warning is the choice made above, not a fault
    try:
        return GPTDataset(indexed, prefix, numpy.arange(documents, dtype=numpy.int32), num_samples, Split.train, config)
    finally:
        megatron_log.removeFilter(quiet)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="directory to prepare (or reuse) the corpus in")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-files", type=int, default=DEFAULT_MAX_FILES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    started = time.monotonic()
    try:
        p = prepare(args.out, vocab_size=args.vocab_size, max_files=args.max_files)
    except ValueError as e:
        parser.error(str(e))
    print(
        f"{p.prefix}: {p.documents} documents, {p.tokens} tokens, vocab {p.vocab_size} (eod {p.eod}), "
        f"tokenizer {p.tokenizer_path}, sha256 {p.sha256[:12]}, {time.monotonic() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
