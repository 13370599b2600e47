"""Packed token sequences for causal LM training, from local text and Hugging Face ``datasets`` mixed by ratio.

Every source is tokenised once into flat ``train.bin`` / ``val.bin`` token arrays under the cache folder
(documents joined by EOS) and read back as memory maps, so data loaders never re-tokenise. An entry is named by the
source's absolute paths, the tokenizer's content and the split settings, and checked against the files it was made
from each time it is reused (``moh_lightning.data.cache``): an edited file is tokenised again, and another folder's
``corpus.txt`` never reads this one's tokens. A source is a
local text file or folder, a ``datasets`` dataset (hub id or local folder / loader, streaming), or
``python-stdlib``: the source files of the running interpreter's standard library, the embedded corpus
that needs no download. Documents (files or rows) go to train or validation by a hash of their name, so
the split is stable across runs and machines; or a source holds out the last ``val_fraction`` of its tokens
as one contiguous block (the data module's ``split_by: tokens``), so a single file trains as it is. The
default (``auto``) splits by documents and falls back to tokens when that would leave the training or the
validation side without a document (one file, a handful of rows).

Tokeniser: any Hugging Face tokenizer by name or path, or ``byte`` (``moh_lightning.data.tokenizers``).
"""
from __future__ import annotations

import glob
import json
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from moh_lightning.data.cache import build_entry, content_hash, entry_name, is_current, write_fingerprint
from moh_lightning.data.loaders import train_loader
from moh_lightning.data.tokenizers import BYTE_TOKENIZER, encode, load_tokenizer, token_dtype, tokenizer_identity
from moh_lightning.errors import BadValueError, MissingDataError
from moh_lightning.serialization import checkpoint_type

STDLIB = "python-stdlib"
_FORMAT_VERSION = 2  # 2: entries named by absolute paths and tokenizer content
SPLIT_RULES = ("auto", "documents", "tokens")
SplitRule = Literal["auto", "documents", "tokens"]


@checkpoint_type
@dataclass
class TextSource:
    """One corpus of the training mixture.

    Give ``path`` (a text file, a folder searched recursively for ``pattern``, or ``python-stdlib``) or
    ``dataset`` (a ``datasets.load_dataset`` name: hub id, local folder, or loader such as ``json`` with
    ``data_files``). ``weight`` is the source's sampling ratio (normalised over the mixture);
    ``val_fraction`` of its documents are held out for validation, or of its tokens: see ``TextDataModule``'s
    ``split_by``.
    """

    path: str | None = None
    pattern: str = "*.txt"
    dataset: str | None = None
    dataset_config: str | None = None
    data_files: str | list[str] | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True
    max_documents: int | None = None
    weight: float = 1.0
    val_fraction: float = 0.02

    def __post_init__(self) -> None:
        if (self.path is None) == (self.dataset is None):
            raise ValueError(f"data source {self}: give exactly one of path (file, folder or {STDLIB!r}) "
                             f"or dataset (a datasets.load_dataset name).")
        if self.weight <= 0:
            raise ValueError(f"data source {self.path or self.dataset}: weight={self.weight} must be > 0.")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data source {self.path or self.dataset}: val_fraction={self.val_fraction} "
                             f"must be in [0, 1).")

    @property
    def label(self) -> str:
        return self.path or self.dataset

    def cache_key(self, tokenizer: str, split_by: str = "auto") -> str:
        """Names the token arrays: everything that changes them, nothing (like weight) that does not.

        ``tokenizer`` is the tokenizer's identity (``tokenizer_identity``); paths count as absolute paths, so the
        same file name in two folders makes two entries.
        """
        spec = {k: v for k, v in asdict(self).items() if k != "weight"}
        if self.path is not None and self.path != STDLIB:
            spec["path"] = str(Path(self.path).expanduser().resolve())
        if self.dataset is not None and Path(self.dataset).expanduser().exists():
            spec["dataset"] = str(Path(self.dataset).expanduser().resolve())
        if self.data_files is not None:
            spec["data_files"] = [str(p) for p in self._data_files()] or self.data_files
        return entry_name(self.label, {"source": spec, "split_by": split_by, "tokenizer": tokenizer,
                                       "version": _FORMAT_VERSION,
                                       "python": sys.version_info[:2] if self.path == STDLIB else None})

    def local_files(self) -> list[Path]:
        """The files on this machine the tokens are made from, in reading order (none for a hub dataset)."""
        if self.path is not None:
            return _source_files(self)[1]
        files = list(self._data_files())
        folder = Path(self.dataset).expanduser()
        if folder.is_dir():
            files += sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts)
        return files

    def _data_files(self) -> list[Path]:
        """``data_files`` that name local files (globs expanded), absolute and sorted."""
        patterns = [self.data_files] if isinstance(self.data_files, str) else list(self.data_files or [])
        found = {Path(p).resolve() for pattern in patterns for p in glob.glob(str(Path(pattern).expanduser()),
                                                                               recursive=True) if Path(p).is_file()}
        return sorted(found)

    def documents(self) -> Iterator[tuple[str, bytes | str]]:
        """(name, content) of every document, in a fixed order."""
        if self.path is not None:
            yield from _file_documents(self)
            return
        import datasets

        data = datasets.load_dataset(self.dataset, self.dataset_config, split=self.split,
                                     streaming=self.streaming, data_files=self.data_files)
        for index, row in enumerate(data):
            if self.max_documents is not None and index >= self.max_documents:
                return
            if self.text_field not in row:
                raise KeyError(f"dataset {self.dataset}: rows have no text_field {self.text_field!r} "
                               f"(fields: {sorted(row)}); set text_field.")
            yield str(index), row[self.text_field]


def _source_files(source: TextSource) -> tuple[Path, list[Path]]:
    """The root folder and the files of a ``path`` source, in reading order (``max_documents`` of them at most)."""
    if source.path == STDLIB:
        root, pattern = Path(sysconfig.get_paths()["stdlib"]), "*.py"
    else:
        root, pattern = Path(source.path).expanduser(), source.pattern
    if root.is_file():
        files, root = [root], root.parent
    elif root.is_dir():
        files = sorted(p for p in root.rglob(pattern)
                       if p.is_file() and not {"site-packages", "dist-packages"} & set(p.parts))
    else:
        raise MissingDataError(f"data source path {source.path!r}: no such file or folder; point it at a text file, "
                                f"a folder of them, or {STDLIB!r}.")
    if not files:
        raise MissingDataError(f"data source path {source.path!r}: no files match pattern {pattern!r} in that "
                                f"folder or below; add text files or set the source's pattern (e.g. '*.md').")
    return root, files[:source.max_documents]


def _file_documents(source: TextSource) -> Iterator[tuple[str, bytes]]:
    root, files = _source_files(source)
    for file in files:
        yield file.relative_to(root).as_posix(), file.read_bytes()


def is_validation(name: str, val_fraction: float) -> bool:
    """Stable train / validation assignment of a document by a hash of its name."""
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


def tokenize_source(source: TextSource, tokenizer_name: str, cache_dir: Path, key: str = "tokenizer",
                    split_by: SplitRule = "auto", tokenizer=None) -> Path:
    """The cache folder of ``source``'s ``train.bin`` / ``val.bin`` / ``meta.json``, written when missing or stale.

    ``split_by``: ``documents`` holds out ``val_fraction`` of the documents (by a hash of their names), ``tokens`` the
    last ``val_fraction`` of the source's tokens as one contiguous block, ``auto`` by documents unless that leaves the
    training or the validation side without a document (a single file), then by tokens. ``tokenizer`` is the loaded
    ``tokenizer_name`` when the caller has it.
    """
    if split_by not in SPLIT_RULES:
        raise ValueError(f"split_by={split_by!r}: choose one of {', '.join(SPLIT_RULES)}.")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_name, key)
    folder = cache_dir / source.cache_key(tokenizer_identity(tokenizer_name, tokenizer), split_by)
    files = source.local_files()

    def current(entry: Path) -> bool:
        return (entry / "meta.json").is_file() and is_current(entry, files)

    if folder.exists():
        if current(folder):
            return folder
        rank_zero_info(f"moh: {source.label} changed since it was tokenised into {folder}: tokenising it again.")
    return build_entry(folder, lambda tmp: _write_tokens(source, tokenizer_name, tokenizer, split_by, files, tmp),
                       current)


def _write_tokens(source: TextSource, tokenizer_name: str, tokenizer, split_by: SplitRule, files: list[Path],
                  folder: Path) -> None:
    """Tokenises ``source`` into ``folder``: the token arrays, ``meta.json`` and the files' fingerprint."""
    built_ns = time.time_ns()  # before reading: a file changed while it is read counts as changed afterwards
    content = content_hash(files)
    dtype = token_dtype(len(tokenizer))
    counts = {"train": 0, "val": 0}
    documents = {"train": 0, "val": 0}
    num_bytes = 0
    by_documents = split_by != "tokens"
    with open(folder / "train.bin", "wb") as train, open(folder / "val.bin", "wb") as val:
        for name, text in source.documents():
            split = "val" if by_documents and is_validation(name, source.val_fraction) else "train"
            ids = encode(tokenizer, tokenizer_name, text).astype(dtype)
            (val if split == "val" else train).write(ids.tobytes())
            counts[split] += len(ids)
            documents[split] += 1
            num_bytes += len(text) if isinstance(text, bytes) else len(text.encode("utf-8"))
    if sum(counts.values()) == sum(documents.values()):  # nothing but the EOS after each document
        found = f"its {sum(documents.values())} documents are empty" if any(documents.values()) else "no documents"
        raise BadValueError(f"data source {source.label!r}: {found}; give it some text or remove it from the sources.")
    used = "documents"
    one_side_empty = source.val_fraction > 0 and 0 in documents.values()
    if split_by == "tokens" or (split_by == "auto" and one_side_empty):
        # Every token is in one of the two files, in document order; hold out the last val_fraction of them.
        used = "tokens"
        full = "train" if documents["train"] else "val"
        tokens = np.fromfile(folder / f"{full}.bin", dtype=dtype)
        num_val = int(np.ceil(len(tokens) * source.val_fraction))
        tokens[:len(tokens) - num_val].tofile(folder / "train.bin")
        tokens[len(tokens) - num_val:].tofile(folder / "val.bin")
        counts = {"train": len(tokens) - num_val, "val": num_val}
    write_fingerprint(folder, files, content, built_ns)
    meta = {"dtype": dtype.name, "tokens": counts, "documents": documents, "bytes": num_bytes, "split_by": used,
            "tokenizer": tokenizer_name, "vocab_size": len(tokenizer), "source": asdict(source),
            "files": [str(f.resolve()) for f in files]}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def describe(source: TextSource, folder: Path) -> str:
    """One line naming what a run trains on: the files, their bytes, the tokens and the cache entry."""
    meta = json.loads((folder / "meta.json").read_text())
    files, rows = meta["files"], sum(meta["documents"].values())
    where = files[0] if len(files) == 1 else f"{len(files):,} files" if files else f"{rows:,} rows"
    return (f"moh: data {source.label} ({where}, {meta['bytes']:,} bytes): {meta['tokens']['train']:,} training + "
            f"{meta['tokens']['val']:,} validation tokens, cache {folder}")


def _split(folder: Path) -> str:
    """How a source's documents were split, for error messages."""
    meta = json.loads((folder / "meta.json").read_text())
    documents, fraction = meta["documents"], meta["source"]["val_fraction"]
    if meta.get("split_by") == "tokens":
        return (f" (split by tokens: {meta['tokens']['train']} train, {meta['tokens']['val']} validation at "
                f"val_fraction={fraction})")
    return f" (documents: {documents['train']} train, {documents['val']} validation at val_fraction={fraction})"


def open_tokens(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    if meta["tokens"][split] == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r")


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


class TextDataModule(LightningDataModule):
    """Packed next-token sequences from a weighted mixture of text sources.

    Args:
        sources: The corpora and their sampling weights; the Python standard library when None.
        tokenizer: ``byte`` or a Hugging Face tokenizer name / folder.
        seq_len: Tokens per training sequence (each sample holds ``seq_len + 1`` for the shifted target).
        batch_size: Sequences per micro-batch (the token batch is reached with the Trainer's
            ``accumulate_grad_batches``).
        num_workers: DataLoader workers.
        cache_dir: Where token arrays are written; ``~/.cache/moh_lightning/text`` when None.
        samples_per_epoch: Training windows per epoch; every source's chunk count summed when None.
        val_samples: Validation windows, spread evenly over the held-out documents; all when None.
        seed: Seed of the mixture draw.
        split_by: How every source holds out its ``val_fraction``: ``documents`` (whole files or rows, by a hash of
            their names), ``tokens`` (the last ``val_fraction`` of the source's tokens, one contiguous block, so no
            window straddles training and validation), or ``auto``: by documents unless that leaves the training or
            the validation side of a source without a document (a single text file), then by tokens.
        predict_prompts: A text file of prompts, one a line, that ``moh predict`` continues (one at a time, as
            prompts differ in length); the sources are not read then.
    """

    def __init__(
            self,
            sources: list[TextSource] | None = None,
            tokenizer: str = BYTE_TOKENIZER,
            seq_len: int = 2048,
            batch_size: int = 8,
            num_workers: int = 0,
            cache_dir: str | None = None,
            samples_per_epoch: int | None = None,
            val_samples: int | None = 512,
            seed: int = 0,
            split_by: SplitRule = "auto",
            predict_prompts: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if split_by not in SPLIT_RULES:
            raise ValueError(f"data.init_args.split_by={split_by!r}: choose one of {', '.join(SPLIT_RULES)}.")
        self.split_by = split_by
        self.sources = list(sources) if sources else [TextSource(path=STDLIB, pattern="*.py")]
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache/moh_lightning/text"
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._tokenizer = None
        self._folders: list[Path] | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.hparams.tokenizer, key="data.init_args.tokenizer")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The tokenizer's size; linked into ``model.init_args.arch.vocab_size`` by ``moh``.

        When the tokenizer cannot be loaded there is no such attribute (``AttributeError``), so the link keeps
        the config's value and ``prepare_data`` stops with the tokenizer's one-line message.
        """
        try:
            return len(self.tokenizer)
        except OSError as error:
            raise AttributeError(f"vocab_size: {error}") from None

    @property
    def is_byte_level(self) -> bool:
        """Every token but EOS is one UTF-8 byte, so nats per token convert directly to bits per byte."""
        return self.hparams.tokenizer == BYTE_TOKENIZER

    def prepare_data(self) -> None:
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.PREDICTING:
            return  # the prompts alone: the corpus need not be on this machine
        self._folders = self._tokenize()

    def _tokenize(self) -> list[Path]:
        return [tokenize_source(s, self.hparams.tokenizer, self.cache_dir, key="data.init_args.tokenizer",
                                split_by=self.split_by, tokenizer=self.tokenizer) for s in self.sources]

    def setup(self, stage: str) -> None:
        if stage == "predict":  # the prompts alone
            return
        # In one process prepare_data has just checked the entries; other ranks check them here.
        folders = self._folders or self._tokenize()
        for source, folder in zip(self.sources, folders, strict=True):
            rank_zero_info(describe(source, folder))
        seq_len = self.hparams.seq_len
        train = [open_tokens(f, "train") for f in folders]
        for source, folder, tokens in zip(self.sources, folders, train, strict=True):
            if len(tokens) <= seq_len:
                raise BadValueError(f"data source {source.label!r}: its training split has {len(tokens)} tokens, fewer "
                                 f"than one sequence of data.init_args.seq_len + 1 = {seq_len + 1}{_split(folder)}; "
                                 f"add text, lower seq_len, or remove the source.")
        num_samples = self.hparams.samples_per_epoch or max(1, sum((len(a) - 1) // seq_len for a in train))
        self.train_set = MixtureSequences(train, [s.weight for s in self.sources], seq_len, num_samples,
                                          self.hparams.seed)
        self.val_set = EvenChunks([open_tokens(f, "val") for f in folders], seq_len, self.hparams.val_samples)
        if len(self.val_set) == 0:
            held_out = ", ".join(f"{s.label!r} holds out {len(open_tokens(f, 'val'))} tokens{_split(f)}"
                                 for s, f in zip(self.sources, folders, strict=True))
            raise BadValueError(f"no validation sequence of data.init_args.seq_len + 1 = {seq_len + 1} tokens: "
                             f"{held_out}; raise a source's val_fraction, add documents, or lower seq_len.")

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers)

    def predict_problem(self) -> str | None:
        """Why ``moh predict`` cannot run with these settings, in one line; None when it can."""
        prompts = self.hparams.predict_prompts
        if prompts is None:
            return ("no prompts to continue: pass --data.init_args.predict_prompts <file> (a text file, one prompt a "
                    "line).")
        path = Path(prompts).expanduser()
        if not path.is_file():
            return f"data.init_args.predict_prompts={prompts!r}: no such file; give a text file, one prompt a line."
        if not path.read_text(encoding="utf-8").strip():
            return f"data.init_args.predict_prompts={prompts!r}: no prompt in it; write one prompt a line."
        return None

    def predict_dataloader(self) -> DataLoader:
        problem = self.predict_problem()
        if problem:
            raise ValueError(problem)
        prompts = Prompts(Path(self.hparams.predict_prompts).expanduser(), self.tokenizer)
        return DataLoader(prompts, batch_size=1, num_workers=self.hparams.num_workers)


__all__ = ["STDLIB", "EvenChunks", "MixtureSequences", "Prompts", "TextDataModule", "TextSource", "describe",
           "is_validation", "tokenize_source"]
