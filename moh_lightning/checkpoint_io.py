"""Checkpoint writing that never leaves a truncated file where a good checkpoint was."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that replaces a checkpoint only once the new one is completely on disk.

    Each checkpoint is written to a hidden temporary file in its destination folder, flushed and fsynced, then
    renamed over the destination with ``os.replace`` (atomic on POSIX), so a crash or kill at any moment leaves
    the previous checkpoint or the new one, never a half-written file. Lightning's default stages the file in
    the system temp folder and moves it, which is a plain copy (not atomic) when the run folder is on another
    filesystem, as on clusters. Remote paths (``s3://``, ...) keep Lightning's behaviour.
    """

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
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        _fsync_dir(path.parent)


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
