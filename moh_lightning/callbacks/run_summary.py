"""What a ``moh fit`` leaves: the lines a finished run ends on (where the run went, how it did, the head budget it
used), and no empty run folder from a run that failed before its first step."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from moh_lightning.callbacks.head_load import HeadLoadCallback
from moh_lightning.callbacks.logger_runs import FOLDER_LOGGERS, LEDGER, describe, run_folder
from moh_lightning.callbacks.reliability import StepCheckpoint
from moh_lightning.layers import activated_head_fraction, moh_layers


class RunSummary(Callback):
    """Prints a short summary when ``fit`` ends, below the progress bar.

    The run folder; the monitored metric's best and final value and the checkpoint holding the best (the first
    ``ModelCheckpoint`` with a metric to monitor; else the final ``val/loss`` and ``last.ckpt``); the head budget
    the model used (share of heads active per token, routed heads that collapsed); and each logger's run with where
    to open it (the ``tensorboard`` command, the MLflow run's page, the W&B run or how to upload an offline one).

    A fresh run that fails before its first step (a missing folder, a bad value found in ``setup``, Ctrl-C) has
    written only what every run writes at its start: its events file, ``config.yaml``, ``hparams.yaml`` and the
    logged-steps ledger. Those are
    removed with the then empty folder, so the next run takes its number and ``--ckpt_path last`` finds no empty
    run; a folder holding anything else, and a resumed run's, stay. So is the folder of a failed evaluation
    (``moh validate`` / ``test`` / ``predict``: ``<run>/eval/<subcommand>-<checkpoint>/`` or a new version).
    """

    def __init__(self) -> None:
        super().__init__()
        self._lines: list[str] = []

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = run_folder(trainer)  # a broadcast from rank 0 under DDP / FSDP: every rank must ask
        if trainer.is_global_zero and not trainer.fast_dev_run:
            self._lines = summary_lines(trainer, pl_module, folder)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # An evaluation (`moh validate`, `test`, `predict`) logs into a folder of its own, new at each call.
        fresh = (trainer.state.fn in ("validate", "test", "predict")
                 or (trainer.state.fn == "fit" and trainer.global_step == 0 and not trainer.ckpt_path))
        if not fresh or not trainer.is_global_zero:
            return
        board = next((logger for logger in trainer.loggers if isinstance(logger, FOLDER_LOGGERS)), None)
        folder = Path(board.log_dir) if board is not None else None
        if folder is None or not folder.is_dir():
            return
        entries = list(folder.iterdir())
        events = [entry for entry in entries if entry.name.startswith("events.out.tfevents.")]
        tensorboard = isinstance(board, TensorBoardLogger)
        # TensorBoard's one events file, this run's: a folder another run wrote into (an explicit version) has two or
        # more. CSV writes its metrics.csv only when a metric is logged.
        if len(events) != int(tensorboard) or any(entry.name not in ("config.yaml", "hparams.yaml", LEDGER)
                                                  for entry in entries if entry not in events):
            return
        if tensorboard:
            board.experiment.close()  # the logger's finalize, next, writes nothing more into a closed writer
        for entry in entries:
            entry.unlink()
        folder.rmdir()
        if folder.parent != Path(board.save_dir) and not any(folder.parent.iterdir()):
            folder.parent.rmdir()  # runs/<name>/ of a name's first run

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._lines:
            # Rich's bar draws its last frame when it stops, in its own teardown, which may come after this one:
            # stopped here first (stopping twice is harmless), it stays above the summary.
            if trainer.progress_bar_callback is not None:
                trainer.progress_bar_callback.teardown(trainer, pl_module, stage)
            print("\n".join(self._lines))
            self._lines = []


def head_budget(model, collapsed: list[tuple[int, int]]) -> str:
    """The summary's head-budget line: the share of heads each token uses, and the layers that route among heads (the
    ones the head-load dashboards draw; a MoH layer whose heads are all shared only weights them)."""
    budget = f"{activated_head_fraction(model):.1%} of heads active per token"
    layers = moh_layers(model)
    routed = [layer for layer in layers if layer.router.num_routed_heads]
    if not routed:
        return budget + " (dense: no routed layer)"
    shown = ", ".join(f"layer {layer} head {head}" for layer, head in collapsed)
    count = f"{len(routed)} routed layers" + (f" of {len(layers)} MoH layers" if len(routed) < len(layers) else "")
    return budget + f", {count}; collapsed heads: {shown or 'none'}"


def summary_lines(trainer: Trainer, pl_module: LightningModule, folder: Path | None) -> list[str]:
    """The summary's lines (see ``RunSummary``); ``folder`` is the run folder (``logger_runs.run_folder``)."""
    # current_epoch counts the epochs begun once fit ends (a stop mid-epoch counts that epoch); the progress bar and
    # the checkpoint names number them from 0.
    lines = [f"moh fit finished at step {trainer.global_step} (epoch {max(trainer.current_epoch - 1, 0)})."]
    if folder is not None:
        lines.append(f"  run folder:  {folder}")
    lines.append(f"  {_metric_line(trainer)}")
    model = getattr(pl_module, "model", None) or pl_module
    collapsed = next((cb.collapsed_heads for cb in trainer.callbacks if isinstance(cb, HeadLoadCallback)), [])
    lines.append(f"  head budget: {head_budget(model, collapsed)}")
    if folder is not None:
        monitored = _monitored_checkpoint(trainer)
        pinned = [tag for tag in ("train/loss", monitored.monitor if monitored else "val/loss")
                  if tag in trainer.callback_metrics]
        lines += [f"  {line}" for logger in trainer.loggers for line in describe(logger, pinned)]
    return lines


def _monitored_checkpoint(trainer: Trainer) -> ModelCheckpoint | None:
    """The checkpoint that keeps the run's best by a metric, if any."""
    return next((cb for cb in trainer.checkpoint_callbacks
                 if isinstance(cb, ModelCheckpoint) and not isinstance(cb, StepCheckpoint) and cb.monitor), None)


def _metric_line(trainer: Trainer) -> str:
    monitored = _monitored_checkpoint(trainer)
    if monitored is not None:
        name, best = monitored.monitor, monitored.best_model_score
        final = _value(trainer.callback_metrics.get(name))
        best_text = f"best {best.item():.4g} ({monitored.best_model_path})" if best is not None else "no best yet"
        return f"{name}: final {final}, {best_text}"
    last = next((cb.last_model_path for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
                 and cb.last_model_path), None)
    name = "val/loss" if "val/loss" in trainer.callback_metrics else None
    shown = f"{name}: final {_value(trainer.callback_metrics.get(name))}" if name else "no validation metric"
    return f"{shown} (no metric monitored); last checkpoint: {last or 'none written'}"


def _value(tensor) -> str:
    return "not logged" if tensor is None else f"{float(tensor):.4g}"


__all__ = ["RunSummary", "head_budget", "summary_lines"]
