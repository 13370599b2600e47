"""The corpora a language model trains on: a local text file or folder, a Hugging Face ``datasets`` dataset (hub id or
local folder / loader, streaming), or ``python-stdlib``: the source files of the running interpreter's standard library,
the embedded corpus that needs no download. Each is read as (name, content) documents in a fixed order.
"""
from __future__ import annotations

import glob
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from moh_lightning.data.cache import entry_name
from moh_lightning.errors import MissingDataError
from moh_lightning.serialization import checkpoint_type

STDLIB = "python-stdlib"
_FORMAT_VERSION = 2  # 2: entries named by absolute paths and tokenizer content


@checkpoint_type(also_as="moh_lightning.data.text.TextSource")
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

