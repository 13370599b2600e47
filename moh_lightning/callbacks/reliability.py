"""Callbacks that let a long run survive: periodic resumable checkpoints."""
from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """Checkpoints every ``every_n_train_steps`` steps, keeping the newest ``keep``, plus ``last.ckpt``.

    ``last.ckpt`` is rewritten at every save and at the end of fit. ``dirpath`` should not change between runs
    (no logger version in it) so that ``--ckpt_path last`` finds the newest state to resume from.
    """

    def __init__(self, dirpath: str, every_n_train_steps: int = 1000, keep: int = 3) -> None:
        if every_n_train_steps < 1 or keep < 1:
            raise ValueError(f"StepCheckpoint every_n_train_steps={every_n_train_steps} and keep={keep} must both "
                             f"be at least 1.")
        super().__init__(dirpath=dirpath, filename="{step:07d}", monitor="step", mode="max", save_top_k=keep,
                         every_n_train_steps=every_n_train_steps, save_last=True, enable_version_counter=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # ModelCheckpoint saves `last` at the end only if it never saved before, which would lose the steps
        # after the last multiple of every_n_train_steps.
        if self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
