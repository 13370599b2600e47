"""Every use of Lightning's and jsonargparse's private API, in one place, behind names for what they stand for.

The reliability callbacks need a few things Lightning does not expose publicly (when a validation follows a
batch, putting a resumed train loader back at its position, ModelCheckpoint's own saving steps), the progress
bar a fix of its epoch label, the EMA its average's state, and ``moh``'s LightningCLI the step that reads an explicit
checkpoint's settings and an unvalidated parse. Private names may change in any release, so they are all here and
listed in ``PRIVATE_NAMES``; ``tests/callbacks/test_lightning_compat.py`` fails when the installed Lightning or
jsonargparse no longer has one of them or a module elsewhere uses one, and pyproject.toml caps Lightning at the
versions that test has passed on.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, WeightAveraging
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.call import _interrupt

# Import path of every private name used below: ``module.function`` or ``module.Class.attribute`` (attributes set on
# instances included; a keyword-only parameter as ``module.Class.method._parameter``).
PRIVATE_NAMES: tuple[str, ...] = (
    "lightning.fabric.utilities.data._set_sampler_epoch",
    "lightning.pytorch.loops.fit_loop._FitLoop._data_fetcher",
    "lightning.pytorch.loops.fit_loop._FitLoop._combined_loader",
    "lightning.pytorch.loops.fit_loop._FitLoop._combined_loader_states_to_load",
    "lightning.pytorch.loops.fit_loop._FitLoop._load_combined_loader_states",
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._should_check_val_fx",
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._should_accumulate",
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._batches_that_stepped",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._should_skip_saving_checkpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._monitor_candidates",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._save_topk_checkpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._save_last_checkpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._every_n_train_steps",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._last_global_step_saved",
    "lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar._get_train_description",
    "lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar._update",
    "lightning.pytorch.trainer.trainer.Trainer._signal_connector",
    "lightning.pytorch.trainer.call._interrupt",
    "lightning.pytorch.strategies.ddp.DDPStrategy._timeout",
    "lightning.pytorch.trainer.trainer.Trainer._logger_connector",
    "lightning.pytorch.cli.LightningCLI._parse_ckpt_path",
    "lightning.pytorch.cli.LightningCLI._parser",
    "lightning.pytorch.core.module.LightningModule._trainer",
    "lightning.pytorch.callbacks.weight_averaging.WeightAveraging._average_model",
    "lightning.pytorch.callbacks.weight_averaging.WeightAveraging._latest_update_step",
    "lightning.pytorch.callbacks.weight_averaging.WeightAveraging._use_buffers",
    "jsonargparse.ArgumentParser.parse_args._skip_validation",
)


def validation_follows_batch(trainer: Trainer) -> bool:
    """Whether the fit loop runs a validation right after the current training batch (``val_check_interval``)."""
    fit_loop = trainer.fit_loop
    return fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher)


def accumulates_gradients(trainer: Trainer) -> bool:
    """Whether the current batch only accumulates gradients, with no optimizer step after it (gradient accumulation)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def restore_train_loader_position(trainer: Trainer) -> None:
    """Puts the train loader at the position saved in the resumed checkpoint, if Lightning has not applied it yet."""
    fit_loop = trainer.fit_loop
    if fit_loop._combined_loader_states_to_load and fit_loop._data_fetcher is not None:
        # The steps Lightning takes when it builds the train loader (_FitLoop.setup_data, on_advance_start):
        # load the states, set the samplers' epoch, and recreate the iterator so that it starts there.
        fit_loop._load_combined_loader_states()
        for loader in fit_loop._combined_loader.flattened:
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        iter(fit_loop._data_fetcher)


def skips_saving(callback: ModelCheckpoint, trainer: Trainer) -> bool:
    """Whether ModelCheckpoint saves nothing now: fast_dev_run, not fitting, sanity check, or this step saved."""
    return callback._should_skip_saving_checkpoint(trainer)


def every_n_train_steps(callback: ModelCheckpoint) -> int:
    """The callback's ``every_n_train_steps`` (0 when it does not save by steps)."""
    return callback._every_n_train_steps


def last_saved_step(callback: ModelCheckpoint) -> int:
    """The global step at which the callback last wrote a checkpoint (0 before its first)."""
    return callback._last_global_step_saved


def save_topk_and_last(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """What ModelCheckpoint saves at a due step: the top-k checkpoint, then ``last.ckpt``."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def save_last(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Writes ``last.ckpt`` now, as ModelCheckpoint does with ``save_last=True``."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def train_loader_states(checkpoint: dict[str, Any]) -> list | None:
    """The train loaders' states in a checkpoint dict (``_FitLoop.on_save_checkpoint``'s ``combined_loader``)."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")


def set_train_loader_states(checkpoint: dict[str, Any], states: list) -> None:
    """Replaces the train loaders' states in a loaded checkpoint dict, before Lightning restores the loops from it."""
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = states


def logging_step(trainer: Trainer) -> int:
    """The step Lightning logs training metrics at: the optimizer steps counted so far (``_batches_that_stepped``),
    which it counts for a batch only after the batch's validation."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_logging_step(trainer: Trainer, step: int) -> None:
    """Makes Lightning log what follows at ``step``: an evaluation of a checkpoint at the step it was saved at."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def logs_this_step(trainer: Trainer) -> bool:
    """Whether Lightning hands the loggers this training step's metrics (every ``log_every_n_steps`` steps, and at a
    stop): the steps at which a callback may read the device without making the host wait on it more often."""
    return trainer._logger_connector.should_update_logs


@contextmanager
def logging_step_as(trainer: Trainer, step: int) -> Iterator[None]:
    """``logging_step`` set to ``step`` for what runs inside (a checkpoint written then keeps it), then restored."""
    loop = trainer.fit_loop.epoch_loop
    kept, loop._batches_that_stepped = loop._batches_that_stepped, step
    try:
        yield
    finally:
        loop._batches_that_stepped = kept


def request_stop(trainer: Trainer) -> None:
    """Sets the flag Lightning's SIGTERM handler sets: its loops stop after the current batch (``SIGTERMException``)."""
    trainer._signal_connector.received_sigterm = True


def interrupt(trainer: Trainer, exception: BaseException) -> None:
    """What ``Trainer.fit`` does with an exception before re-raising it: the callbacks' and the data module's
    ``on_exception``, the strategy's, and the loggers finalized as failed."""
    _interrupt(trainer, exception)


def collective_timeout(strategy: Strategy) -> timedelta | None:
    """The timeout a distributed strategy (DDP, FSDP, DeepSpeed, model parallel) gives its process group, if any."""
    return getattr(strategy, "_timeout", None)


def set_collective_timeout(strategy: Strategy, timeout: timedelta) -> None:
    """Sets it; the process group is created with it when the strategy sets up (after launching)."""
    strategy._timeout = timeout


class CheckpointSettingsCLI(LightningCLI):
    """LightningCLI whose reading of an explicit ``ckpt_path``'s saved settings into the config (its private
    ``_parse_ckpt_path``, run after parsing and before the classes are built) is ``checkpoint_settings_into_config``,
    for a subclass to override."""

    def checkpoint_settings_into_config(self) -> None:
        super()._parse_ckpt_path()

    def _parse_ckpt_path(self) -> None:
        self.checkpoint_settings_into_config()


def subcommand_parser(cli: LightningCLI, subcommand: str | None) -> LightningArgumentParser:
    """The parser of one subcommand (``fit``), which dumps that subcommand's config."""
    return cli._parser(subcommand)


def attached_trainer(module: LightningModule) -> Trainer | None:
    """The Trainer a LightningModule is attached to, None when it is not (``module.trainer`` raises then)."""
    return module._trainer


def parse_unvalidated(parser: LightningArgumentParser, args: list[str]):
    """What ``args`` name, without the defaults and unvalidated: a class named without its required arguments
    (``--trainer.logger CSVLogger``) is whole only with them."""
    return parser.parse_args(args, defaults=False, _skip_validation=True)


def averaged_model(callback: WeightAveraging) -> torch.nn.Module:
    """The callback's ``AveragedModel``: the average in ``.module``, its update count in ``.n_averaged``."""
    return callback._average_model


def averages_buffers(callback: WeightAveraging) -> bool:
    """Whether the buffers are averaged with the parameters (``use_buffers``) rather than copied."""
    return callback._use_buffers


def latest_update_step(callback: WeightAveraging) -> int:
    """The global step of the last update, 0 before the first; kept in the checkpoint."""
    return callback._latest_update_step


def set_latest_update_step(callback: WeightAveraging, step: int) -> None:
    callback._latest_update_step = step


class MoHRichProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, with the run's progress where its length is a number of steps, without the
    logger's version number among the metrics, and with the metrics read at the logging steps only.

    Where epochs are unlimited (``max_epochs: -1``) and ``max_steps`` ends training (the DiT configs, a language
    model's token budget), Lightning 2.6 counts the batches of the current epoch ("Epoch 12 120/282" of a
    10,000-step run) and labels it "Epoch 12/-2" (2.7: "Epoch 12", PR 21924); this bar counts the run's optimizer steps
    against ``max_steps`` ("Epoch 12, step 3504/10000"), from where a resumed run starts. Its clock and rate run on
    across epochs, from this process's first step (Lightning restarts both at each epoch): elapsed is the time since,
    it/s the steps of the last 30 s over their time (validations included), and a resumed run's earlier steps count as
    where the bar starts, not as steps made now (a run once read "1163/2000 0:00:15 • 0:00:01 3670.26it/s" after eight
    minutes).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shown_metrics: dict[str, Any] = {}  # the metrics of the last logging step

    def counts_steps(self) -> bool:
        """Whether ``max_steps`` ends the run (epochs unlimited): the bar then counts steps, not an epoch's batches."""
        trainer = self.trainer
        return trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self.counts_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs != -1:
            return super()._get_train_description(current_epoch)
        label = f"Epoch {current_epoch}, step" if self.counts_steps() else f"Epoch {current_epoch}"
        # Padded to the validation bar's label, as Lightning pads it, so the bars do not flicker.
        return label.ljust(len(self.validation_description))

    def on_train_epoch_start(self, trainer: Trainer, pl_module) -> None:
        if not self.counts_steps() or self.progress is None or self.train_progress_bar_id is None:
            super().on_train_epoch_start(trainer, pl_module)
            if self.counts_steps() and self.progress is not None and self.train_progress_bar_id is not None:
                # A resumed run's steps so far are where the bar starts: no sample of the rate, no time.
                self.progress.reset(self.train_progress_bar_id, completed=trainer.global_step)
            return
        # A later epoch: the same bar, clock and rate; Lightning's reset would restart them at zero.
        self.progress.update(self.train_progress_bar_id, description=self._get_train_description(trainer.current_epoch))
        self.refresh()

    def _update(self, progress_bar_id, current: int, visible: bool = True, hard: bool = False) -> None:
        # Lightning puts the training bar at the epoch's batch; one counting steps goes to the run's step instead,
        # in one update: a second one, back from the batch to the step, would count every step so far as made now.
        if self.counts_steps() and progress_bar_id is not None and progress_bar_id == self.train_progress_bar_id:
            current = self.trainer.global_step
        super()._update(progress_bar_id, current, visible, hard)

    def get_metrics(self, trainer: Trainer, pl_module) -> dict[str, Any]:
        # Reading the logged values waits for the device (each tensor's .item()): during training they are read at
        # the logging steps only, as the loggers read them, and the bar shows those until the next one.
        if trainer.training and not logs_this_step(trainer):
            return self.shown_metrics
        # The logger's version ("v_num: 0") is the run folder's number, which the run's first line and summary name.
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        if trainer.validating and trainer.state.fn == "fit" and not trainer.sanity_checking:
            # A validation within fit ends after the last logging step: the bar shows its values from now on.
            self.shown_metrics = {**self.shown_metrics, **metrics}
        if trainer.training:
            logged = trainer.callback_metrics
            metrics.update({name: float(logged[name]) for name in getattr(pl_module, "progress_bar_train_metrics", ())
                            if name in logged})
            self.shown_metrics = metrics
        return metrics
