"""What a command writes: never over what a user already has, never left half-made, never outside its folder.

Every command that writes a file or folder checks its target first (``check_output_folder``, ``check_output_file``),
before it loads anything, and refuses one that already holds something unless told ``--overwrite true``; a folder
it creates and then fails in is removed again (``created_folder``). A value used as a name inside a folder (a run
name, a cache entry) stays inside it (``check_name``). Only the standard library and ``moh_lightning.errors`` are
imported here, so the check costs nothing before a command's real imports.
"""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moh_lightning.errors import BadValueError, UsageError

# Shown of what a refused folder holds; the rest are counted.
_SHOWN = 3


class OutputExistsError(UsageError, FileExistsError):
    """An output path that already holds something this command would write over."""


class BadNameError(BadValueError):
    """A name (of a run, a cache entry) that would place what it names outside its parent folder."""


def _refusal(option: str, path: Path, holds: str, flag: str) -> OutputExistsError:
    return OutputExistsError(f"{option} {path} {holds}; pass {flag} true to write over it, or choose another path.")


def check_output_folder(path: str | Path, option: str, overwrite: bool, flag: str = "--overwrite") -> Path:
    """``path`` as a folder to write into: refused when it is a file, or a folder with anything in it (unless
    ``overwrite``, the command's option ``flag``); returned as a ``Path`` otherwise. Nothing is created."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputExistsError(f"{option} {folder} is a file, not a folder; choose another path.")
    held = sorted(entry.name for entry in folder.iterdir()) if folder.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:_SHOWN]) + (f" and {len(held) - _SHOWN} more" if len(held) > _SHOWN else "")
        raise _refusal(option, folder, f"already holds {shown}", flag)
    return folder


def check_output_file(path: str | Path, option: str, overwrite: bool, flag: str = "--overwrite") -> Path:
    """``path`` as a file to write: refused when it is a folder, or a file that exists (unless ``overwrite``)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise OutputExistsError(f"{option} {file} is a folder, not a file; choose another path.")
    if file.exists() and not overwrite:
        raise _refusal(option, file, "already exists", flag)
    return file


@contextmanager
def created_folder(path: str | Path) -> Iterator[Path]:
    """Makes ``path`` (and any missing parents) for the body to write into; when the body raises, the folders this
    made are removed again with what was written in them, so a failed command leaves nothing behind. A folder that
    existed before is left as it is: it held what the user had (or was empty) and may hold partial output now."""
    folder = Path(path).expanduser()
    missing = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    except BaseException:
        if missing:
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


def check_name(name: str | None, key: str) -> None:
    """Refuses a ``name`` that is not a single folder or file name: one with a path separator (an absolute path
    among them) or ``..``, which would put what it names outside the folder it belongs in. None and "" pass."""
    if not isinstance(name, str) or not name:
        return
    if "/" in name or "\\" in name or name == "..":
        raise BadNameError(f"{key} {name!r} is a path, not a name: what it names would be written outside its "
                           f"folder; give a name without '/', '\\' or '..'.")


__all__ = ["BadNameError", "OutputExistsError", "check_name", "check_output_file", "check_output_folder",
           "created_folder"]
