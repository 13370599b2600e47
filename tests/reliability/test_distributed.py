"""Two-process DDP on CPU (gloo): agrees with one process over the same data (load-balance loss, head loads,
weights), and `moh fit` trains every task under Lightning's DDP strategy, its forked ranks one thread each."""
import csv
import importlib
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import run_checkpoints
from ddp_cases import DDP_TASKS, logged_scalars, write_text_corpus
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from moh_lightning import MoHAttention, pop_load_balance_loss
from moh_lightning.callbacks import HeadLoadCallback
from moh_lightning.cli import main
from moh_lightning.tasks import TASKS
from moh_lightning.trainer_cli import threads_restored

pytestmark = pytest.mark.distributed

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
    # The 2 processes forked from this one (not spawned: each would import torch again), one thread each as
    # `moh fit` runs forked ranks (tests/cli/test_fork_threads.py), and the weights of rank 0 come back to `model`.
    trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp_fork" if devices > 1 else "auto",
                      max_steps=STEPS, log_every_n_steps=1, logger=CSVLogger(root, name="", version=""),
                      callbacks=[HeadLoadCallback(log_every_n_steps=1)], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    with threads_restored():
        torch.set_num_threads(1)
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
    single_loss = _column(single_rows, "train/load_balance_loss")
    ddp_loss = _column(ddp_rows, "train/load_balance_loss")
    assert len(single_loss) == len(ddp_loss) == STEPS
    assert ddp_loss == pytest.approx(single_loss, rel=1e-5)
    keys = [f"head_load_per_head/layer_00/head_{h:02d}" for h in range(2, 8)] + [
        f"head_load_balance/layer_00/{name}" for name in ("busiest_head_vs_balanced", "idlest_head_vs_balanced")]
    for key in keys:
        single, ddp = _column(single_rows, key), _column(ddp_rows, key)
        assert len(single) == STEPS and ddp == pytest.approx(single, rel=1e-5)
    for name, value in single_state.items():
        torch.testing.assert_close(ddp_state[name], value, rtol=1e-5, atol=1e-6)


class RankState(Callback):
    """Test helper named on the command line (test_distributed.RankState): each rank saves its final weights."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save(pl_module.state_dict(), f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("task", TASKS)  # a registered task with no case here fails
def test_moh_fit_trains_every_task_under_lightning_ddp_with_two_cpu_processes(task, run_dir, monkeypatch, capfd):
    config, overrides = DDP_TASKS[task]
    if task == "language_model":
        write_text_corpus(run_dir / "corpus")
    if task == "diffusion":  # its training step imports diffusers.training_utils (seconds): here once, not in each rank
        importlib.import_module("diffusers.training_utils")
    # The ViT is forked from a process of 2 OpenMP threads: forked ranks of more than one thread would hang in DDP's
    # first broadcast (GNU OpenMP is not fork-safe; the test's timeout fails it), so they run one each and say so.
    threads = 2 if task == "classification" else torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.ones(256, 256) @ torch.ones(256, 256)  # this process's OpenMP threads have run
    # Forked from this process (ddp_fork: Lightning's DDP strategy with the fork launcher), so no process imports
    # the suite again; FSDP's test forks 2 processes of its own.
    try:
        main(["fit", "--config", f"{config}.yaml", "--trainer.strategy=ddp_fork", "--trainer.devices=2",
              "--trainer.accelerator=cpu", "--trainer.max_steps=3", "--trainer.log_every_n_steps=1",
              "--trainer.enable_progress_bar=false", *overrides, "--trainer.callbacks+=test_distributed.RankState"])
        assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == (threads, str(threads))  # its own, back
    finally:
        torch.set_num_threads(previous)
    assert ("run one thread each" in capfd.readouterr().err) == (threads > 1)
    # DDP keeps the replicas identical: both ranks end with the same weights, bit for bit, and they are finite.
    rank0, rank1 = (torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for name, value in rank0.items():
        assert torch.equal(value, rank1[name]), name
        assert torch.isfinite(value.float()).all(), name
    # The run's one folder (named after the config and its head budget): TensorBoard events, checkpoints.
    (run,) = (run_dir / "runs").glob("*/version_0")
    checkpoints = run_checkpoints(run.parent.name, run_dir)
    assert checkpoints.parent == run
    checkpoint = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 3
    assert all(torch.isfinite(v.float()).all() for v in checkpoint["state_dict"].values())
    losses = logged_scalars(run, "train/loss")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for v in logged_scalars(run, "val/loss"))


def _text_data(folder: Path):
    from moh_lightning.data.text import TextDataModule, TextSource
    write_text_corpus(folder / "corpus")
    return TextDataModule(sources=[TextSource(path=str(folder / "corpus"), val_fraction=0.2)], seq_len=32,
                          batch_size=2, cache_dir=str(folder / "cache"))


def _mnist_data(folder: Path):
    from moh_lightning.data.images import MNISTDataModule
    return MNISTDataModule(batch_size=64)


@pytest.mark.parametrize("make_data", [_text_data, _mnist_data], ids=["text", "mnist"])
def test_each_rank_resumes_its_own_share_of_the_epoch(make_data, tmp_path, monkeypatch):
    """Under DDP each rank's loader serves its own share of one seeded permutation, through a ``DistributedSampler``
    (which Lightning keeps; any other sampler it wraps in a stateless one that reshuffles on resume), and its state
    brings back the rank's place: the batches after a mid-epoch checkpoint are the uninterrupted rank's."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    data = make_data(tmp_path)
    data.prepare_data()
    data.setup("fit")
    # The order, not the augmentations (the main process's random streams, which ExactResumeCallback restores).
    first = lambda batch: batch["tokens"] if isinstance(batch, dict) else batch[1]   # noqa: E731
    shares = []
    for rank in (0, 1):
        data.trainer = type("Trainer", (), {"world_size": 2, "global_rank": rank})()
        loader = data.train_dataloader()
        assert isinstance(loader.sampler, DistributedSampler)
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, rank)
        shares.append(set(loader.sampler))
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        state = loader.state_dict()
        after = [first(next(batches)) for _ in range(3)]
        resumed = data.train_dataloader()
        resumed.load_state_dict(state)
        again = iter(resumed)
        for expected in after:
            assert torch.equal(first(next(again)), expected)
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) >= len(data.train_set) - 1
