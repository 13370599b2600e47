"""Run folders: each run writes its events, resolved config and checkpoints under ``<save_dir>/<name>/version_N/``.

``--ckpt_path last`` continues the newest checkpoint of one run name, in that run's own folder, and only when what
makes the run that run (its network, task, head budget, data and tokenizer) is what was saved with it: a run never
continues another experiment's weights, and no run writes into another run's folder. How long and how it runs (the
token, step and epoch budgets, loader workers, compilation, logging, precision) may change, so a finished run
continues for longer; each such change is said in one line and kept in the run folder's ``resumes.log``. A
checkpoint that does not load (a truncated copy, a disk fault) is moved aside and the next newest is used
(``latest_loadable_checkpoint``).

A logger without folders of its own (MLflow, Weights & Biases) gets a run folder of the same shape, ``runs/<name>/
version_N/``, named by its run-name option (``run_name``, W&B's ``name``) or the config; ``--ckpt_path last`` logs
into the logger run kept in the checkpoint (``use_run_folder``, ``callbacks.logger_runs``).
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import time
import typing
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from moh_lightning.callbacks.logger_runs import CHECKPOINT_KEY, FOLDER_LOGGERS
from moh_lightning.data.tokenizers import BYTE_TOKENIZER, RUN_TOKENIZER, load_tokenizer, tokenizer_identity
from moh_lightning.outputs import check_name
from moh_lightning.serialization import UnsafeCheckpointError, load_file

# The saved settings that must match for a run to continue from a checkpoint: what the weights and the data are...
RESUME_KEYS = ("model", "data")
# ...except these, which say how long and how the run goes, not what it is (the trainer's keys, budgets and precision
# among them, are never compared), each with what its change means for the resumed run where that is not plain. A
# per-layer option matches its key and every entry below it.
CONTINUABLE_KEYS = {
    "model.init_args.max_tokens": "",            # the LM's token budget (and its cosine length)
    "model.init_args.compile": "",
    "model.init_args.compile_kwargs": "",
    "model.init_args.activation_checkpointing": "",
    "model.init_args.arch.moh.execution": "",    # dense-and-mask or head-sparse: the same function, computed otherwise
    "data.init_args.num_workers": "the rest of this epoch is drawn in a new order, since a loader's position does "
                                  "not carry to another number of workers",
    "data.init_args.cache_dir": "",
    "data.init_args.encode_batch_size": "",
    "data.init_args.samples_per_epoch": "",      # the text mixture's epoch length
    # What `moh predict` reads and how the LM continues its prompts: nothing of training.
    "data.init_args.predict_dir": "",
    "data.init_args.predict_prompts": "",
    "model.init_args.max_new_tokens": "",
    "model.init_args.temperature": "",
    "model.init_args.top_k_tokens": "",
    "model.init_args.top_p": "",
}
CHANGES_LOG = "resumes.log"  # in the version folder: one line per resume that changed a setting
RUNS = Path("runs")  # where the run folders of loggers without folders of their own go


def versions(run_root: Path) -> list[Path]:
    """The ``version_N`` folders of one run name, oldest first."""
    found = [p for p in run_root.glob("version_*") if p.is_dir() and p.name.removeprefix("version_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("version_")))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # moved aside by another process meanwhile
        return None


def latest_checkpoint(run_root: Path, skip: Collection[Path] = ()) -> tuple[Path, Path] | None:
    """The version folder holding the newest checkpoint of a run name, and that checkpoint; None if there is none.

    ``last.ckpt`` is written with every periodic checkpoint and at the end of fit, so it is the newest state of its
    folder; without it the one of the highest step in its name (``step=N``, as StepCheckpoint and Lightning name
    them) is taken, and among equal steps the newest by modification time: a folder copied without its times
    keeps its order. Checkpoints in ``skip`` are passed over.
    """
    newest = None
    for version in versions(run_root):
        found = [(mtime, p) for p in (version / "checkpoints").glob("*.ckpt")
                 if p not in skip and (mtime := _mtime(p)) is not None]
        if not found:
            continue
        last = [(mtime, p) for mtime, p in found if p.name == "last.ckpt"]
        chosen = last[0] if last else max(found, key=lambda item: (_step_in_name(item[1]), item[0]))
        if newest is None or chosen[0] >= newest[0]:
            newest = (chosen[0], version, chosen[1])
    return None if newest is None else newest[1:]


def _step_in_name(path: Path) -> int:
    found = re.search(r"step=(\d+)", path.name)
    return int(found.group(1)) if found else -1


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` does not load as a Lightning checkpoint, or None when it does.

    torch writes checkpoints as zip archives whose central directory comes last, so a copy cut short anywhere is no
    longer a zip archive. A complete archive is loaded memory-mapped: its pickle is read and checked, the tensor
    bytes are not, so even a large checkpoint is checked in a moment and without its size in memory. (Lightning
    loads it once more to resume.) It is read without running code (``serialization.load_file``): a file that names
    a type no checkpoint needs raises ``UnsafeCheckpointError``, since it is not damaged and must not be moved aside.
    """
    if path.is_dir():  # a sharded (distributed) checkpoint: Lightning's strategy checks it
        return None
    try:
        checkpoint = load_file(path, mmap=True)
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # the zip reader, the unpickler and a truncated legacy file raise different types
        first = (str(error).strip().splitlines() or [""])[0].split(". ")[0]
        first = "".join(c if c.isprintable() else "?" for c in first)[:160]
        return f"{type(error).__name__}: {first}" if first else type(error).__name__
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        return "not a Lightning checkpoint (no state_dict in it)"
    return None


def _move_aside(path: Path) -> Path | None:
    """Renames ``path`` to ``<name>.corrupt-<time>`` beside it (no longer ``*.ckpt``, so no lookup sees it)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    counter = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{counter}")
        counter += 1
    try:
        os.replace(path, target)
    except OSError:  # gone already (another process moved it) or the folder is read-only
        return None
    return target


def latest_loadable_checkpoint(run_root: Path) -> tuple[Path, Path] | None:
    """``latest_checkpoint``, passing over checkpoints that do not load; None if the run name has none.

    Each checkpoint newer than the one returned that fails to load is moved aside (renamed, never deleted) with a
    warning naming it and what failed, so the resumed run's own saves do not overwrite it and no later lookup picks
    it again. Under DDP every process runs this on its own, before the processes connect: all of them pass over the
    same files and so return the same checkpoint, and only global rank 0 (Lightning's rank rule on the environment)
    renames. When no checkpoint loads, the run stops with one line listing them and nothing is renamed, so a retried
    job keeps stopping there instead of silently starting afresh.
    """
    failed: list[tuple[Path, str]] = []
    while (found := latest_checkpoint(run_root, skip=[path for path, _ in failed])) is not None:
        problem = checkpoint_problem(found[1])
        if problem is None:
            break
        failed.append((found[1], problem))
    if found is None:
        if not failed:
            return None
        listed = "; ".join(f"{path} ({problem})" for path, problem in failed)
        raise SystemExit(f"moh: --ckpt_path last: none of the {len(failed)} checkpoints of {run_root} loads: {listed}. "
                         f"They are left in place: restore a good copy, or start afresh without --ckpt_path last "
                         f"or under another name (--trainer.logger.init_args.name NEW_NAME).")
    if rank_zero_only.rank == 0:
        for path, problem in failed:
            moved = _move_aside(path)
            where = f"moved it aside to {moved.name}" if moved is not None else "could not move it aside"
            warnings.warn(f"Checkpoint {path} does not load ({problem}); {where} and resuming from the next newest, "
                          f"{found[1]}.", stacklevel=2)
    return found


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _continuable(key: str) -> bool:
    return any(key == allowed or key.startswith(f"{allowed}.") for allowed in CONTINUABLE_KEYS)


def differing_settings(saved: dict, current: dict, sections: tuple[str, ...] = RESUME_KEYS) -> list[str]:
    """Keys under ``sections`` whose values differ between a saved and a current resolved config."""
    old = _flatten({key: saved.get(key) for key in sections})
    new = _flatten({key: current.get(key) for key in sections})
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def check_resumable(version_dir: Path, current: dict) -> str | None:
    """What changed in how the run goes, as one line (None when nothing did); stops with one line instead when
    what makes the run that run differs from the settings saved in ``version_dir``."""
    saved_file = version_dir / "config.yaml"
    if not saved_file.is_file():
        return None
    saved = yaml.safe_load(saved_file.read_text()) or {}
    resolve_source_paths((saved.get("data") or {}).get("init_args"))  # a config.yaml that kept them relative
    saved_model = (saved.get("model") or {}).get("init_args") or {}
    resolve_init_from(saved_model)
    if saved_model.get("init_from") and saved_model.get("hf_config", {}) is None:
        # Written before config.yaml recorded the source's transformers config: init_from, compared, names it.
        current = {**current, "model": {**current["model"], "init_args": {**current["model"]["init_args"],
                                                                         "hf_config": None}}}
    differing = [key for key in differing_settings(saved, current) if not _continuable(key)]
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        raise SystemExit(f"moh: --ckpt_path last would continue {version_dir}, whose saved settings differ in "
                         f"{shown} (see {saved_file}), which make it another experiment: start a fresh run under "
                         f"another name (--trainer.logger.init_args.name NEW_NAME) or leave out --ckpt_path last.")
    changed = [key for key in differing_settings(saved, current, (*RESUME_KEYS, "trainer"))
               if not key.startswith("trainer.logger.")]
    if not changed:
        return None
    old, new = _flatten(saved), _flatten(current)
    notes = [note for allowed, note in CONTINUABLE_KEYS.items() if note and any(
        key == allowed or key.startswith(f"{allowed}.") for key in changed)]
    return ", ".join(f"{key} {old.get(key)} -> {new.get(key)}" for key in changed) + "".join(f"; {n}" for n in notes)


def resolve_source_paths(data_args) -> None:
    """A data module's local text sources named relative to the working folder (``path``, ``data_files``), named by
    their absolute paths: the run's config.yaml and checkpoints then read them from any folder (``moh validate
    --ckpt_path`` run elsewhere), and a resume compares them as the files they are. ``data_args``: a config's or a
    saved config.yaml's ``data.init_args``; a name that is no file here (``python-stdlib``, a hub dataset) stays."""
    for source in (data_args.get("sources") if data_args is not None else None) or []:
        for key in ("path", "data_files"):
            value = source.get(key)
            if isinstance(value, str | list):
                source[key] = _absolute(value) if isinstance(value, str) else [_absolute(v) for v in value]


def resolve_init_from(model_args) -> None:
    """A local ``init_from`` (a folder, a weights file, a checkpoint) named relative to the working folder, named by
    its absolute path, as the data's sources are (``resolve_source_paths``): the run's config.yaml then reads back
    from any folder. ``model_args``: a config's or a saved config.yaml's ``model.init_args``; a hub id stays."""
    value = model_args.get("init_from") if model_args is not None else None
    if isinstance(value, str):
        model_args["init_from"] = _absolute(value)


def _absolute(path: str) -> str:
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def read_kept_tokenizer(version_dir: Path, data_args) -> None:
    """Points ``data_args.tokenizer`` at the copy the run keeps in its folder (``TextDataModule.keep_in_run_folder``)
    where it names that copy or a tokenizer that makes the same ids (the folder it was copied from), so that
    ``--ckpt_path last`` continues with the tokenizer saved; another tokenizer stays as named, and
    ``check_resumable`` refuses it as another experiment."""
    kept = version_dir / RUN_TOKENIZER
    name = getattr(data_args, "get", lambda key: None)("tokenizer")
    if not isinstance(name, str) or name == BYTE_TOKENIZER or not kept.is_dir():
        return
    if Path(name).expanduser().resolve() != kept.resolve():
        try:
            named, copy = load_tokenizer(name), load_tokenizer(str(kept))
            if tokenizer_identity(name, named) != tokenizer_identity(str(kept), copy):
                return
        except OSError:  # no such tokenizer: the comparison of the settings names it
            return
    data_args.tokenizer = str(kept.resolve())


@rank_zero_only
def record_changes(version_dir: Path, checkpoint: Path, changes: str) -> None:
    """Says in one line what a resumed run changed, and appends it to the run folder's ``resumes.log``.

    The run overwrites ``config.yaml`` with its own settings, so the log is where the earlier ones stay.
    """
    line = f"continuing {checkpoint} with {changes}"
    print(f"moh: {line}", file=sys.stderr)
    with open(version_dir / CHANGES_LOG, "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def _class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def logs_in_folders(logger) -> bool:
    """Whether a logger's config (``class_path``, ``init_args``) names a logger whose version folder is the run's."""
    return issubclass(_class(logger.class_path), FOLDER_LOGGERS)


def check_run_names(logger) -> None:
    """Refuses, in one line naming the key, a TensorBoard or CSV logger's ``name``, ``version`` or ``sub_dir`` that
    is a path rather than a name (``../../escaped_run``): the logger joins them to its ``save_dir``, and the run
    would be written outside it. ``logger`` is the config's ``trainer.logger``: one, a list, or none."""
    for one in logger if isinstance(logger, list) else [logger]:
        if getattr(one, "init_args", None) is not None and logs_in_folders(one):
            for key in ("name", "version", "sub_dir"):
                check_name(one.init_args.get(key), f"--trainer.logger.init_args.{key}")


BUDGET_KEYS = ("arch.moh", "arch.moh.num_shared_heads", "arch.moh.top_k")  # the command-line keys that set it
_BUDGET_SUFFIX = re.compile(r"_(\d+|dense)$")  # the configs' names end in the % of heads a token uses


def name_for_budget(name: str, model, typed: Collection[str]) -> str:
    """The default run name when the command line sets the head budget (``--model.init_args.arch.moh null``,
    ``...moh.top_k 2``): the config's name with its budget suffix replaced by the one used, ``_dense`` for plain
    multi-head attention and else the % of heads a token uses (``vit_tiny_mnist_75`` at top-2 of 6: ``_50``).

    A MoH run and its dense baseline are then two runs side by side, not versions of one name; the same command
    finds the same name again for ``--ckpt_path last``. ``model`` is the parsed config's ``model``.
    """
    arch = model.init_args.get("arch") if model is not None and model.get("init_args") is not None else None
    if arch is None or not any(key in BUDGET_KEYS for key in typed):
        return name
    if arch.get("moh") is None:
        budget = "dense"
    else:
        try:
            arch_type = typing.get_type_hints(_class(model.class_path).__init__)["arch"]
            budget = f"{100 * arch_type(**arch.as_dict()).activated_fraction:.0f}"
        except (AttributeError, KeyError, NameError, TypeError, ValueError):
            return name  # a budget the model cannot take: building it says so, in its own words
    return f"{_BUDGET_SUFFIX.sub('', name)}_{budget}"


def run_root(logger, default_name: str) -> Path:
    """The folder of one run name's ``version_N`` folders: ``<save_dir>/<name>`` for TensorBoard and CSV, else
    ``runs/<name>`` with the logger's own run-name option (MLflow's ``run_name``, W&B's ``name``) or the config's;
    a name that would leave that folder is refused in one line."""
    args = logger.init_args
    if logs_in_folders(logger):
        check_run_names(logger)
        return Path(args.save_dir) / args.name
    key = "run_name" if issubclass(_class(logger.class_path), MLFlowLogger) else "name"
    # Only here, where the user's name becomes a folder: use_run_folder then names the run "<name>/version_N".
    check_name(args.get(key), f"--trainer.logger.init_args.{key}")
    return RUNS / (args.get(key) or default_name)


def next_version(run_root: Path) -> Path:
    """The ``version_N`` folder a new run of this name gets, as TensorBoard numbers them."""
    found = versions(run_root)
    return run_root / f"version_{int(found[-1].name.removeprefix('version_')) + 1 if found else 0}"


def logger_runs(checkpoint: Path) -> list[dict[str, Any]]:
    """The logger runs kept in a checkpoint (``callbacks.logger_runs.LoggerRuns``); none in a sharded one."""
    return [] if checkpoint.is_dir() else load_file(checkpoint, mmap=True).get(CHECKPOINT_KEY) or []


def use_run_folder(config, folder: Path, title: str, kept: list[dict[str, Any]] = (), continues: bool = False) -> None:
    """Points the run of a logger without folders of its own (MLflow, W&B) at ``folder`` and names it ``title``.

    The config, checkpoints and head-load files go to ``folder`` (the trainer's ``default_root_dir``, and the
    checkpoint callbacks' ``dirpath`` where none is given). Of the logger runs ``kept`` with the checkpoint being
    loaded, the one of this logger's kind and store is continued when ``continues`` (``--ckpt_path last``), and is
    the parent of an evaluation's run otherwise. An MLflow logger without a ``tracking_uri`` uses MLflow's own
    default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``): Lightning's, a ``file:`` store, is refused by
    MLflow 3.
    """
    config.trainer.default_root_dir = str(folder)
    checkpoints = str(folder / "checkpoints")
    if config.get("checkpoint") is not None and config.checkpoint.get("dirpath") is None:
        config.checkpoint.dirpath = checkpoints
    callbacks = config.trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if issubclass(_class(callback.class_path), ModelCheckpoint) and callback.init_args.get("dirpath") is None:
            callback.init_args.dirpath = checkpoints
    kind, args = _class(config.trainer.logger.class_path), config.trainer.logger.init_args
    if issubclass(kind, MLFlowLogger):
        import mlflow

        args.tracking_uri = args.tracking_uri or mlflow.get_tracking_uri()
        args.run_name = title
        run = next((run for run in kept if run["logger"] == kind.__name__
                    and run.get("tracking_uri") == args.tracking_uri), None)
        if run is not None and continues:
            args.run_id = run["run_id"]
        elif run is not None:
            args.tags = {**(args.tags or {}), "mlflow.parentRunId": run["run_id"]}  # MLflow nests it under the run
    elif issubclass(kind, WandbLogger):
        # W&B's own files of this run (offline parts, head_load/) in its folder too; absolute, as W&B's service, which
        # all runs of one Python process share, reads a relative folder from the folder it was started in.
        args.save_dir = str(folder.absolute())
        args.name = title
        run = next((run for run in kept if run["logger"] == kind.__name__), None)
        if run is not None and continues:
            args.id = run["run_id"]


__all__ = ["BUDGET_KEYS", "CHANGES_LOG", "CONTINUABLE_KEYS", "RESUME_KEYS", "check_resumable", "check_run_names",
           "checkpoint_problem", "differing_settings", "latest_checkpoint", "latest_loadable_checkpoint", "logger_runs",
           "logs_in_folders", "name_for_budget", "next_version", "read_kept_tokenizer", "record_changes",
           "resolve_init_from", "resolve_source_paths", "run_root", "use_run_folder", "versions"]
