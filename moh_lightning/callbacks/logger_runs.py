"""Each logger's run, continued by a resumed fit: its identity kept with the checkpoint, its folder, its end lines.

TensorBoard and CSV log into a folder of their own, ``<save_dir>/<name>/version_N/``, which is the run folder. MLflow
(a database or a tracking server) and Weights & Biases keep their runs elsewhere; ``moh`` gives such a run a folder
of the same shape (``runs/<name>/version_N/``, the trainer's ``default_root_dir``) for its config, checkpoints and
head-load files, and keeps the logger's run id in every checkpoint (``LoggerRuns``), as the TensorBoard run is
kept by the folder the checkpoint is in: ``moh fit --ckpt_path last`` logs into that same run again.

A resumed fit repeats the steps between its checkpoint and the interruption. Those are not logged again: the run
folder's ``logged_steps.json`` holds, for each logger and metric (and head-load image), the last step logged, and a
resumed run logs a metric only at later steps. It is the one rule every logger can follow (MLflow and W&B cannot
delete logged values); a resume that is bit-exact (the suite's, unless the loader workers changed) would log the same
values again, so nothing is lost.
"""
from __future__ import annotations

import csv
import functools
import json
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from moh_lightning import lightning_compat as compat

log = logging.getLogger(__name__)

FOLDER_LOGGERS = (TensorBoardLogger, CSVLogger)  # loggers whose own version folder is the run folder
LEDGER = "logged_steps.json"
CHECKPOINT_KEY = "logger_runs"


def run_folder(trainer: Trainer) -> Path | None:
    """The run's own folder: a TensorBoard or CSV logger's version folder, else the trainer's ``default_root_dir``
    (which ``moh`` points at ``runs/<name>/version_N/``); None without a logger (or under ``fast_dev_run``), when a
    run writes nothing. Call it on every rank: the folder is broadcast from rank 0, which would otherwise wait."""
    first = trainer.loggers[0] if trainer.loggers else None
    folder = first.log_dir if isinstance(first, FOLDER_LOGGERS) else trainer.default_root_dir
    folder = trainer.strategy.broadcast(folder)
    if folder is None or all(isinstance(logger, DummyLogger) for logger in trainer.loggers):
        return None
    return Path(folder)


def identity(logger: Logger) -> dict[str, Any]:
    """What names ``logger``'s run, as kept in a checkpoint: its kind, and the run id and store where it has one."""
    kind = {"logger": type(logger).__name__}
    if isinstance(logger, MLFlowLogger):
        return {**kind, "run_id": logger.run_id, "tracking_uri": logger.experiment.tracking_uri}
    if isinstance(logger, WandbLogger):
        return {**kind, "run_id": logger.version, "project": logger.name}
    return {**kind, "version": logger.version}


def describe(logger: Logger, pinned: Sequence[str] = ()) -> list[str]:
    """The end summary's lines naming ``logger``'s run, and where to open it; ``pinned``: the scalar tags a
    TensorBoard link pins above the rest."""
    if isinstance(logger, MLFlowLogger):
        run = logger.experiment.get_run(logger.run_id)
        uri = logger.experiment.tracking_uri
        page = f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        if urlparse(uri).scheme in ("http", "https"):
            return [f"MLflow run:  {run.info.run_name} ({run.info.run_id}), {uri.rstrip('/')}/{page}"]
        return [f"MLflow run:  {run.info.run_name} ({run.info.run_id}) in {uri}; "
                f"`mlflow ui --backend-store-uri {uri}` serves it at http://127.0.0.1:5000/{page}"]
    if isinstance(logger, WandbLogger):
        run = logger.experiment
        if run.offline:
            return [f"W&B run:     {run.name} ({run.id}, offline) in {Path(run.dir).parent}; `wandb sync "
                    f"{Path(run.dir).parent.parent}/offline-run-*-{run.id}` uploads it with any earlier part"]
        return [f"W&B run:     {run.name} ({run.id}), {run.url}"]
    if isinstance(logger, TensorBoardLogger):
        # The save folder, not this run's: the run opens beside its siblings (a MoH run and its dense baseline).
        lines = [f"dashboards:  tensorboard --logdir {Path(logger.save_dir)}"]
        if pinned:
            lines.append(f"             then {time_series_link(pinned)} ({', '.join(pinned)} pinned, unsmoothed)")
        return lines
    if isinstance(logger, CSVLogger):
        return [f"metrics:     {Path(logger.log_dir) / 'metrics.csv'}"]
    return []


def time_series_link(tags: Sequence[str], address: str = "http://localhost:6006/") -> str:
    """TensorBoard's Time Series with ``tags`` pinned at the top and smoothing off, through its own deep-link
    parameters (``pinnedCards``, ``smoothing``). Time Series sorts its card groups by tag and opens the first two,
    which are ``epoch`` and ``head_load`` and leave ``train/`` and ``val/`` closed below them; and its default
    smoothing, over a handful of validation points, can rank two runs against their last values."""
    cards = json.dumps([{"plugin": "scalars", "tag": tag} for tag in tags], separators=(",", ":"))
    return f"{address}?pinnedCards={quote(cards, safe='')}&smoothing=0#timeseries"


class _Ledger:
    """The last step at which each metric of one logger run was logged, kept in the run folder's
    ``logged_steps.json`` under the logger's kind and, for MLflow and W&B, its run id (another run of theirs in the
    same folder, as with a ``default_root_dir`` given by hand, starts with nothing logged).

    ``earlier`` holds what the run's earlier parts logged (read once, when this part starts), ``logged`` adds this
    part's; the file, ``saved`` (shared by the loggers of one run), is rewritten when a logger saves or finalises
    (after it has written what it was given).
    """

    def __init__(self, path: Path, saved: dict[str, dict[str, int]], logger: Logger) -> None:
        run = identity(logger)
        key = " ".join(str(run[part]) for part in ("logger", "run_id") if part in run)
        self.path, self.saved = path, saved
        self.earlier: dict[str, int] = dict(saved.get(key, {}))
        self.logged = saved.setdefault(key, {})

    def new(self, key: str, step: int | None) -> bool:
        return step is None or step > self.earlier.get(key, -1)

    def record(self, keys, step: int | None) -> None:
        if step is not None:
            self.logged.update({key: max(step, self.logged.get(key, -1)) for key in keys})

    def write(self) -> None:
        if not self.path.parent.is_dir():
            return  # the run folder of a run that failed before its first step, removed (RunSummary): nothing to keep
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(self.saved, indent=1, sort_keys=True))
        os.replace(partial, self.path)


_LEDGERS: weakref.WeakKeyDictionary[Logger, _Ledger] = weakref.WeakKeyDictionary()


def logged_earlier(logger: Logger, key: str, step: int) -> bool:
    """Whether an earlier part of this run logged ``key`` at ``step`` or later (a resumed run repeats those steps)."""
    ledger = _LEDGERS.get(logger)
    return ledger is not None and not ledger.new(key, step)


def record_logged(logger: Logger, key: str, step: int) -> None:
    """Notes that ``key`` (an image, say, which ``log_metrics`` does not see) was logged at ``step``."""
    ledger = _LEDGERS.get(logger)
    if ledger is not None:
        ledger.record([key], step)


def _follow_logged_steps(logger: Logger, path: Path, saved: dict[str, dict[str, int]]) -> None:
    """Wraps ``logger``'s ``log_metrics`` to drop what an earlier part of the run logged, and its ``save`` and
    ``finalize`` to keep the ledger. On the instance, since every caller (Lightning's loop, callbacks, W&B's own
    ``log_image``) reaches the logger through it, and a wrapping logger would not be the kind Lightning checks for."""
    ledger = _LEDGERS[logger] = _Ledger(path, saved, logger)
    log_metrics, save, finalize = logger.log_metrics, logger.save, logger.finalize

    @functools.wraps(log_metrics)
    def log_new_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
        metrics = {key: value for key, value in metrics.items() if ledger.new(key, step)}
        if metrics:
            log_metrics(metrics, step)
            ledger.record(metrics, step)

    @functools.wraps(save)
    def save_and_record() -> None:
        save()
        ledger.write()

    @functools.wraps(finalize)
    def finalize_and_record(status: str) -> None:
        finalize(status)
        ledger.write()

    logger.log_metrics, logger.save, logger.finalize = log_new_metrics, save_and_record, finalize_and_record


def _keep_first_params(logger: MLFlowLogger) -> None:
    """Leaves out, with a warning, each param whose value differs from the one the MLflow run already holds.

    MLflow refuses a second value of a param, so a run continued with, say, other loader workers (a change
    ``moh`` allows, and lists in the run folder's ``resumes.log``) would stop at Lightning's hyper-parameters. Wrapped
    on the logger's own client, which Lightning and the head-load adapter log params through.
    """
    client = logger.experiment
    log_batch = client.log_batch

    @functools.wraps(log_batch)
    def log_batch_keeping_params(run_id: str, metrics=(), params=(), tags=(), **kwargs) -> None:
        held = client.get_run(run_id).data.params if params else {}
        changed = [param for param in params if held.get(param.key, param.value) != param.value]
        if changed:
            log.warning("MLflow keeps the first value of a run's params: %s", ", ".join(
                f"{param.key} stays {held[param.key]} (this part runs with {param.value})" for param in changed))
        log_batch(run_id, metrics=metrics, params=[param for param in params if param not in changed], tags=tags,
                  **kwargs)

    client.log_batch = log_batch_keeping_params


@rank_zero_only
def keep_csv_rows(loggers: list[Logger]) -> None:
    """Keeps the rows of a CSV logger's ``metrics.csv`` when a run continues in its folder.

    Lightning's CSV writer deletes the file it finds in its folder when it starts, and so all that a resumed run had
    logged before; the rows are read first and handed back to the writer, which writes them out again with its next.
    """
    for logger in loggers:
        if not isinstance(logger, CSVLogger) or not Path(logger.log_dir, "metrics.csv").is_file():
            continue
        with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
            rows = list(csv.DictReader(file))
        writer = logger.experiment  # deletes the file
        for row in rows:
            values = {key: value for key, value in row.items() if key != "step" and value not in ("", None)}
            writer.log_metrics(values, int(row["step"]))
        writer.save()


class SaveRunConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml``, written into the run folder (``run_folder``) whatever the logger.

    Lightning's writes into ``trainer.log_dir``, which an MLflow logger on a database or a tracking server does not
    have (Lightning then stops on a bare ``AssertionError``), and which is a W&B logger's shared ``save_dir``.
    A run without a run folder (no logger, ``fast_dev_run``) writes none. A training run's data module first copies
    into the run folder what it reads from local folders (``keep_in_run_folder``: a tokenizer), and the config
    records the copy.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        folder = run_folder(trainer)
        if folder is not None and trainer.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            keep = getattr(trainer.datamodule, "keep_in_run_folder", None)
            if stage == "fit" and keep is not None:
                for key, value in keep(folder).items():
                    self.config.data.init_args[key] = value
            config = self.config.clone()
            if "ckpt_path" in config:
                # The checkpoint a run started from is no setting of the run: kept here, the config read back
                # (`moh fit --config <run>/config.yaml` under a new name) would silently continue that checkpoint,
                # a relative path resolving in whichever folder it is run from. resumes.log records resumes.
                config.ckpt_path = None
            self.parser.save(config, str(folder / self.config_filename), skip_none=False,
                             overwrite=self.overwrite, multifile=self.multifile)
        self.already_saved = True


class LoggerRuns(Callback):
    """Keeps each logger's run with every checkpoint, and makes a resumed fit continue it without repeating a step.

    Every checkpoint holds ``logger_runs``: each logger's kind and run (``identity``), which ``moh fit --ckpt_path
    last`` reads to log into the same MLflow or W&B run again. Every logger then skips what an earlier part of the
    run logged (see the module's docstring); an MLflow run stopped by the interruption (``FAILED``) is running again
    while it continues, and keeps its params' first values. An evaluation of a checkpoint is logged at the step the
    checkpoint was saved at.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        folder = run_folder(trainer)
        if folder is None or not trainer.is_global_zero:
            return
        path = folder / LEDGER
        saved = json.loads(path.read_text()) if path.is_file() else {}
        for logger in trainer.loggers:
            if logger in _LEDGERS:  # set up by an earlier stage of this trainer
                continue
            _follow_logged_steps(logger, path, saved)
            if isinstance(logger, MLFlowLogger):
                _keep_first_params(logger)
                if logger.experiment.get_run(logger.run_id).info.status != "RUNNING":
                    logger.experiment.update_run(logger.run_id, status="RUNNING")

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning restores the trainer's step only to continue a fit, so `moh validate` / `moh test` of a step-176
        # checkpoint would log its metrics at step 0; they belong at the step of the weights they scored, as the
        # fit's own validations are.
        if trainer.state.fn != TrainerFn.FITTING and "global_step" in checkpoint:
            compat.set_logging_step(trainer, int(checkpoint["global_step"]))

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            checkpoint[CHECKPOINT_KEY] = [identity(logger) for logger in trainer.loggers
                                          if not isinstance(logger, DummyLogger)]


__all__ = ["CHECKPOINT_KEY", "FOLDER_LOGGERS", "LEDGER", "LoggerRuns", "SaveRunConfig", "describe", "identity",
           "keep_csv_rows", "logged_earlier", "record_logged", "run_folder"]
