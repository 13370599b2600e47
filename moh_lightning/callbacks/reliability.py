"""Callbacks that let a long run survive: resumable checkpoints, an exact mid-epoch resume, a stop on NaN loss."""
from __future__ import annotations

import random
import signal
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from moh_lightning import lightning_compat as compat
from moh_lightning.callbacks.shutdown import say, stop_signal
from moh_lightning.callbacks.watchdog import newest_checkpoint
from moh_lightning.data.loaders import saved_worker_count


class StepCheckpoint(ModelCheckpoint):
    """Checkpoints every ``every_n_train_steps`` steps, keeping the newest ``keep``, plus ``last.ckpt``.

    ``last.ckpt`` is rewritten at every save and at the end of fit. ``dirpath`` defaults to the run folder's
    ``checkpoints/`` (``runs/<name>/version_N/checkpoints``), where ``moh fit --ckpt_path last`` looks for it.

    SIGTERM (cloud preemption, ``kill``, a container or job stop) and, under ``moh fit``, Ctrl-C: the signal is only
    recorded (``trainer.received_sigterm``; ``shutdown.RunShutdown`` ends the run if no step ends in time) and
    Lightning's loops raise ``SIGTERMException`` after the current batch. This callback writes ``last.ckpt`` at the
    end of that batch (after every other callback's ``on_train_batch_end``, EMA included, as Lightning runs
    checkpoint callbacks last), and turns the exit into a non-zero one (``EXIT_CODE``, 128 + SIGTERM as a shell
    reports a process the signal ended; 130 for Ctrl-C's SIGINT) with one line naming the step and the file.
    ``--ckpt_path last`` then continues exactly; the validation due after that step, if any, is not run (Lightning
    cuts it short on SIGTERM).
    """

    EXIT_CODE = 128 + signal.SIGTERM

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 1000, keep: int = 3) -> None:
        if every_n_train_steps < 1 or keep < 1:
            raise ValueError(f"StepCheckpoint every_n_train_steps={every_n_train_steps} and keep={keep} must both "
                             f"be at least 1.")
        super().__init__(dirpath=dirpath, filename="{step:07d}", monitor="step", mode="max", save_top_k=keep,
                         every_n_train_steps=every_n_train_steps, save_last=True, enable_version_counter=False)
        self._logging_step: int | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._logging_step = compat.logging_step(trainer)
        if _sigterm_received(trainer):
            self._save_if_due(trainer, stopping=True)
        # When a validation follows this batch, save after it instead: resuming from a checkpoint written before
        # it, Lightning skips that validation, so a run killed during it would never log it.
        elif not compat.validation_follows_batch(trainer):
            self._save_if_due(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logging_step = None  # Lightning's checkpoints at an epoch's end hold the count with its last batch

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._save_if_due(trainer)

    def _save_if_due(self, trainer: Trainer, stopping: bool = False) -> None:
        if compat.skips_saving(self, trainer) or stopping and compat.accumulates_gradients(trainer):
            return  # (mid-accumulation a checkpoint would lose the gradients accumulated so far)
        if trainer.global_step % compat.every_n_train_steps(self) == 0:
            compat.save_topk_and_last(self, trainer)
        elif stopping or _stops_after_this_batch(trainer):
            # The final `last` is written here rather than in on_train_end: by then EMAWeightAveraging has copied
            # the average over the training weights, and a run resumed from it (with a larger max_steps) would
            # train on from the average instead of the weights.
            compat.save_last(self, trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.fast_dev_run:  # no run folder: ModelCheckpoint's own end-of-fit `last` would land in the cwd
            return
        super().on_train_end(trainer, pl_module)
        # Any other stop (max_time, ...): ModelCheckpoint saves `last` at the end only if it never saved before,
        # which would lose the steps after the last multiple of every_n_train_steps.
        if compat.last_saved_step(self) != trainer.global_step:
            compat.save_last(self, trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        if not isinstance(exception, SIGTERMException):
            return
        # The signal came after this step's on_train_batch_end (during its validation, say): save now, on one
        # process. Under DDP the ranks may be at different points here, and saving gathers from all of them.
        if trainer.world_size == 1 and not compat.skips_saving(self, trainer) \
                and not compat.accumulates_gradients(trainer):
            # A signal heard after the validation has ended comes after Lightning counted the step for its loggers;
            # its checkpoints within an epoch hold the count before that, and a resumed run adds it: written with
            # the count the step ended with, or the resumed run would log every later step one step late.
            step = self._logging_step if self._logging_step is not None else compat.logging_step(trainer)
            with compat.logging_step_as(trainer, step):
                compat.save_last(self, trainer)
        saved, stopped_by = compat.last_saved_step(self), stop_signal()
        if saved == trainer.global_step and self.last_model_path:
            message = (f"moh: stopped by {stopped_by.name} after step {saved}; saved {self.last_model_path}. Continue "
                       f"with the same command and --ckpt_path last.")
        else:
            message = (f"moh: stopped by {stopped_by.name} at step {trainer.global_step} without a new checkpoint; "
                       f"the newest is {newest_checkpoint(trainer)}. Continue with the same command and --ckpt_path "
                       f"last.")
        if trainer.is_global_zero:
            say(message)
        # Lightning re-raises this very exception after the callbacks' on_exception: a SystemExit whose code is
        # None, which would end the process with 0 as if training had finished.
        exception.code = 128 + stopped_by


def _sigterm_received(trainer: Trainer) -> bool:
    """Whether any rank received SIGTERM: all ranks then save at this same step (saving gathers from all), and stop
    after it (Lightning stops where the flag is set; a rank on another node may not have had the signal)."""
    received = trainer.received_sigterm
    if trainer.world_size > 1:
        received = trainer.strategy.reduce_boolean_decision(received, all=False)
        if received and not trainer.received_sigterm:
            compat.request_stop(trainer)
    return received


def _stops_after_this_batch(trainer: Trainer) -> bool:
    """Whether fit ends after the current batch: max_steps reached, a stop requested, or the last epoch's end."""
    if compat.accumulates_gradients(trainer):
        return False
    last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
    return (0 <= trainer.max_steps <= trainer.global_step or trainer.should_stop
            or last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


class ExactResumeCallback(Callback):
    """Makes a resumed fit continue exactly where the checkpoint was written, mid-epoch included.

    Saves every rank's torch, CUDA, numpy and python random states in each checkpoint: timm's RandAugment and
    Random Erasing draw from python's ``random``, Mixup from numpy, crops and DropPath from torch. On resume,
    when training starts, it puts the train loader back at its saved position if Lightning has not (see
    ``on_train_start``), then restores the random states: after the loaders have drawn their seeds and right
    before the first batch is drawn, the point in the random streams at which the checkpoint was written.
    Needs a stateful train loader (torchdata's ``StatefulDataLoader``) and as many ranks as when saved.

    Under DDP Lightning writes rank 0's checkpoint dict only, so its train-loader state (the position, and with
    loader workers each worker's random states) would be every rank's on resume. Each rank's loader state is
    therefore gathered into the checkpoint too, and each rank resumes from its own.
    """

    KEY = "rng_states"
    LOADERS_KEY = "train_loader_states_per_rank"

    def __init__(self) -> None:
        super().__init__()
        self._to_restore: dict[str, Any] | None = None
        self._before_validation: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Saved during a validation (a stop signal there): training continues from the states before it, as
        # on_validation_end would have restored them.
        own = self._before_validation if self._before_validation is not None else _rng_states()
        if trainer.world_size == 1:
            checkpoint[self.KEY] = [own]
            return
        gathered = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, (own, compat.train_loader_states(checkpoint)))
        checkpoint[self.KEY] = [states for states, _ in gathered]
        checkpoint[self.LOADERS_KEY] = [loaders for _, loaders in gathered]

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(self.KEY)
        if states is None:
            return
        if len(states) != trainer.world_size:
            raise ValueError(f"The checkpoint holds random states of {len(states)} processes but this run has "
                             f"{trainer.world_size}: resume with the same number of devices and nodes.")
        self._to_restore = states[trainer.global_rank]
        loaders = checkpoint.get(self.LOADERS_KEY)
        if loaders is not None and loaders[trainer.global_rank] is not None:
            compat.set_train_loader_states(checkpoint, loaders[trainer.global_rank])
        # A run resumed with another number of loader workers (allowed: it is how the run goes, not what it is)
        # cannot take the saved position: the rest of that epoch is drawn afresh, as `moh fit` said when resuming.
        workers = (getattr(trainer.datamodule, "hparams", None) or {}).get("num_workers")
        saved = [saved_worker_count(state) for state in compat.train_loader_states(checkpoint) or []]
        if workers is not None and any(count is not None and count != workers for count in saved):
            compat.set_train_loader_states(checkpoint, [])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning applies the loaders' saved positions when it first builds the train loader. A task that
        # reads trainer.estimated_stepping_batches in configure_optimizers builds it before the loop states are
        # restored, and the positions are dropped: the resumed epoch would restart from its first batch.
        compat.restore_train_loader_position(trainer)
        if self._to_restore is not None:
            _set_rng_states(self._to_restore)
            self._to_restore = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._before_validation = _rng_states()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A run resumed from a checkpoint written at the end of a batch skips the validation that followed it:
        # Lightning fast-forwards that validation, creating its loader's iterator (which draws a seed) but running
        # no batch. So the random draws of the validation batches (DiT's noise and timesteps) are undone here, or
        # they would shift every later training draw of the uninterrupted run.
        if self._before_validation is not None:
            _set_rng_states(self._before_validation)
            self._before_validation = None


def _rng_states() -> dict[str, Any]:
    # numpy's key array as a list: Lightning loads checkpoints with weights_only=True, which refuses numpy arrays.
    name, keys, position, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "numpy": (name, keys.tolist(), position, has_gauss, gauss),
              "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    name, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, gauss))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class FiniteLossGuard(Callback):
    """Stops training with an error naming the step when the training loss was NaN or infinite.

    Nothing in a step waits for the device: each step's loss is checked on the device into a flag (the first
    non-finite step and its loss), which the host reads, and the ranks combine, only where the run reads the device
    anyway: at the logging steps (``log_every_n_steps``), before any checkpoint is written, before a validation and at
    the end of training. A checkpoint is never written once a loss was non-finite, so the newest checkpoint on disk is
    the last good one; every rank stops at the same step. The weights in memory may hold the bad update (and the
    steps after it, up to the next check): the run stops, and continues from that checkpoint.
    """

    def __init__(self) -> None:
        super().__init__()
        self._first_bad: torch.Tensor | None = None  # () int64: the first non-finite step, -1 while none
        self._bad_loss: torch.Tensor | None = None   # () float32: its loss
        self._positions: dict[int, tuple[int, int]] = {}  # step -> (epoch, batch), since the last check

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_bad = self._bad_loss = None
        self._positions = {}

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        total = loss.detach().float().sum()  # non-finite when any element is
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.int64, device=total.device)
            self._bad_loss = torch.zeros((), device=total.device)
        first = ~torch.isfinite(total) & (self._first_bad < 0)
        self._first_bad = torch.where(first, trainer.global_step, self._first_bad)
        self._bad_loss = torch.where(first, total, self._bad_loss)
        self._positions[trainer.global_step] = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if compat.logs_this_step(trainer):
            self.check(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.check(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.check(trainer)  # raising here, before the file is written, keeps a bad update off the disk

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: Trainer) -> None:
        """Raises ``FloatingPointError`` on every rank when a loss was non-finite on any rank since training started."""
        if self._first_bad is None:
            return
        none = torch.iinfo(torch.int64).max
        pending = torch.where(self._first_bad < 0, none, self._first_bad)
        step = int(trainer.strategy.reduce(pending, reduce_op="min"))  # the one read of the device, and collective
        if step == none:
            self._positions.clear()
            return
        if int(self._first_bad) == step:
            epoch, batch = self._positions.get(step, (trainer.current_epoch, None))
            what = f"{float(self._bad_loss)} at step {step} (epoch {epoch}, batch {batch})"
        else:
            what = f"non-finite on another rank at step {step}"
        raise FloatingPointError(
            f"Training loss is {what}; the run stops and its newest checkpoint is the last good one. Resume from it "
            f"with a lower learning rate or stronger gradient clipping, or check the data.")
