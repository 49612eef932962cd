"""Tokenizers for ``phalanx data prepare``: byte-level (no files), a Hugging Face ``tokenizer.json``, or a
byte-level BPE trained on the input with the ``tokenizers`` library (fully offline)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class Tokenizer:
    """Encodes documents to token ids; ``meta`` is what the dataset index records to load it again."""

    vocab_size: int
    eos_id: int
    meta: dict[str, Any]
    _hf: Any = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self._hf is None:  # byte-level: the UTF-8 bytes are the ids
            return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self._hf.encode_batch(texts, add_special_tokens=False)]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(vocab_size=257, eos_id=256, meta={"kind": "byte"})


def hf_tokenizer(path: Path, eos_token: str | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as HF

    try:
        hf = HF.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        raise ValueError(f"--tokenizer {path}: not a readable Hugging Face tokenizer.json ({e})") from None
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    eos = next((t for t in candidates if t and hf.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(
            f"--tokenizer {path}: no end-of-document token found (tried {', '.join(candidates)}); "
            "name it with --eos-token"
        )
    return Tokenizer(hf.get_vocab_size(), hf.token_to_id(eos), {"kind": "hf", "file": TOKENIZER_FILE, "eos": eos}, hf)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` and saved to ``out`` (so the dataset carries its tokenizer)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    hf.save(str(out))
    return hf_tokenizer(out, "<|endoftext|>")


def resolve_tokenizer(spec: str, out_dir: Path, corpus: Iterable[str], eos_token: str | None) -> Tokenizer:
    """``byte`` | ``bpe:VOCAB`` | a path to a tokenizer.json; a file-based one is copied into the dataset."""
    if spec == "byte":
        return byte_tokenizer()
    target = out_dir / TOKENIZER_FILE
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec.removeprefix("bpe:"))
        except ValueError:
            vocab = 0
        if vocab < 260:
            raise ValueError(f"--tokenizer {spec}: give the vocabulary size to train, e.g. bpe:8192 (at least 260)")
        if target.exists():  # trained by an interrupted run of this same prepare: keep it, ids must not change
            return hf_tokenizer(target, "<|endoftext|>")
        return train_bpe(corpus, vocab, target)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--tokenizer {spec}: valid values are byte, bpe:VOCAB, or a path to a tokenizer.json file")
    if path.resolve() != target.resolve():
        shutil.copyfile(path, target)
    return hf_tokenizer(target, eos_token)


def load_tokenizer(meta: dict[str, Any], dataset_dir: Path) -> Tokenizer:
    if meta["kind"] == "byte":
        return byte_tokenizer()
    return hf_tokenizer(dataset_dir / meta["file"], meta["eos"])
