"""Runs that survive: crash-safe checkpoints, resume from `last`, exact mid-epoch resume, bad input, NaN, collapse."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from moh_lightning import checkpoint_io
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.cli import MoHLightningCLI, resolve_config

# Small, fast runs of the embedded config: no validation, 32 images a batch, a checkpoint every 2 steps.
FAST = ["--trainer.limit_val_batches=0", "--data.init_args.batch_size=32", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _fast_config(run_dir, every: int = 2, keep: int = 2) -> str:
    """The embedded config's callbacks with step checkpoints every ``every`` steps (keep ``keep`` + last)."""
    config = {"trainer": {"callbacks": [
        {"class_path": "moh_lightning.callbacks.StepCheckpoint",
         "init_args": {"dirpath": "checkpoints", "every_n_train_steps": every, "keep": keep}}]}}
    path = run_dir / "fast.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _fit(run_dir, *args: str) -> MoHLightningCLI:
    return MoHLightningCLI(args=["fit", "--config", resolve_config("vit_tiny_mnist_75.yaml"),
                                 "--config", _fast_config(run_dir), *FAST, *args])


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


def test_step_checkpoints_keep_the_last_k_and_ckpt_path_last_resumes(run_dir):
    first = _fit(run_dir, "--trainer.max_steps=5")
    assert first.trainer.global_step == 5
    assert isinstance(first.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert names == ["last.ckpt", "step=0000002.ckpt", "step=0000004.ckpt"]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5
    resumed = _fit(run_dir, "--trainer.max_steps=7", "--ckpt_path=last")
    assert resumed.trainer.global_step == 7
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert names == ["last.ckpt", "step=0000004.ckpt", "step=0000006.ckpt"]
