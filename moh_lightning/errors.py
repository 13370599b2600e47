"""Errors in what a user gave (a key, a file, a folder): ``moh`` prints their message as one line, no traceback.

Each is also the built-in error it specialises (``MissingDataError`` is a ``FileNotFoundError``), so code that catches
the built-in one, and tests that expect it, see no difference. The message names the key or file and what to do.
"""
from __future__ import annotations

import os
import re


class UsageError(Exception):
    """A problem with the user's input, fully described by its message."""


class MissingDataError(UsageError, FileNotFoundError):
    """A data file, folder or split that a config names does not exist."""


class BadValueError(UsageError, ValueError):
    """A config value that cannot work (a budget, a shape, a split rule)."""


class MissingExtraError(UsageError, ImportError):
    """A config asks for what an optional extra of the package installs (``pip install 'moh-lightning[gpu]'``)."""


def debugging() -> bool:
    """Whether every error should show its traceback and full report: ``MOH_DEBUG`` (``moh --debug`` sets it) or
    jsonargparse's own ``JSONARGPARSE_DEBUG``."""
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("MOH_DEBUG", "JSONARGPARSE_DEBUG"))


# The import name of each package an extra installs (pyproject.toml's optional dependencies) -> that extra.
EXTRAS = {"transformers": "hf", "tokenizers": "hf", "accelerate": "hf", "datasets": "hf", "lm_eval": "lm-eval",
          "ray": "sweep", "scipy": "sweep", "wandb": "loggers", "mlflow": "loggers", "liger_kernel": "gpu"}


def install_line(extra: str) -> str:
    return f"pip install 'moh-lightning[{extra}]'"


def missing_extra(error: Exception) -> MissingExtraError | None:
    """The one-line error for an import that failed because an extra is not installed, None for any other failure.

    Reads the module's name, or the package a Lightning logger names in its own message ("Requirement 'wandb>=0.12'
    not met", which jsonargparse passes on inside a ValueError), so an extra missing anywhere below a command is
    caught at the command's one boundary.
    """
    name = getattr(error, "name", None) or ""
    if not name:
        found = re.search(r"Requirement '([\w.-]+)|No module named '([\w.]+)'", str(error))
        name = next((group for group in found.groups() if group), "") if found else ""
    module = name.split(".")[0].replace("-", "_")
    extra = EXTRAS.get(module)
    if extra is None or isinstance(error, MissingExtraError):
        return None
    return MissingExtraError(f"this needs {module}, which the '{extra}' extra installs: {install_line(extra)}")


__all__ = ["EXTRAS", "BadValueError", "MissingDataError", "MissingExtraError", "UsageError", "debugging",
           "install_line", "missing_extra"]
