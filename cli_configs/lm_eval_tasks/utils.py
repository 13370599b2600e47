"""Data loading of the tasks in this folder; their YAMLs name it with lm-eval's ``!function``, which imports a module
from beside the YAML."""
from __future__ import annotations

from pathlib import Path

import datasets


def json_beside(data_files: str, **metadata) -> datasets.DatasetDict:
    """The JSON (lines) file ``data_files`` of this folder as the ``test`` split.

    lm-eval hands a task's ``dataset_kwargs`` to ``datasets.load_dataset`` as they are, and ``datasets`` reads a
    relative ``data_files`` from the working folder: read from here, the task runs from any folder. ``metadata`` is
    the task's ``metadata``, which lm-eval passes along.
    """
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name(data_files))})
