"""Callbacks that inject crashes into a training run, for the resume tests."""
from lightning.pytorch import Callback


class CrashAtStep(Callback):
    """Raises before training step ``step``, as a crash or kill mid-epoch would stop the run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash at step {self.step}")


class CrashInValidation(Callback):
    """Raises in the validation after training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            raise RuntimeError(f"injected crash in the validation at step {self.step}")
