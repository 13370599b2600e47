"""Two-process DDP on CPU (gloo) agrees with one process over the same data: load-balance loss, head loads, weights."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from moh_lightning import MoHAttention, pop_load_balance_loss
from moh_lightning.callbacks import HeadLoadCallback

DIM, TOKENS, SAMPLES, STEPS = 32, 12, 16, 3


class TinyMoH(LightningModule):
    """One MoH layer regressing a fixed target, trained with its load-balance loss (beta 1, so it matters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = MoHAttention(DIM, num_heads=8, num_shared_heads=2, top_k=2)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, target = batch
        task = (self.attn(x) - target).pow(2).mean()
        balance = pop_load_balance_loss(self)
        # Logged mean over ranks: with global f_i it is the 1-process loss over both ranks' tokens.
        self.log("train/load_balance_loss", balance, sync_dist=True, on_step=True)
        return task + balance

    def train_dataloader(self) -> DataLoader:
        # Rank r takes samples r, r + 2, ... in order (Lightning's own distributed sampler would shuffle), so
        # each step the two ranks' batches of 4 are together the single process's batch of 8.
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, TOKENS, DIM, generator=generator)
        data = TensorDataset(x, torch.randn(SAMPLES, TOKENS, DIM, generator=generator))
        world = self.trainer.world_size
        sampler = DistributedSampler(data, num_replicas=world, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=8 // world, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(root: Path, devices: int) -> tuple[dict[str, torch.Tensor], list[dict[str, str]]]:
    model = TinyMoH()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                      max_steps=STEPS, log_every_n_steps=1, logger=CSVLogger(root, name="", version=""),
                      callbacks=[HeadLoadCallback(log_every_n_steps=1)], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)
    with open(root / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    return model.state_dict(), rows


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def test_two_process_ddp_matches_one_process_loss_head_load_and_weights(tmp_path):
    single_state, single_rows = _fit(tmp_path / "single", devices=1)
    ddp_state, ddp_rows = _fit(tmp_path / "ddp", devices=2)
    # Same weights and the same tokens each step: global f_i makes the ranks' mean loss the 1-process loss, and
    # DDP's averaged gradients the 1-process gradients, so the runs stay together step after step.
    single_loss, ddp_loss = _column(single_rows, "train/load_balance_loss"), _column(ddp_rows, "train/load_balance_loss")
    assert len(single_loss) == len(ddp_loss) == STEPS
    assert ddp_loss == pytest.approx(single_loss, rel=1e-5)
    for key in ("load_entropy", "max_min_load_ratio", "heads_under_low_load"):
        single, ddp = _column(single_rows, f"head_load/layer_00/{key}"), _column(ddp_rows, f"head_load/layer_00/{key}")
        assert len(single) == STEPS and ddp == pytest.approx(single, rel=1e-5)
    for name, value in single_state.items():
        torch.testing.assert_close(ddp_state[name], value, rtol=1e-5, atol=1e-6)


def test_moh_fit_runs_under_lightning_ddp_with_two_cpu_processes(run_dir):
    # Lightning's `ddp` strategy re-launches the command for rank 1, so `moh` runs as its own process.
    args = [str(Path(sys.executable).with_name("moh")), "fit", "--config", "vit_tiny_mnist_75.yaml",
            "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.max_steps=3",
            "--trainer.limit_val_batches=1", "--data.init_args.batch_size=16", "--trainer.log_every_n_steps=1"]
    result = subprocess.run(args, cwd=run_dir, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr
    assert (run_dir / "runs" / "vit_tiny_mnist_75" / "version_0" / "checkpoints" / "last.ckpt").is_file()
