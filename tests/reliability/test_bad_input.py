"""Bad input and bad training stop or warn clearly: an unreadable image, a NaN loss, a routing collapse (a mistyped
config key: tests/cli/test_cli_errors.py).

Each case is the smallest run that shows it: a few random PNGs in ImageFolder's layout with a broken one among them,
a linear regression whose loss turns NaN at step 5, and one MoH layer whose fixed router starves two routed heads.
"""
import csv
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning import MoHAttention
from moh_lightning.callbacks import FiniteLossGuard, HeadLoadCallback, StepCheckpoint
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.data.images import ImageFolderDataModule

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("nan_at", [1, 5, 6, 9])
def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, nan_at):
    # The guard reads its flag at the logging steps (every 4) and before each checkpoint (every 3): a NaN anywhere
    # between stops the run with the checkpoint from before it, and nothing written after it.
    model = Regression(nan_at=nan_at)
    trainer = Trainer(max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      log_every_n_steps=4, plugins=[AtomicCheckpointIO()],
                      callbacks=[FiniteLossGuard(), StepCheckpoint(str(tmp_path), every_n_train_steps=3, keep=10)])
    with pytest.raises(FloatingPointError, match=rf"Training loss is nan at step {nan_at} \(epoch 0, batch {nan_at}\)"):
        trainer.fit(model)
    good = nan_at // 3 * 3
    written = sorted(torch.load(path, weights_only=False)["global_step"] for path in tmp_path.glob("*.ckpt"))
    assert written[-1] == good if good else not written
    for path in tmp_path.glob("*.ckpt"):
        assert all(torch.isfinite(value).all() for value in torch.load(path, weights_only=False)["state_dict"].values())


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
