"""Cache entries that cannot serve the wrong data: named by their settings, checked against their files, built whole.

Each entry the suite derives from a user's files (token arrays, VAE latents, FID reference statistics) lives in a
folder named by everything that changes its content, with the files' absolute paths among it, so two ``corpus.txt``
in two projects never share one. The folder also records a ``fingerprint.json`` of the files it was built from; a
reused entry is checked against them (a fast look at sizes and modification times, the content's hash when those
changed or cannot be trusted) and rebuilt, with a one-line notice, when the files changed. An entry is built in a
private temporary folder and renamed into place in one step, so a crash or two runs building it at once never leave
a half-written entry that a later run would trust.

Written here because neither ``datasets`` (whose fingerprints cover its own Arrow tables, not a token array made by
another tokenizer) nor torch-fidelity (its cache is keyed by the name a caller gives) check a derived file against
its inputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

FINGERPRINT = "fingerprint.json"
# Modification times are stamped at the file system's clock tick, so a file written in the same tick as the entry's
# build may have changed without a later stamp (git's "racily clean" index entries); such files are hashed.
_RACY_NS = 2_000_000_000
_PUBLISH_TRIES = 5


def digest(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def entry_name(label: str, *parts: object) -> str:
    """``<label>-<hash of parts>``: readable in a listing, unique to its settings."""
    stem = Path(str(label)).name.replace("/", "_").replace(" ", "_") or "entry"
    return f"{stem}-{digest(*parts)}"


def file_stats(files: Sequence[Path]) -> list[list]:
    """(absolute path, size, modification time in ns) of each file, in the order given."""
    stats = []
    for file in files:
        st = file.stat()
        stats.append([str(file.resolve()), st.st_size, st.st_mtime_ns])
    return stats


def content_hash(files: Iterable[Path]) -> str:
    """SHA-256 over each file's absolute path and bytes, in the order given."""
    h = hashlib.sha256()
    for file in files:
        h.update(str(file.resolve()).encode() + b"\0")
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def write_fingerprint(folder: Path, files: Sequence[Path], content: str, built_ns: int) -> None:
    """Records what ``folder`` was built from: the files' stats, their content hash and when reading them began."""
    record = {"files": file_stats(files), "content": content, "built_ns": built_ns}
    tmp = folder / f".{FINGERPRINT}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / FINGERPRINT)


def is_current(folder: Path, files: Sequence[Path]) -> bool:
    """Whether ``folder`` was built from exactly these files as they are now.

    Unchanged stats of files written well before the build are trusted; otherwise the content decides, and an entry
    whose files were only touched (same bytes) gets their new stats, so the next check is quick again.
    """
    try:
        record = json.loads((folder / FINGERPRINT).read_text())
    except (OSError, ValueError):
        return False
    now = time.time_ns()
    stats = file_stats(files)
    trusted = stats == record["files"] and all(mtime < record["built_ns"] - _RACY_NS for *_, mtime in stats)
    if trusted:
        return True
    if content_hash(files) != record["content"]:
        return False
    write_fingerprint(folder, files, record["content"], now)
    return True


def build_entry(folder: Path, build: Callable[[Path], None], is_valid: Callable[[Path], bool]) -> Path:
    """Builds an entry into a private temporary folder with ``build(tmp)`` and publishes it as ``folder`` in one rename.

    Another process may publish the same entry meanwhile: a valid one (``is_valid``) is kept and this build
    discarded; a stale one is moved aside and replaced. The temporary folder is removed whatever happens.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        for _ in range(_PUBLISH_TRIES):
            try:
                os.rename(tmp, folder)  # atomic, and refused when folder exists and is not empty
                return folder
            except OSError:
                if folder.exists() and is_valid(folder):
                    return folder
            stale = folder.parent / f".{folder.name}.stale-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(folder, stale)
            except OSError:
                continue  # another process moved or replaced it first: look again
            shutil.rmtree(stale, ignore_errors=True)
        raise OSError(f"cache entry {folder}: could not be put in place (another process keeps replacing it, or the "
                      f"folder is not writable); remove it and run again.")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["FINGERPRINT", "build_entry", "content_hash", "digest", "entry_name", "file_stats", "is_current",
           "write_fingerprint"]
