"""Where a run's network settings come from when it starts from a checkpoint (``--ckpt_path <file>``).

One rule, as Lightning's ``load_from_checkpoint(..., **overrides)`` and transformers' ``from_pretrained(..., **kwargs)``
have it: the network is the checkpoint's, and only the ``--model.*`` keys typed on the command line override its
settings. A ``--config`` file gives what a checkpoint does not hold (the data, the trainer); where it states the
network otherwise, the checkpoint's settings hold, and one line at the start says which. A typed key, or a size the
data module passes on (``img_size``, ``num_classes``), that the trained weights cannot take stops the run in one line
naming it, the checkpoint's value and yours, before anything is written. The head budget a token uses
(``arch.moh.top_k``) and how heads are executed are free at evaluation, and a run that differs there says so in one
line at its start ("evaluating at top_k 4; trained at 2"). An evaluation given a checkpoint and no ``--config``
reads the run's own ``config.yaml`` for the rest (``with_run_config``), as litgpt reads the config saved beside
every checkpoint.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from moh_lightning.serialization import UnsafeCheckpointError, load_file
from moh_lightning.tasks.checkpoints import checkpoint_task

#: Sizes the data module passes to the network (``link_arguments``): a difference there is the data's key.
LINKED_SIZES = ("num_classes", "vocab_size", "in_chans", "img_size")
#: ``arch`` keys that change no weight: how many routed heads a token takes, how heads are executed, regularisation
#: that evaluation turns off, and the weights a fresh network would start from (the checkpoint's replace them).
FREE_KEYS = ("moh.top_k", "moh.execution", "moh.router_dtype", "fused_kernels", "drop_rate", "drop_path_rate",
             "attn_drop_rate", "class_dropout_prob", "pretrained")
#: ``--ckpt_path`` values Lightning resolves itself, and the suite's ``last``.
_NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")


def checkpoint_settings(subcommand: str, ckpt_path: str, class_path: str | None) -> dict | None:
    """The hyper-parameters saved with the checkpoint ``ckpt_path`` (None for a name Lightning resolves, such as
    ``last``), after checking it exists and was written by the task ``class_path`` the config builds.

    A missing file, one that would run code and another task's checkpoint stop in one line (``SystemExit``).
    """
    if ckpt_path.split(":")[0] in _NAMED_CHECKPOINTS or "://" in ckpt_path:
        return None
    if not Path(ckpt_path).is_file():
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path}: no such file; give a .ckpt written by `moh fit` "
                         f"(or `last`, this run name's newest).")
    try:
        raw = load_file(ckpt_path, mmap=True)  # refuses, in one line, a file whose pickle names a type
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # the zip reader, the unpickler and a truncated file raise different types
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path} does not load as a checkpoint "
                         f"({type(error).__name__}: it is empty, truncated or not a torch file); give a .ckpt written "
                         f"by `moh fit`.") from None
    hparams = raw.get("hyper_parameters") if isinstance(raw, dict) else None
    kind = checkpoint_task(raw) if isinstance(hparams, dict) and isinstance(raw.get("state_dict"), dict) else "unknown"
    yours = str(class_path or "").rpartition(".")[2]
    if kind == "unknown":
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path} is not a checkpoint of this suite (no `moh fit` "
                         f"task or weights in it); give a .ckpt written by `moh fit`.")
    if yours and kind != yours:
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path} was written by the task {kind}, and the config "
                         f"builds a {yours}; give the config of the run that wrote it{_run_config_hint(ckpt_path)}.")
    return dict(hparams)


def with_run_config(subcommand: str, args: list[str], config_flags: tuple[str, ...]) -> list[str]:
    """``args`` (after the subcommand) with ``--config <run>/config.yaml`` first when they name a checkpoint file
    (``--ckpt_path``) and no config: the checkpoint sits in ``<run>/checkpoints/`` (a sweep trial's run folder
    included), the config its ``moh fit`` wrote beside them, which holds the data and the trainer a checkpoint does
    not. A checkpoint without one stops in one line saying to give ``--config``."""
    given = dict(_options(args))
    if any(flag in given for flag in config_flags) or "--ckpt_path" not in given:
        return args
    ckpt_path = given["--ckpt_path"]
    if ckpt_path.split(":")[0] in _NAMED_CHECKPOINTS or "://" in ckpt_path:
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path} needs --config (the run it names comes from the "
                         f"config); or give the checkpoint's file, whose run folder's config.yaml is then read.")
    checkpoint_settings(subcommand, ckpt_path, None)  # a missing file, or no checkpoint of the suite: one line
    config = Path(ckpt_path).parent.parent / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path} is not in a run folder with a config.yaml "
                         f"(<run>/checkpoints/<file> beside <run>/config.yaml) to read the data and trainer from; give "
                         f"the config it was trained with: --config <yaml>.")
    return ["--config", str(config), *args]


def _options(args: list[str]) -> list[tuple[str, str]]:
    """``(flag, value)`` of each ``--flag value`` / ``--flag=value`` in ``args`` (value "" for a bare flag)."""
    out, i = [], 0
    while i < len(args):
        flag, sep, value = args[i].partition("=")
        if not sep and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        if flag.startswith("-"):
            out.append((flag, value))
        i += 1
    return out


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config (dicts, dataclasses, namespaces) as ``{"moh.top_k": 2, ...}``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if not isinstance(value, Mapping) or not value:
        return {prefix.rstrip("."): value} if prefix else {}
    out = {}
    for key, item in value.items():
        out.update(flat(item, f"{prefix}{key}."))
    return out


def typed_model_keys(args: list[str]) -> list[str]:
    """The ``model.init_args`` keys that command-line options name (``--model.init_args.arch.moh.top_k 4``:
    ``arch.moh.top_k``; a mapping value names each of its keys), the ``--config`` files' left out."""
    keys = []
    for flag, value in _options(args):
        if flag.startswith("--model.init_args."):
            key = flag.removeprefix("--model.init_args.")
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = None
            keys += [f"{key}.{name}" for name in flat(parsed)] if isinstance(parsed, dict) and parsed else [key]
    return keys


def compare_with_checkpoint(subcommand: str, ckpt_path: str, saved: Mapping, built: Mapping,
                            config_keys: Mapping[str, Any]) -> str | None:
    """The line that says how this run's network differs from the checkpoint's (None when it does not); a
    difference the weights cannot take stops here in one line naming the keys and both values.

    ``saved`` and ``built`` are the task's hyper-parameters: the checkpoint's, and those the task was built with
    (typed keys and the data module's sizes included); ``config_keys`` are the ``model.init_args`` keys the config
    files state, which the checkpoint's settings replaced.
    """
    theirs, yours = flat(saved.get("arch") or {}), flat(built.get("arch") or {})
    if saved.get("hf_config") is not None:
        # A transformers network's vocabulary is its config's (the embedding's rows), compared below: checkpoints
        # written before arch.vocab_size recorded those rows hold the tokenizer's size there.
        theirs.pop("vocab_size", None), yours.pop("vocab_size", None)
    if saved.get("hf_config") != built.get("hf_config"):  # a transformers network: its shapes are its source's
        theirs["hf_config"], yours["hf_config"] = "its source's", "another source's"
    differing = [key for key in sorted(theirs.keys() | yours.keys()) if theirs.get(key) != yours.get(key)]
    shapes = [key for key in differing if key not in FREE_KEYS]
    if shapes:
        named = "; ".join(f"{_option(key)}: the checkpoint's {theirs.get(key)!r}, yours {yours.get(key)!r}"
                          for key in shapes)
        raise SystemExit(f"moh {subcommand}: --ckpt_path {ckpt_path} holds weights of another shape ({named}); leave "
                         f"these keys out or give the run's own config{_run_config_hint(ckpt_path)}.")
    verb = "continuing" if subcommand == "fit" else "evaluating"
    parts = []
    if differing:
        now = ", ".join(f"{key.rpartition('.')[2]} {yours.get(key)}" for key in differing)
        then = ", ".join(str(theirs.get(key)) for key in differing)
        parts.append(f"{verb} at {now}; trained at {then} ({', '.join(_option(key) for key in differing)})")
    replaced = {key.removeprefix("arch."): value for key, value in config_keys.items()
                if key.startswith("arch.") and key.removeprefix("arch.") in theirs
                and key.removeprefix("arch.") not in LINKED_SIZES  # the data's, compared above
                and theirs[key.removeprefix("arch.")] != value}
    if replaced:
        stated = ", ".join(f"{key.rpartition('.')[2]} {theirs[key]} (config: {value})" for key, value in
                           sorted(replaced.items()))
        parts.append(f"the checkpoint's network, not the config's: {stated}; a --model.init_args.arch.* option "
                     f"overrides a key")
    return f"moh: {'; '.join(parts)}" if parts else None


def _option(key: str) -> str:
    """The option that sets ``arch``'s ``key``: the data module's for a size it passes on."""
    if key in LINKED_SIZES:
        return f"data.init_args.{key} -> model.init_args.arch.{key}"
    return "model.init_args.hf_config (init_from)" if key == "hf_config" else f"model.init_args.arch.{key}"


def _run_config_hint(ckpt_path: str) -> str:
    """`` (--config <run>/config.yaml)`` where the checkpoint sits in a run folder that has one."""
    config = Path(ckpt_path).resolve().parent.parent / "config.yaml"
    return f" (--config {Path(ckpt_path).parent.parent / 'config.yaml'})" if config.is_file() else ""


__all__ = ["FREE_KEYS", "LINKED_SIZES", "checkpoint_settings", "compare_with_checkpoint", "flat",
           "typed_model_keys", "with_run_config"]
