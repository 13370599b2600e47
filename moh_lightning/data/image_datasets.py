"""The datasets behind the image data modules: a checked class-folder tree, its seeded split, and images in an array."""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import default_loader

from moh_lightning.data.worker_random import WorkerRandomState
from moh_lightning.errors import MissingDataError

CorruptPolicy = Literal["skip", "error"]
log = logging.getLogger(__name__)


def grayscale_loader(path: str) -> Image.Image:
    """Opens an image as one channel (PIL mode ``L``); a module function so loader workers can pickle it."""
    with open(path, "rb") as file:
        return Image.open(file).convert("L")


class CheckedImageFolder(WorkerRandomState, ImageFolder):
    """``ImageFolder`` whose unreadable or corrupt files stop the run with the file's name, or are skipped.

    With ``on_corrupt="skip"`` a bad file is replaced by the next readable one, so batches keep their size and
    the order stays deterministic; each skipped file is logged once by name and counted in ``skipped`` (per
    process: every data-loader worker counts and logs the files it met).

    ``classes`` are the training split's class folders: a validation or test split numbers its labels by them (a
    split without some class keeps the others' labels), and a class folder the training split lacks stops the run.
    """

    def __init__(self, root: str | Path, transform=None, on_corrupt: CorruptPolicy = "error",
                 grayscale: bool = False, classes: list[str] | None = None) -> None:
        self.training_classes = classes
        super().__init__(root, transform=transform, loader=grayscale_loader if grayscale else default_loader,
                         allow_empty=classes is not None)
        self.on_corrupt = on_corrupt
        self.skipped: set[str] = set()

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        present = super().find_classes(directory)[0]
        if self.training_classes is None:
            return present, {name: i for i, name in enumerate(present)}
        unknown = sorted(set(present) - set(self.training_classes))
        if unknown:
            raise MissingDataError(f"{directory}: class folders {unknown} are not among the training split's classes "
                                   f"{self.training_classes}; every split's classes must be folders of train/.")
        return self.training_classes, {name: i for i, name in enumerate(self.training_classes)}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(len(self.samples)):
            path, target = self.samples[(index + offset) % len(self.samples)]
            try:
                image = self.loader(path)
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
                if self.on_corrupt == "error":
                    raise RuntimeError(f"Unreadable image {path} ({error}): delete or replace it, or set "
                                       f"--data.init_args.on_corrupt skip to leave such files out.") from error
                if path not in self.skipped:
                    self.skipped.add(path)
                    log.warning("Skipped unreadable image %s (%s); %d skipped so far in this process.", path,
                                error, len(self.skipped))
                continue
            return (self.transform(image) if self.transform else image), target
        raise RuntimeError(f"No readable image under {self.root}: every file failed to load.")


def held_out(targets: list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices (training, validation) of a labelled list: a seeded ``fraction`` of every class held out.

    Per class, so that every class of a small folder is validated (and scored per class) in its share; the same seed
    gives the same split in every process and every run.
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(targets)
    val: list[int] = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        val += rng.permutation(members)[:int(round(len(members) * fraction))].tolist()
    chosen = set(val)
    return [i for i in range(len(labels)) if i not in chosen], sorted(val)


def folder_subset(images: CheckedImageFolder, indices: list[int], transform) -> CheckedImageFolder:
    """``images`` restricted to ``indices`` with its own transform (one scan of the folder serves both splits)."""
    subset = copy.copy(images)
    subset.samples = [images.samples[i] for i in indices]
    subset.imgs = subset.samples
    subset.targets = [images.targets[i] for i in indices]
    subset.transform = transform
    subset.skipped = set()
    return subset


class ArrayImageDataset(WorkerRandomState, Dataset):
    """Grayscale images held as a uint8 array (N, H, W) with integer labels, served through a transform."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform, mode: str = "L") -> None:
        self.images, self.mode = images, mode
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = Image.fromarray(self.images[index], mode="L")
        return self.transform(image if self.mode == "L" else image.convert(self.mode)), self.labels[index]
