"""Opening checkpoint files without running their code: every load in the suite goes through ``load_file``.

A pickle can name any Python callable, and unpickling calls it, so a checkpoint from someone else could run anything
on the machine that opens it. torch's ``weights_only`` unpickler builds only tensors, containers, primitives and the
types allowed with ``torch.serialization.add_safe_globals``. The suite's own checkpoints need nothing more: LightningCLI
saves hyper-parameters as plain dicts, and the config dataclasses that a run started from Python pickles instead are
allowed where they are defined (``checkpoint_type``). A file that names anything else is refused in one line naming
the file and the type.
"""
from __future__ import annotations

import argparse
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

# What torch's weights-only unpickler says when a file asks for code (a type or a function it does not allow); its
# other complaints ("Unsupported operand", ...) are about bytes that are not a pickle at all: a damaged file.
_REFUSED = re.compile(r"GLOBAL ([\w.]+)|unrecognized function|allowlisted")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint that names a type the suite does not allow in checkpoints (it was not opened)."""


def checkpoint_type(cls: type | None = None, *, also_as: str | None = None) -> Any:
    """Class decorator: instances of ``cls`` may appear in checkpoints (a config dataclass saved with a run).

    A checkpoint names the class by the module that defined it when it was saved; ``also_as`` is a second name to
    accept, such as the family package's (``moh_lightning.models.vit.ViTConfig``), under which checkpoints saved while
    the family was one module name it.
    """
    def allow(cls: type) -> type:
        torch.serialization.add_safe_globals([cls, *([(cls, also_as)] if also_as else [])])
        return cls

    return allow if cls is None else allow(cls)


def load_file(path: str | Path, map_location: Any = "cpu", extra_types: list | None = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``.

    ``mmap`` maps a zip-archive file's tensors instead of reading them (a quick look at a large checkpoint).
    ``extra_types`` are allowed for this load only: a foreign layout's known harmless types, such as the
    ``argparse.Namespace`` of training arguments that the authors' checkpoints carry. A file that needs any other
    type raises ``UnsafeCheckpointError`` naming the file and the type; nothing in it has run.
    """
    path = Path(path)
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(extra_types or [])):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if _REFUSED.search(str(error)) is None:
            raise
        raise UnsafeCheckpointError(f"{path} was not opened: {_refusal(str(error))}, which a checkpoint of weights "
                                    f"and settings never needs, and unpickling it could run code. Open it only if "
                                    f"you trust its maker (torch.load(..., weights_only=False) in your own Python) "
                                    f"and save its state_dict.") from None


def read_weights_file(path: str | Path) -> Any:
    """What a weights file holds: a safetensors file, or a torch file of tensors (``load_file``).

    Training scripts (DiT's and TransNeXt's ``train.py``, the authors') store their ``argparse.Namespace`` of
    arguments beside the weights; that plain record of values is the one type allowed beyond the suite's.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file as load_safetensors

        return load_safetensors(str(path))
    return load_file(path, extra_types=[argparse.Namespace])


def _refusal(message: str) -> str:
    """What the weights-only unpickler refused, from its multi-paragraph report."""
    refused = _REFUSED.search(message)
    if refused.group(1):
        return f"it needs the Python type `{refused.group(1)}`"
    lines = [line.strip() for line in message.splitlines()[1:] if line.strip()]
    reason = next((line for line in lines if not line.startswith(("Check the documentation", "Please file"))), "")
    return f"it needs more than weights ({reason.rstrip('.')})" if reason else "it needs more than weights"


__all__ = ["UnsafeCheckpointError", "checkpoint_type", "load_file", "read_weights_file"]
