"""The datasets behind the text data module: training windows drawn from the mixture, validation windows spread over
the held-out tokens, and prompts to continue."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from moh_lightning.errors import BadValueError


class MixtureSequences(Dataset):
    """``num_samples`` windows of ``seq_len + 1`` tokens, each from a source drawn with the mixture weights.

    Within a source the windows are its non-overlapping chunks in a seeded random order, taken in turn (and
    cycled once exhausted), so a source is seen evenly before any chunk repeats.
    """

    def __init__(self, arrays: list[np.ndarray], weights: list[float], seq_len: int, num_samples: int,
                 seed: int = 0) -> None:
        self.arrays, self.seq_len = arrays, seq_len
        chunks = [(len(a) - 1) // seq_len for a in arrays]
        usable = [i for i, n in enumerate(chunks) if n > 0]
        if not usable:
            raise BadValueError(f"no training source has more than seq_len={seq_len} tokens: lower seq_len.")
        probs = np.array([weights[i] if chunks[i] > 0 else 0.0 for i in range(len(arrays))])
        rng = np.random.default_rng(seed)
        self.source = rng.choice(len(arrays), size=num_samples, p=probs / probs.sum())
        self.chunk = np.zeros(num_samples, dtype=np.int64)
        for i in usable:
            where = np.flatnonzero(self.source == i)
            order = rng.permutation(chunks[i])
            self.chunk[where] = order[np.arange(len(where)) % chunks[i]]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source = int(self.source[index])
        start = int(self.chunk[index]) * self.seq_len
        window = np.asarray(self.arrays[source][start:start + self.seq_len + 1], dtype=np.int64)
        return {"tokens": torch.from_numpy(window), "source": torch.tensor(source)}


class EvenChunks(Dataset):
    """Non-overlapping windows of every source's validation tokens, thinned evenly to ``max_samples``."""

    def __init__(self, arrays: list[np.ndarray], seq_len: int, max_samples: int | None = None) -> None:
        self.arrays, self.seq_len = arrays, seq_len
        self.items = [(s, c) for s, a in enumerate(arrays) for c in range((len(a) - 1) // seq_len)]
        if max_samples is not None and len(self.items) > max_samples:
            keep = np.linspace(0, len(self.items) - 1, max_samples).round().astype(int)
            self.items = [self.items[i] for i in keep]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source, chunk = self.items[index]
        start = chunk * self.seq_len
        window = np.asarray(self.arrays[source][start:start + self.seq_len + 1], dtype=np.int64)
        return {"tokens": torch.from_numpy(window), "source": torch.tensor(source)}


class Prompts(Dataset):
    """Prompts to continue (``moh predict``): the lines of ``source`` that hold text, each as its token ids (encoded
    as ``moh generate`` encodes a prompt) and its index; ``items`` holds the prompts' text."""

    def __init__(self, source: Path, tokenizer) -> None:
        self.source = source
        self.items = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
        self.ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.tensor(self.ids[index]), "index": torch.tensor(index)}

