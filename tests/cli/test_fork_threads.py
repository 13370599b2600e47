"""CPU processes forked by ``ddp_fork`` run one thread each: more deadlock at DDP's first broadcast (GNU OpenMP
is not fork-safe), and the process that forked them keeps its own threads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from moh_lightning.trainer_cli import one_thread_per_forked_cpu_process, threads_restored


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp"])
def test_only_forked_cpu_processes_get_one_thread_and_the_parent_gets_its_own_back(strategy, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    with threads_restored():
        one_thread_per_forked_cpu_process(trainer)
        forks = strategy == "ddp_fork"
        assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == ((1, "1") if forks else (2, "2"))
        assert ("run one thread each" in capsys.readouterr().err) == forks
    assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == (2, "2")


@pytest.mark.distributed
def test_ddp_fork_on_cpu_trains_with_omp_num_threads_above_one(run_dir):
    args = [str(Path(sys.executable).with_name("moh")), "fit", "--config", "vit_tiny_mnist_75.yaml",
            "--trainer.strategy=ddp_fork", "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0", "--model.init_args.arch.depth=1", "--trainer.enable_progress_bar=false"]
    # Without the single thread the two processes hang in DDP's first broadcast: the timeout fails the test.
    result = subprocess.run(args, cwd=run_dir, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run one thread each" in result.stderr and "moh fit finished at step 2" in result.stdout
