"""Runs that survive: crash-safe checkpoints, resume from `last`, exact mid-epoch resume, bad input, NaN, collapse."""
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moh_lightning import checkpoint_io
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.cli import MoHLightningCLI, resolve_config

# Small, fast runs of the embedded config (2 layers, 16 images a batch, no validation) with every random
# augmentation on, whatever the config's defaults: RandAugment and Random Erasing (python `random`), crops and
# DropPath (torch), Mixup (numpy).
FAST = ["--trainer.limit_val_batches=0", "--data.init_args.batch_size=16", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.init_args.vit.depth=2", "--model.init_args.vit.drop_path_rate=0.1",
        "--model.init_args.mixup_alpha=0.2", "--model.init_args.mixup_prob=0.5",
        "--data.init_args.auto_augment=rand-m5-mstd0.5-inc1", "--data.init_args.re_prob=0.25"]


def _fast_config(run_dir, every: int = 2, keep: int = 2) -> str:
    """The embedded config's callbacks with step checkpoints every ``every`` steps (keep ``keep`` + last)."""
    config = {"trainer": {"callbacks": [
        {"class_path": "moh_lightning.callbacks.StepCheckpoint",
         "init_args": {"dirpath": "checkpoints", "every_n_train_steps": every, "keep": keep}},
        {"class_path": "moh_lightning.callbacks.ExactResumeCallback"}]}}
    path = run_dir / "fast.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_failed_checkpoint_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    def crash_mid_write(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io.torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    io.save_checkpoint({"step": 3}, path)
    assert torch.load(path)["step"] == 3


KILLED_WRITER = """
import sys, time, torch
from moh_lightning import checkpoint_io
io = checkpoint_io.AtomicCheckpointIO()
io.save_checkpoint({"step": 1, "weights": torch.ones(1000)}, sys.argv[1])
def stalled_save(obj, file):
    file.write(b"x" * 100000)
    file.flush()
    print("writing", flush=True)
    time.sleep(600)
checkpoint_io.torch.save = stalled_save
io.save_checkpoint({"step": 2}, sys.argv[1])
"""


def test_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert torch.load(path)["step"] == 1
    # The interrupted write stays behind as a hidden temporary file that no checkpoint lookup matches.
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".ckpt") == ["last.ckpt"]


class CrashAtStep(Callback):
    """Raises before training step ``step``, as a crash or kill mid-epoch would stop the run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash at step {self.step}")


def _train(folder, monkeypatch, *args: str, crash_at: int | None = None, ckpt_path: str | None = None):
    folder.mkdir()
    monkeypatch.chdir(folder)
    cli = MoHLightningCLI(args=["--config", resolve_config("vit_tiny_mnist_75.yaml"), "--config",
                                _fast_config(folder, every=3), *FAST, *args], run=False)
    if crash_at is not None:
        cli.trainer.callbacks.append(CrashAtStep(crash_at))
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return cli


def _logged(folder, tag: str = "train/loss") -> dict[int, float]:
    values = {}
    for version in sorted((folder / "runs" / "vit_tiny_mnist_75").iterdir()):
        events = EventAccumulator(str(version), size_guidance={"scalars": 0}).Reload()
        values.update({event.step: event.value for event in events.Scalars(tag)})
    return values


def test_run_killed_mid_epoch_resumes_from_last_to_the_same_weights_and_losses(run_dir, monkeypatch):
    # 4 batches an epoch, 7 steps: the crash at step 5 falls mid-epoch 1, after the step-3 checkpoint (mid-epoch
    # 0), so the resumed run re-does steps 3-4 and continues across the epoch boundary.
    args = ["--trainer.max_steps=7", "--trainer.limit_train_batches=4", "--trainer.deterministic=true"]
    uninterrupted = _train(run_dir / "uninterrupted", monkeypatch, *args)
    with pytest.raises(RuntimeError, match="injected crash at step 5"):
        _train(run_dir / "resumed", monkeypatch, *args, crash_at=5)
    checkpoints = run_dir / "resumed" / "checkpoints"
    monkeypatch.chdir(run_dir / "resumed")
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["last.ckpt", "step=0000003.ckpt"]
    resumed = MoHLightningCLI(args=["fit", "--config", resolve_config("vit_tiny_mnist_75.yaml"), "--config",
                                    _fast_config(run_dir / "resumed", every=3), *FAST, *args, "--ckpt_path=last"])
    assert resumed.trainer.global_step == 7
    assert isinstance(resumed.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    # keep=2 newest step checkpoints, and last.ckpt written at the end of fit (step 7 is not a multiple of 3)
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["last.ckpt", "step=0000003.ckpt",
                                                                  "step=0000006.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 7
    expected, actual = uninterrupted.model.state_dict(), resumed.model.state_dict()
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name
    losses, resumed_losses = _logged(run_dir / "uninterrupted"), _logged(run_dir / "resumed")
    assert len(losses) == 7 and resumed_losses == losses
