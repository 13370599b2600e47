"""Callbacks that inject crashes, hangs and lost nodes into a training run, and damage into checkpoint files, for the
reliability tests."""
import os
import signal
import time
import zipfile
from pathlib import Path

from lightning.pytorch import Callback


def wait_until_the_stop_is_heard(trainer, seconds: float) -> None:
    """Holds the current step until the run's watchdog thread has heard a stop signal (at most ``seconds``): the
    signal then comes inside this step, wherever the thread happens to be scheduled."""
    deadline = time.monotonic() + seconds
    while not trainer.received_sigterm and time.monotonic() < deadline:
        time.sleep(0.01)


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


class HangAtStep(Callback):
    """Rank ``rank`` stops making progress before training step ``step`` (sleeps ``seconds``), as a deadlock would;
    every rank first writes ``at_step_<step>_rank<rank>`` in the working folder, holding its pid."""

    def __init__(self, step: int, rank: int = 1, seconds: float = 600.0) -> None:
        self.step, self.rank, self.seconds = step, rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            Path(f"at_step_{self.step}_rank{trainer.global_rank}").write_text(str(os.getpid()))
            if trainer.global_rank == self.rank:
                time.sleep(self.seconds)


class KillNodeAtStep(Callback):
    """SIGKILLs the process group of rank ``rank`` before training step ``step``: its node lost, loader workers and
    all, at once (run each node in a session of its own)."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.killpg(os.getpgid(0), signal.SIGKILL)


def truncate(path: Path) -> None:
    """Cuts the file to half its length, as an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scramble(path: Path) -> None:
    """Overwrites the start of the archive's pickle, as a disk fault would: still a complete zip file."""
    data = bytearray(path.read_bytes())
    start = data.index(b"data.pkl") + 40
    data[start:start + 32] = bytes(range(200, 232))
    path.write_bytes(bytes(data))
    assert zipfile.is_zipfile(path)
