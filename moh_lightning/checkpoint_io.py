"""Checkpoint writing that never leaves a truncated file where a good checkpoint was, and reading that runs no code."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from moh_lightning.serialization import load_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that replaces a checkpoint only once the new one is completely on disk.

    Each checkpoint is written to a hidden temporary file in its destination folder, flushed and fsynced, then
    renamed over the destination with ``os.replace`` (atomic on POSIX), so a crash or kill at any moment leaves
    the previous checkpoint or the new one, never a half-written file. Lightning's default stages the file in
    the system temp folder and moves it, which is a plain copy (not atomic) when the run folder is on another
    filesystem, as on clusters. Remote paths (``s3://``, ...) keep Lightning's behaviour.

    A write that runs out of space removes its temporary file and stops the run in one line naming the folder, the
    checkpoint's size and the free space there; the previous checkpoint is untouched, since it is only replaced once
    the new one is completely written. Out of space means an ``ENOSPC`` / ``EDQUOT`` (quota) error, or any write error
    after which the folder has less room than the checkpoint takes: torch's zip writer reports a full disk as
    ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos ...``, not as ``OSError``.

    Resuming, validating or testing from a local checkpoint reads it with ``serialization.load_file``, whatever
    ``weights_only`` Lightning passes: a checkpoint from someone else cannot run code through its pickle.
    """

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = lambda storage, location: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().load_checkpoint(path, map_location, weights_only=True)
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_file(path, map_location=map_location)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temporary name does not end in .ckpt, so neither ModelCheckpoint nor `ckpt_path="last"` sees it.
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp creates 0600; give the file normal permissions
            os.replace(temporary, path)
        except BaseException as error:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            message = _no_space_message(path, checkpoint, error) if isinstance(error, Exception) else None
            if message is not None:
                raise SystemExit(message) from error
            raise
        _fsync_dir(path.parent)
        _remove_interrupted_writes(path)


def _remove_interrupted_writes(path: Path) -> None:
    """Removes the temporary files of earlier writes of ``path`` that a kill cut short (their process never reached
    its clean-up): one process writes a checkpoint's name, one write at a time, so once this write is in place any
    other is such a leftover."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def _no_space_message(path: Path, checkpoint: dict[str, Any], error: Exception) -> str | None:
    """The one-line stop for a write that failed for want of space, or None when space was not the problem."""
    chain, seen = [], error
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)
    needed = max(_tensor_bytes(checkpoint), path.stat().st_size if path.is_file() else 0)
    free = shutil.disk_usage(path.parent).free
    if code is None and free >= needed:
        return None
    what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on device"
    short = f"free at least {_size(needed - free)} more there" if needed > free else "free space there"
    return (f"moh: {what} for checkpoint {path.name} in {path.parent}: it takes about {_size(needed)}, "
            f"{_size(free)} is free there. The previous checkpoints are intact: {short} or move the run folder to "
            f"a larger disk (--trainer.logger.init_args.save_dir), then resume with --ckpt_path last.")


def _tensor_bytes(value: Any, seen: set | None = None) -> int:
    """The bytes of the tensors in a checkpoint (each storage once): what ``torch.save`` writes, to a few kB."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item, seen) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item, seen) for item in value)
    return 0


def _size(num_bytes: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    """Makes the rename itself durable: it lives in the folder's entry, not in the file."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
