"""Augmentations that resume exactly: the random state of each data-loader worker, saved with the loader's."""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import get_worker_info


class WorkerRandomState:
    """Mixin for a map-style dataset whose items draw random numbers (augmentations) in data-loader workers.

    A worker draws from its own python, numpy and torch random streams, seeded once when it starts and continued
    across epochs (the loaders keep their workers). Resuming a run mid-epoch must put each worker back at its point
    in those streams, or it draws other augmentations than the uninterrupted run. torchdata's ``StatefulDataLoader``
    asks a dataset that has ``state_dict`` / ``load_state_dict`` for its state inside each worker, right after the
    worker fetched a batch (every ``snapshot_every_n_steps=1`` batch), keeps the snapshot that belongs to the last
    batch handed to the training loop, and gives it back to the same worker on resume. So the state here is the
    worker's random states: saved after the worker's last consumed batch, the batches it had prefetched beyond that
    are drawn again from there, in the same order (the loader also restores which worker serves the next batch).

    Seeding per sample from (epoch, index) would also resume exactly, but it needs the epoch inside the workers and
    re-seeds three generators per image; snapshots use the loader's own mechanism and leave the streams (and so the
    augmentations of existing runs) as they were. The state holds plain lists and a uint8 tensor, which Lightning's
    ``weights_only`` checkpoint loading accepts. In the main process (``num_workers=0``) the state is empty: there the
    random streams are the trainer's, saved by ``ExactResumeCallback``.
    """

    def state_dict(self) -> dict:
        if get_worker_info() is None:
            return {}
        name, keys, position, has_gauss, gauss = np.random.get_state()
        return {"python": random.getstate(), "numpy": [name, keys.tolist(), position, has_gauss, gauss],
                "torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        if not state or get_worker_info() is None:
            return
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        name, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
