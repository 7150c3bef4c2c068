"""The fortunes corpus (Debian package `fortunes`) as a character-level dataset.

Fortunes are read from the text files of FORTUNES_DIR (the .dat index files
and the .u8 symlinks are skipped) and split on lines holding a single `%`.
Train/validation are split *by fortune* with a fixed seed, then each side is
joined back with "%\n" separators, as in the original files.
"""
from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import dataclass

import torch

# MUOND_FORTUNES_DIR: a copy elsewhere (the GPU bundle carries one in data/fortunes).
FORTUNES_DIR = os.environ.get("MUOND_FORTUNES_DIR", "/usr/share/games/fortunes")


def read_fortunes(directory: str = FORTUNES_DIR) -> list[str]:
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{directory} not found: install Debian's 'fortunes' package (deploy/setup.sh does)")
    fortunes = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            current: list[str] = []
            for line in f:
                if line.rstrip("\n") == "%":
                    if current:
                        fortunes.append("".join(current))
                    current = []
                else:
                    current.append(line)
            if current:
                fortunes.append("".join(current))
    fortunes = [t for t in fortunes if t.strip()]
    if not fortunes:
        raise ValueError(f"no fortunes found in {directory}")
    return fortunes


@dataclass
class Corpus:
    chars: list[str]          # vocabulary, index = token id
    train: torch.Tensor       # int64 token ids
    val: torch.Tensor
    num_train_fortunes: int
    num_val_fortunes: int

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text if c in index]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def unigram_baseline(self) -> float:
        """Cross-entropy (nats/char) of the validation text under the train
        unigram distribution (add-one smoothed): what a model that ignores
        context achieves."""
        counts = torch.bincount(self.train, minlength=self.vocab_size).double() + 1.0
        logp = torch.log(counts / counts.sum())
        return float(-logp[self.val].mean())


def load_corpus(val_fraction: float = 0.1, seed: int = 1234,
                directory: str = FORTUNES_DIR) -> Corpus:
    fortunes = read_fortunes(directory)
    order = list(range(len(fortunes)))
    random.Random(seed).shuffle(order)
    num_val = max(1, int(len(fortunes) * val_fraction))
    val_set = set(order[:num_val])
    train_text = "".join(t + "%\n" for i, t in enumerate(fortunes) if i not in val_set)
    val_text = "".join(t + "%\n" for i, t in enumerate(fortunes) if i in val_set)
    chars = sorted(Counter(train_text + val_text))
    index = {c: i for i, c in enumerate(chars)}
    to_tensor = lambda s: torch.tensor([index[c] for c in s], dtype=torch.int64)
    return Corpus(chars, to_tensor(train_text), to_tensor(val_text),
                  len(fortunes) - num_val, num_val)


def batch_at(data: torch.Tensor, starts: torch.Tensor, context: int):
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def sample_starts(generator: torch.Generator, data_len: int, batch: int, context: int):
    return torch.randint(0, data_len - context - 1, (batch,), generator=generator)
