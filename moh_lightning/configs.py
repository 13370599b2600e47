"""The shipped YAML configs: where they are, how a name resolves to a file, and what ``extends`` means.

A config names the configs it builds on with ``extends:`` (a name or a list, resolved beside the file first); later
configs deep-merge over earlier ones. ``moh fit`` turns that chain into LightningCLI's stacked ``--config`` files
(``expand_config``); tools that only read a config's values get the merged dictionary (``load_config``). This module
imports nothing of the suite, so every floor may use it.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

_GLUED_KEY = re.compile(r"^\s*(?:- )?[A-Za-z_][\w.]*:[^\s/:]")
OVERLAYS = ("multi_gpu.yaml", "fsdp.yaml")  # stacked onto an experiment, not experiments themselves


def config_dir() -> Path:
    """The shipped ``cli_configs/``: installed with the package, or beside it in a source checkout."""
    packaged = Path(__file__).resolve().parent / "cli_configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "cli_configs"


def shipped_configs() -> list[str]:
    """Names of the shipped experiment configs (the overlays and the recipes they extend are not experiments)."""
    return sorted(p.name for p in config_dir().glob("*.yaml") if p.name not in OVERLAYS)


def resolve_config(value: str, beside: Path | None = None) -> str:
    """A path as given when it exists (or beside the config that names it), else the shipped config of that name."""
    candidates = [Path(value)] + ([beside / value] if beside is not None else [])
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    shipped = config_dir() / value
    if not shipped.suffix:
        shipped = shipped.with_suffix(".yaml")
    if shipped.is_file():
        return str(shipped)
    raise SystemExit(f"moh: --config {value}: no such file here nor in the shipped configs "
                     f"({', '.join(shipped_configs())}).")


def _chain(value: str, seen: tuple[str, ...] = ()) -> list[tuple[str, dict, bool]]:
    """(path, own keys, whether it extends others) of a config and of everything it ``extends``, the bases first."""
    path = resolve_config(value, beside=Path(seen[-1]).parent if seen else None)
    if path in seen:
        raise SystemExit(f"moh: config {path} extends itself (through {' -> '.join(seen)}).")
    content = read_config_file(path)
    if "extends" not in content:
        return [(path, content, False)]
    bases = content.pop("extends")
    if not (isinstance(bases, str) or isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise SystemExit(f"moh: config {path}: extends={bases!r}: give a config name or a list of them "
                         f"(extends: recipes/vit_mnist.yaml).")
    out = []
    for base in [bases] if isinstance(bases, str) else bases:
        out += _chain(base, (*seen, path))
    return out + [(path, content, True)]


def read_config_file(path: str | Path) -> dict:
    """A config file's keys; a file that is not a YAML mapping stops in one line naming it and where it breaks."""
    try:
        content = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SystemExit(f"moh: config {path}: not a text file; give a YAML config.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SystemExit(f"moh: config {path}: not valid YAML{where} ({problem}); fix it there.") from None
    except OSError as error:
        raise SystemExit(f"moh: config {path}: cannot read it ({error.strerror}).") from None
    glued = next((number for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1)
                  if _GLUED_KEY.match(line)), None)
    if glued is not None:  # YAML reads `batch_size:16` as the string 'batch_size:16', not a key and its value
        line = Path(path).read_text(encoding="utf-8").splitlines()[glued - 1].strip()
        key, _, value = line.partition(":")
        raise SystemExit(f"moh: config {path}: line {glued} '{line}': a key takes its value after a colon and a space; "
                         f"write '{key}: {value}'.")
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise SystemExit(f"moh: config {path}: holds a {type(content).__name__}, not keys; a config is a YAML mapping "
                         f"(trainer:, model:, data:).")
    return content


def expand_config(value: str) -> list[str]:
    """``--config`` values for one config: the configs it ``extends`` (recursively), then its own keys.

    LightningCLI deep-merges stacked ``--config`` files, but a single file cannot name the file it builds on:
    jsonargparse's own ``config:`` key inside a file replaces whole groups instead of merging them. So ``extends``
    is read here and becomes stacked ``--config`` arguments: a file that extends nothing as its path, one that does
    as its own keys in YAML text (jsonargparse reads a ``--config`` value that is not a path as YAML).
    """
    return [yaml.safe_dump(content, sort_keys=False) if extends else path
            for path, content, extends in _chain(value) if content or not extends]


def deep_merge(base: dict, update: dict) -> dict:
    """``update`` over ``base``; nested dictionaries merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(value: str) -> dict:
    """The settings a config stands for: everything it ``extends``, deep-merged as ``moh fit`` merges it."""
    merged: dict = {}
    for _, content, _ in _chain(value):
        merged = deep_merge(merged, content)
    return merged


__all__ = ["OVERLAYS", "config_dir", "deep_merge", "expand_config", "load_config", "resolve_config",
           "shipped_configs"]
