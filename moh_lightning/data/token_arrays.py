"""A text source tokenised once into flat ``train.bin`` / ``val.bin`` token arrays, read back as memory maps.

Documents are joined by EOS, so data loaders never re-tokenise. An entry is named by the source's absolute paths, the
tokenizer's content and the split settings, and checked against the files it was made from each time it is reused
(``moh_lightning.data.cache``): an edited file is tokenised again, and another folder's ``corpus.txt`` never reads this
one's tokens. Documents (files or rows) go to train or validation by a hash of their name, so the split is stable
across runs and machines; or a source holds out the last ``val_fraction`` of its tokens as one contiguous block
(``split_by: tokens``), so a single file trains as it is. The default (``auto``) splits by documents and falls back to
tokens when that would leave the training or the validation side without a document (one file, a handful of rows).
"""
from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from moh_lightning.data.cache import build_entry, content_hash, is_current, write_fingerprint
from moh_lightning.data.text_sources import TextSource
from moh_lightning.data.tokenizers import encode, load_tokenizer, token_dtype, tokenizer_identity
from moh_lightning.errors import BadValueError

SPLIT_RULES = ("auto", "documents", "tokens")
SplitRule = Literal["auto", "documents", "tokens"]


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
    # a run's saved config holds absolute paths (so it reads them from any folder): the path is then said once
    where = "" if where == source.label else f"{where}, "
    return (f"moh: data {source.label} ({where}{meta['bytes']:,} bytes): {meta['tokens']['train']:,} training + "
            f"{meta['tokens']['val']:,} validation tokens, cache {folder}")


def how_split(folder: Path) -> str:
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

