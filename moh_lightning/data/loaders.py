"""The training loader every data module uses: shuffled, stateful, and per-rank resumable under DDP."""
from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


def train_loader(dataset: Dataset, batch_size: int, num_workers: int, trainer=None, **kwargs) -> StatefulDataLoader:
    """The shuffled training loader, stateful so that checkpoints record the position in the epoch.

    Under DDP (``trainer.world_size > 1``) each process gets torchdata's ``StatefulDistributedSampler``, whose order
    is a function of the seed (``seed_everything``'s, as Lightning's own distributed sampler) and the epoch, and whose
    state is the number of indices served. Left to Lightning, a stateful loader's sampler is wrapped in a
    ``DistributedSamplerWrapper`` that draws a new permutation from the global random stream when an epoch's iterator
    is created, and holds no state: a run resumed mid-epoch would serve another permutation from there.
    Workers are kept across epochs, so their random streams continue as they would in one process.
    """
    common = dict(batch_size=batch_size, drop_last=True, num_workers=num_workers,
                  persistent_workers=num_workers > 0, **kwargs)
    if trainer is not None and trainer.world_size > 1:
        sampler = StatefulDistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                             shuffle=True, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        return StatefulDataLoader(dataset, sampler=sampler, **common)
    return StatefulDataLoader(dataset, shuffle=True, **common)


def pin_memory(trainer=None) -> bool:
    """Page-locked batches, which only speed up copies to a GPU: on when the trainer runs on CUDA (or, with no
    trainer, when a GPU is present), so CPU runs neither pin nor warn."""
    if trainer is not None:
        return trainer.strategy.root_device.type == "cuda"
    return torch.cuda.is_available()


def saved_worker_count(state: dict | None) -> int | None:
    """The number of loader workers a ``StatefulDataLoader`` state was saved with (0: the main process); None if
    the state is not one.

    torchdata keeps a single-process loader's state and a multi-process one's in different layouts, and neither
    loads into a loader with another number of workers.
    """
    if not isinstance(state, dict):
        return None
    if "_num_yielded" in state:
        return 0
    return (state.get("_snapshot") or {}).get("_main_snapshot", {}).get("_num_workers")
