"""What ``moh`` reads off a command line before any parser sees it: the configs a ``--config`` stands for, the run's
name, and the dense baseline's ``--<parent>.moh null``. Plain text work, so ``moh`` can do it before importing torch."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from moh_lightning.configs import expand_config

CONFIG_FLAGS = ("--config", "-c")
_NULLABLE_GROUPS = (".moh",)  # dataclass-typed options whose value may be null: `arch.moh: null` is the dense baseline


def null_group_args(args: Sequence[str]) -> list[str]:
    """``--<parent>.moh null`` as ``--<parent> '{"moh": null}'``.

    jsonargparse reads a nested dataclass option inside a subclass's ``init_args`` as a config-file path, so
    ``--model.init_args.arch.moh null`` fails ("Expected a dot import path string", jsonargparse issue #823); the
    same value given to the parent merges into it.
    """
    out, args = [], list(args)
    i = 0
    while i < len(args):
        flag, sep, value = args[i].partition("=")
        if not sep and i + 1 < len(args):
            value = args[i + 1]
        if flag.startswith("--") and flag.endswith(_NULLABLE_GROUPS) and value.strip().lower() in ("null", "none", "~"):
            parent, _, key = flag.rpartition(".")
            out += [parent, json.dumps({key: None})]
            i += 1 if sep else 2
            continue
        out.append(args[i])
        i += 1
    return out


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """Rewrites every ``--config NAME`` / ``--config=NAME`` into the stacked configs it stands for."""
    out, args = [], list(args)
    i = 0
    while i < len(args):
        flag, sep, value = args[i].partition("=")
        if flag in CONFIG_FLAGS and (sep or i + 1 < len(args)):
            if not sep:
                i += 1
                value = args[i]
            for expanded in expand_config(value):
                out += [flag, expanded]
        else:
            out.append(args[i])
        i += 1
    return out


def run_name(args: Sequence[str]) -> str | None:
    """The name of a run: the stem of the first ``--config`` given, the experiment (overlays come after it)."""
    for i, arg in enumerate(args):
        flag, sep, value = arg.partition("=")
        if flag in CONFIG_FLAGS:
            value = value if sep else (args[i + 1] if i + 1 < len(args) else "")
            return Path(value).stem or None
    return None
