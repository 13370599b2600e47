"""The tiny MoH task the dashboard tests train: two MoH layers over random tokens of three classes."""
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning.callbacks import HeadLoadCallback
from moh_lightning.layers import MoHAttention
from moh_lightning.tasks.base import MoHTask

ROUTED_HEADS = [1, 2, 3]   # layer 0 of TinyTask: 1 shared + top-2 of 3 routed; layer 1: 4 shared heads, no routing


class TinyTask(MoHTask):
    """Two MoH layers over random tokens of 3 classes; with ``timesteps`` it draws a diffusion timestep per sample."""

    head_load_group_name = "class"

    def __init__(self, dense: bool = False, timesteps: bool = False, starve: bool = False) -> None:
        super().__init__(load_balance_beta=0.01)
        torch.manual_seed(0)
        if dense:
            layers = [MoHAttention(16, num_heads=4, dense=True) for _ in range(2)]
        else:
            layers = [MoHAttention(16, num_heads=4, num_shared_heads=1, top_k=2 if not starve else 1),
                      MoHAttention(16, num_heads=4, num_shared_heads=4, top_k=0)]
        self.model = nn.Sequential(*layers)
        if starve:  # positive tokens and a fixed router that always ranks routed head 1 first: heads 2 and 3 starve
            with torch.no_grad():
                layers[0].router.routed_router.weight.copy_(torch.tensor([1.0, 0.5, -1.0])[:, None].expand(3, 16))
        self.timesteps = timesteps
        self.starve = starve
        self.last_timesteps = None

    def head_load_groups(self, batch):
        return batch[1]

    def training_step(self, batch, batch_idx):
        return self.with_load_balance(self.model(batch[0]).pow(2).mean())

    def validation_step(self, batch, batch_idx):
        if self.timesteps:
            self.last_timesteps = torch.randint(0, 1000, (len(batch[0]),))
        self.log("val/loss", self.model(batch[0]).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self.model(batch[0]).pow(2).mean())

    def _loader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 5, 16, generator=generator)
        if self.starve:
            x = x.abs() + 0.1
        return DataLoader(TensorDataset(x, torch.arange(32) % 3), batch_size=4)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0 if self.starve else 0.1)


def fit_tiny(task: MoHTask, logger, root: Path, max_steps: int = 6, **callback_args) -> Trainer:
    trainer = Trainer(max_steps=max_steps, log_every_n_steps=2, val_check_interval=3, limit_val_batches=2,
                      logger=logger, callbacks=[HeadLoadCallback(**callback_args)], default_root_dir=root,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task)
    return trainer
