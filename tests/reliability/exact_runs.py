"""The embedded ViT shrunk to seconds, run in-process or as `moh fit`, and the checks that a stopped and resumed run
is the uninterrupted one: shared by the exact-resume and shutdown tests, and importable by the `moh fit` processes
they start (``--trainer.callbacks+=exact_runs.RecordBatches``).

One block, 16 images a batch, 5 batches an epoch, 7 steps, every random augmentation on, 2 loader workers, checkpoints
every 3 steps: a stop at step 5 resumes mid-epoch 0 from the step-3 checkpoint and continues across the epoch boundary.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from faults import wait_until_the_stop_is_heard
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

VIT_STEPS = 7
VIT = ["--config", "vit_tiny_mnist_75.yaml", f"--trainer.max_steps={VIT_STEPS}", "--trainer.limit_train_batches=5",
       "--trainer.limit_val_batches=0", "--trainer.deterministic=true", "--trainer.log_every_n_steps=1",
       "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
       "--model.init_args.arch.depth=1", "--data.init_args.batch_size=16", "--data.init_args.num_workers=2",
       "--data.init_args.auto_augment=rand-m5-mstd0.5-inc1", "--data.init_args.re_prob=0.25",
       "--model.init_args.mixup_alpha=0.2", "--model.init_args.mixup_prob=0.5",
       "--checkpoint.every_n_train_steps=3", "--trainer.callbacks+=exact_runs.RecordBatches"]
RUN = Path("runs") / "vit_tiny_mnist_75"
# Two gloo processes forked from the test process by Lightning (`ddp_fork`), each with its own half of every batch.
VIT_DDP = ["--trainer.strategy=ddp_fork", "--trainer.devices=2", "--trainer.accelerator=cpu"]


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@contextmanager
def working_folder(folder: Path) -> Iterator[None]:
    folder.mkdir(exist_ok=True)
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


class RecordBatches(Callback):
    """Appends each training step's batch (a hash of its images and labels) to ``batches.jsonl`` in the working dir."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            digest = hashlib.sha256(batch[0].numpy().tobytes() + batch[1].numpy().tobytes()).hexdigest()
            with open("batches.jsonl", "a") as file:
                file.write(json.dumps({"step": trainer.global_step, "batch": digest}) + "\n")


class SignalWindow(Callback):
    """Writes ``in_step_4`` when step 4 starts and lingers there, up to 30 s, until the run's watchdog has heard a
    signal sent from outside."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == 3:
            Path("in_step_4").touch()
            wait_until_the_stop_is_heard(trainer, seconds=30)


class SigtermInValidation(Callback):
    """Sends its own process SIGTERM in the validation after step ``step``: after its first batch (``at="batch"``:
    Lightning stops it there) or once it has ended (``"end"``: Lightning has counted the step for its loggers), and
    waits until the watchdog thread has heard it, which would otherwise happen at any point after.

    Every validation batch also draws from the global random streams, as DiT's validation (noise, timesteps) does.
    """

    def __init__(self, step: int, at: str = "batch") -> None:
        self.step, self.at = step, at

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0):
        torch.rand(3), random.random(), np.random.rand()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if self.at == "batch" and batch_idx == 0:
            self._stop(trainer)

    def on_validation_end(self, trainer, pl_module):
        if self.at == "end":
            self._stop(trainer)

    def _stop(self, trainer) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_until_the_stop_is_heard(trainer, seconds=10)


def batches(folder: Path) -> dict[int, str]:
    """The batch of each step; a resumed run's record of a step overrides the stopped run's (they must agree)."""
    seen: dict[int, str] = {}
    for line in (folder / "batches.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert seen.get(record["step"], record["batch"]) == record["batch"], f"step {record['step']} redone otherwise"
        seen[record["step"]] = record["batch"]
    return seen


def losses(folder: Path, run: Path = RUN) -> dict[int, float]:
    values = {}
    for version in sorted((folder / run).glob("version_*")):
        events = EventAccumulator(str(version), size_guidance={"scalars": 0}).Reload()
        if "train/loss" in events.Tags()["scalars"]:
            values.update({event.step: event.value for event in events.Scalars("train/loss")})
    return values


def checkpoints(folder: Path, run: Path = RUN) -> Path:
    return folder / run / "version_0" / "checkpoints"


def assert_same_run(expected: Path, actual: Path, run: Path = RUN) -> None:
    """The same batch at every step, the same logged losses and bit-identical final weights."""
    assert batches(actual) == batches(expected) and sorted(batches(expected)) == list(range(VIT_STEPS))
    assert losses(actual, run) == losses(expected, run) and len(losses(expected, run)) == VIT_STEPS
    want = load_checkpoint(checkpoints(expected, run) / "last.ckpt")
    got = load_checkpoint(checkpoints(actual, run) / "last.ckpt")
    assert got["global_step"] == want["global_step"] == VIT_STEPS
    assert want["state_dict"].keys() == got["state_dict"].keys()
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name


def fit(folder: Path, *args: str, base: list[str] = VIT) -> None:
    """`moh fit` of ``base`` and ``args`` in this process, in ``folder``."""
    from moh_lightning.cli import main

    # One thread, as a forked `moh` runs (tests/moh_process.py): runs are compared bit for bit, and a sum split over
    # two threads (`pytest -n 0` gives this process two) rounds differently.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with working_folder(folder):
            main(["fit", *base, *args])
    finally:
        torch.set_num_threads(threads)
