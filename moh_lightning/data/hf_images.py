"""Image classification data from a Hugging Face ``datasets`` dataset: a hub id, or a local folder through
``datasets.load_dataset("imagefolder", data_dir=...)``, with the folder module's timm transforms and switches."""
from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from moh_lightning.data.image_transforms import IMAGENET_MEAN, IMAGENET_STD, DeviceAugment, normalisation
from moh_lightning.data.loaders import train_loader
from moh_lightning.data.predict_folder import PredictFolder
from moh_lightning.data.worker_random import WorkerRandomState
from moh_lightning.errors import MissingDataError
from moh_lightning.value_checks import check_numbers


class HFImageDataset(WorkerRandomState, Dataset):
    """Rows of a ``datasets.Dataset`` as (transformed image, label)."""

    def __init__(self, rows, image_field: str, label_field: str, transform, mode: str) -> None:
        self.rows, self.image_field, self.label_field = rows, image_field, label_field
        self.transform, self.mode = transform, mode

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.rows[index]
        return self.transform(row[self.image_field].convert(self.mode)), int(row[self.label_field])


class HFImageDataModule(DeviceAugment, PredictFolder, LightningDataModule):
    """A ``datasets`` image-classification dataset: ``dataset`` is a hub id (``uoft-cs/cifar10``) or a loader such
    as ``imagefolder`` with ``data_dir`` (a local folder, ``train/<class>/`` and ``val/<class>/`` or ``test/``).

    The validation rows are ``val_split`` when the dataset has it, else a seeded, stratified ``val_fraction`` of
    ``train_split``; ``moh test`` scores ``test_split``, and refuses a dataset without one (never the validation rows
    under test keys). Labels are the ``label_field`` column (a ``ClassLabel``: ``num_classes`` comes from it and
    is linked into the model). Transforms and switches are ``ImageFolderDataModule``'s (timm's names and defaults,
    the paper's ImageNet recipe); for small data sets of digits or letters set ``hflip: 0`` and ``crop_scale``.
    ``moh predict`` classifies the images of ``predict_dir`` (``PredictFolder``), naming the classes by the label
    column's names.
    """

    def __init__(
            self,
            dataset: str,
            data_dir: str | None = None,
            dataset_config: str | None = None,
            train_split: str = "train",
            val_split: str | None = "validation",
            test_split: str | None = "test",
            val_fraction: float = 0.1,
            split_seed: int = 0,
            image_field: str = "image",
            label_field: str = "label",
            cache_dir: str | None = None,
            img_size: int = 224,
            batch_size: int = 128,
            num_workers: int = 8,
            auto_augment: str | None = "rand-m9-mstd0.5-inc1",
            re_prob: float = 0.25,
            crop_pct: float = 0.875,
            interpolation: str = "bicubic",
            crop_scale: tuple[float, float] = (0.08, 1.0),
            hflip: float = 0.5,
            mean: tuple[float, ...] | None = None,
            std: tuple[float, ...] | None = None,
            in_chans: int = 3,
            device_augment: bool | Literal["auto"] = "auto",
            predict_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_numbers(self.hparams, "data.init_args")
        self.mean, self.std = normalisation(in_chans, mean, std, IMAGENET_MEAN, IMAGENET_STD)
        self._splits = None
        self.train_set: HFImageDataset | None = None
        self.val_set: HFImageDataset | None = None
        self.test_set: HFImageDataset | None = None
        self._split_names: list[str] = []

    def _load(self):
        """``{"train": rows, "val": rows}``, loaded once (``datasets`` caches the download and the arrow files)."""
        if self._splits is not None:
            return self._splits
        import datasets

        hp = self.hparams
        try:
            data = datasets.load_dataset(hp.dataset, hp.dataset_config, data_dir=hp.data_dir, cache_dir=hp.cache_dir)
        except (OSError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise MissingDataError(
                f"data.init_args.dataset={hp.dataset!r}: cannot load it ({reason}); pass a local folder instead: "
                f"--data.init_args.dataset imagefolder --data.init_args.data_dir <folder with train/<class>/ and "
                f"val/<class>/ images>.") from None
        self._split_names = sorted(data)
        if hp.train_split not in data:
            raise ValueError(f"data.init_args.train_split={hp.train_split!r}: the dataset's splits are "
                             f"{sorted(data)}.")
        train = data[hp.train_split]
        for field in (hp.image_field, hp.label_field):
            if field not in train.column_names:
                raise KeyError(f"data.init_args: the dataset has no column {field!r} (columns: {train.column_names}); "
                               f"set image_field / label_field.")
        if hp.val_split and hp.val_split in data:
            val = data[hp.val_split]
        else:
            parts = train.train_test_split(test_size=hp.val_fraction, seed=hp.split_seed,
                                           stratify_by_column=hp.label_field)
            train, val = parts["train"], parts["test"]
        self._splits = {"train": train, "val": val}
        if hp.test_split and hp.test_split in data and hp.test_split != hp.val_split:
            self._splits["test"] = data[hp.test_split]
        return self._splits

    @property
    def num_classes(self) -> int:
        """Classes of the label column; linked into ``model.init_args.arch.num_classes`` by ``moh``. No such
        attribute when the dataset cannot be loaded (the link keeps the config's value, ``setup`` says why)."""
        try:
            feature = self._load()["train"].features[self.hparams.label_field]
        except (OSError, ValueError, KeyError) as error:
            raise AttributeError(f"num_classes: {error}") from None
        if not hasattr(feature, "num_classes"):
            raise AttributeError(f"num_classes: column {self.hparams.label_field!r} is not a ClassLabel")
        return feature.num_classes

    @property
    def class_names(self) -> list[str] | None:
        """The label column's class names (a ``ClassLabel``'s); None when the dataset does not name them."""
        try:
            return list(self._load()["train"].features[self.hparams.label_field].names)
        except (OSError, ValueError, KeyError, AttributeError):
            return None

    @property
    def in_chans(self) -> int:
        return self.hparams.in_chans

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":  # predict_dir alone
            return
        hp = self.hparams
        splits = self._load()
        train_tf, val_tf = self.transforms()
        mode = "L" if hp.in_chans == 1 else "RGB"
        if stage == "test":
            if "test" not in splits:
                raise MissingDataError(
                    f"data.init_args.dataset={hp.dataset!r}: no test split (test_split={hp.test_split!r}; its splits "
                    f"are {self._split_names}); name one with --data.init_args.test_split, or score the validation "
                    f"split with `moh validate`.")
            self.test_set = HFImageDataset(splits["test"], hp.image_field, hp.label_field, val_tf, mode)
            return
        self.train_set = HFImageDataset(splits["train"], hp.image_field, hp.label_field, train_tf, mode)
        self.val_set = HFImageDataset(splits["val"], hp.image_field, hp.label_field, val_tf, mode)

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers,
                          persistent_workers=self.hparams.num_workers > 0)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


__all__ = ["HFImageDataModule", "HFImageDataset"]
