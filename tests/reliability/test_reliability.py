"""Runs that survive: crash-safe checkpoints, resume from `last`, exact mid-epoch resume, bad input, NaN, collapse."""
import csv
import io
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import run_checkpoints
from faults import CrashAtStep
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning import MoHAttention, checkpoint_io
from moh_lightning.callbacks import FiniteLossGuard, HeadLoadCallback, StepCheckpoint
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.cli import MoHLightningCLI, main
from moh_lightning.configs import resolve_config
from moh_lightning.data.images import ImageFolderDataModule

pytestmark = pytest.mark.slow

# Small, fast runs of the embedded config (2 layers, 16 images a batch, no validation) with every random
# augmentation on, whatever the config's defaults: RandAugment and Random Erasing (python `random`), crops and
# DropPath (torch), Mixup (numpy).
FAST = ["--trainer.limit_val_batches=0", "--data.init_args.batch_size=16", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.init_args.arch.depth=2", "--model.init_args.arch.drop_path_rate=0.1",
        "--model.init_args.mixup_alpha=0.2", "--model.init_args.mixup_prob=0.5",
        "--data.init_args.auto_augment=rand-m5-mstd0.5-inc1", "--data.init_args.re_prob=0.25"]


def _fast_config(run_dir, every: int = 2, keep: int = 2) -> str:
    """Only the always-on callbacks (exact resume among them), with step checkpoints every ``every`` steps (keep
    ``keep`` + last) in the run folder; the config's other callbacks are dropped."""
    config = {"trainer": {"callbacks": []}, "checkpoint": {"every_n_train_steps": every, "keep": keep}}
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
    checkpoints = run_checkpoints("vit_tiny_mnist_75", run_dir / "resumed")
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


def _corrupt(root, corrupt: dict[str, bytes]):
    for name, content in corrupt.items():
        (root / "train" / "cat" / name).write_bytes(content)


def _truncated_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((20, 20, 3), 7, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()[:60]


def test_corrupt_image_stops_the_run_naming_the_file_even_from_a_worker(tmp_path, write_image_folder):
    write_image_folder(tmp_path, per_class=3, size=(20, 20))
    _corrupt(tmp_path, {"broken.png": b"not an image"})
    data = ImageFolderDataModule(str(tmp_path), img_size=16, batch_size=1, num_workers=1)
    data.setup("fit")
    with pytest.raises(RuntimeError, match=r"broken\.png.*on_corrupt skip"):
        list(data.train_dataloader())


def test_corrupt_images_are_skipped_counted_and_named_with_on_corrupt_skip(tmp_path, caplog, write_image_folder):
    write_image_folder(tmp_path, per_class=3, size=(20, 20))
    _corrupt(tmp_path, {"broken.png": b"not an image", "truncated.png": _truncated_png()})
    data = ImageFolderDataModule(str(tmp_path), img_size=16, batch_size=4, num_workers=0, on_corrupt="skip")
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) == 2 and all(images.shape == (4, 3, 16, 16) for images, _ in batches)
    assert sorted(Path(p).name for p in data.train_set.skipped) == ["broken.png", "truncated.png"]
    assert "broken.png" in caplog.text and "truncated.png" in caplog.text
    with pytest.raises(ValueError, match="on_corrupt='ignore'"):
        ImageFolderDataModule(str(tmp_path), on_corrupt="ignore")


class Regression(LightningModule):
    """A linear regression whose loss turns NaN at step ``nan_at``."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        return loss * float("nan") if self.global_step == self.nan_at else loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    model = Regression(nan_at=5)
    trainer = Trainer(max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[AtomicCheckpointIO()],
                      callbacks=[FiniteLossGuard(), StepCheckpoint(str(tmp_path), every_n_train_steps=2)])
    with pytest.raises(FloatingPointError, match=r"Training loss is nan at step 5 \(epoch 0, batch 5\)"):
        trainer.fit(model)
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 4
    assert all(torch.isfinite(value).all() for value in last["state_dict"].values())
    assert all(torch.isfinite(value).all() for value in model.state_dict().values())


class StarvedHeads(LightningModule):
    """One MoH layer whose router always picks routed head 1 of 1-3 (positive inputs, fixed router, lr 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = MoHAttention(8, num_heads=4, num_shared_heads=1, top_k=1)
        with torch.no_grad():
            self.attn.router.routed_router.weight.copy_(torch.tensor([1.0, 0.5, -1.0])[:, None].expand(3, 8))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.attn(batch[0]).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.rand(16, 5, 8) + 0.1), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_routing_collapse_warns_naming_layer_and_heads_and_logs_a_scalar(tmp_path, caplog):
    trainer = Trainer(max_steps=4, log_every_n_steps=1, logger=CSVLogger(tmp_path, name="", version=""),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[HeadLoadCallback(collapse_windows=3)])
    trainer.fit(StarvedHeads())
    with open(tmp_path / "metrics.csv") as file:
        collapsed = [float(row["head_load/layer_00/collapsed_heads"]) for row in csv.DictReader(file)
                     if row.get("head_load/layer_00/collapsed_heads")]
    assert collapsed == [2, 2]  # the series starts at a layer's first collapse
    warnings = [r.getMessage() for r in caplog.records if "Routing collapse" in r.getMessage()]
    assert len(warnings) == 1
    assert "layer 0 at step 3" in warnings[0] and "2 (0.00%), 3 (0.00%)" in warnings[0]


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_mistyped_config_key_fails_naming_the_key(where, run_dir):
    if where == "command line":
        args = ["--model.init_args.arch.moh.top_kk=3"]
    else:
        (run_dir / "typo.yaml").write_text("model:\n  init_args:\n    learning_rate: 0.1\n")
        args = ["--config", "typo.yaml"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "vit_tiny_mnist_75.yaml", *args])
    assert ("top_kk" if where == "command line" else "learning_rate") in str(exit_info.value.code)
