"""Errors in what a user gave (a key, a file, a folder): ``moh`` prints their message as one line, no traceback.

Each is also the built-in error it specialises (``MissingDataError`` is a ``FileNotFoundError``), so code that catches
the built-in one, and tests that expect it, see no difference. The message names the key or file and what to do.
"""
from __future__ import annotations


class UsageError(Exception):
    """A problem with the user's input, fully described by its message."""


class MissingDataError(UsageError, FileNotFoundError):
    """A data file, folder or split that a config names does not exist."""


class BadValueError(UsageError, ValueError):
    """A config value that cannot work (a budget, a shape, a split rule)."""


class MissingExtraError(UsageError, ImportError):
    """A config asks for what an optional extra of the package installs (``pip install 'moh-lightning[gpu]'``)."""


__all__ = ["BadValueError", "MissingDataError", "MissingExtraError", "UsageError"]
