"""CPU processes forked by ``ddp_fork`` run one thread each: more deadlock at DDP's first broadcast (GNU OpenMP
is not fork-safe), and the process that forked them keeps its own threads. A `moh fit` forked from a process of 2
threads is in tests/reliability/test_distributed.py."""
from __future__ import annotations

import os

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
