"""Images: timm's augmentation switches on the folder and MNIST modules, grayscale folders, digits."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as T

from moh_lightning.data.digits import DIGIT_WORDS, write_digits_folder
from moh_lightning.data.images import ImageFolderDataModule, MNISTDataModule
from moh_lightning.errors import MissingDataError

SWITCHES = ("crop_scale", "hflip", "mean", "std", "auto_augment", "re_prob", "interpolation", "crop_pct", "in_chans")


def _parts(transform, kind):
    return [t for t in transform.transforms if isinstance(t, kind)]


def test_both_modules_take_timms_switch_names():
    for module in (ImageFolderDataModule, MNISTDataModule):
        assert set(SWITCHES) <= set(inspect.signature(module).parameters), module


def test_folder_defaults_stay_the_imagenet_recipe(tmp_path, write_image_folder):
    write_image_folder(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), img_size=32, num_workers=0)
    assert set(dm.hparams) == {"data_dir", "img_size", "batch_size", "num_workers", "auto_augment", "re_prob",
                               "crop_pct", "interpolation", "on_corrupt", "crop_scale", "hflip", "mean", "std",
                               "in_chans", "predict_dir", "device_augment", "val_fraction", "split_seed", "ratio",
                               "color_jitter", "classes"}
    dm.setup("fit")
    (crop,) = _parts(dm.train_set.transform, RandomResizedCropAndInterpolation)
    assert crop.scale == (0.08, 1.0)
    assert _parts(dm.train_set.transform, T.RandomHorizontalFlip)[0].p == 0.5
    (norm,) = _parts(dm.val_set.transform, T.Normalize)
    assert torch.allclose(norm.mean, torch.tensor([0.485, 0.456, 0.406]))
    assert dm.train_set[0][0].shape == (3, 32, 32) and dm.num_classes == 2 and dm.in_chans == 3


def test_folder_switches_and_grayscale(tmp_path, write_image_folder):
    write_image_folder(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), img_size=24, num_workers=0, hflip=0.0, crop_scale=(0.7, 1.0),
                               auto_augment=None, re_prob=0.0, in_chans=1, mean=(0.3,), std=(0.3,), crop_pct=1.0,
                               interpolation="bilinear")
    assert dm.hparams.hflip == 0.0 and dm.hparams.in_chans == 1  # set switches are recorded
    dm.setup("fit")
    assert _parts(dm.train_set.transform, T.RandomHorizontalFlip) == []
    assert _parts(dm.train_set.transform, RandomResizedCropAndInterpolation)[0].scale == (0.7, 1.0)
    image, label = dm.train_set[0]
    assert image.shape == (1, 24, 24) and dm.val_set[0][0].shape == (1, 24, 24)
    # grayscale with ImageNet's statistics averaged over the channels when mean / std are not given
    gray = ImageFolderDataModule(str(tmp_path), in_chans=1)
    assert gray.mean == pytest.approx((np.mean([0.485, 0.456, 0.406]),))
    # one value serves every channel ([-1, 1] for diffusion); two for three channels is a mistake
    assert ImageFolderDataModule(str(tmp_path), mean=(0.5,), std=(0.5,)).mean == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="one value per channel"):
        ImageFolderDataModule(str(tmp_path), mean=(0.5, 0.5), std=(0.5, 0.5))


@pytest.mark.slow
def test_flat_folder_holds_out_a_seeded_share_of_every_class(tmp_path):
    root = write_digits_folder(tmp_path / "digits", size=16, flat=True)
    assert sorted(p.name for p in root.iterdir()) == sorted(DIGIT_WORDS)
    dm = ImageFolderDataModule(str(root), img_size=16, in_chans=1, val_fraction=0.2, split_seed=3)
    assert dm.flat and dm.num_classes == 10 and dm.class_names == sorted(DIGIT_WORDS)
    dm.setup("fit")
    train, val = dm.train_set.samples, dm.val_set.samples
    assert len(train) + len(val) == 1797 and not {path for path, _ in train} & {path for path, _ in val}
    for label, name in enumerate(dm.class_names):  # labels by sorted folder name, about a fifth of each class held out
        files = [path for path, target in train + val if target == label]
        assert all(Path(path).parent.name == name for path in files)
        assert sum(target == label for _, target in val) == round(len(files) * 0.2)
    again = ImageFolderDataModule(str(root), img_size=16, in_chans=1, val_fraction=0.2, split_seed=3)
    again.setup("validate")
    assert again.val_set.samples == val  # the same split in every run and process
    other = ImageFolderDataModule(str(root), img_size=16, in_chans=1, val_fraction=0.2, split_seed=4)
    other.setup("fit")
    assert other.val_set.samples != val
    assert dm.train_set[0][0].shape == (1, 16, 16) and dm.val_set.transform is not dm.train_set.transform
    with pytest.raises(MissingDataError, match="flat folder holds training and validation images only"):
        dm.setup("test")
    with pytest.raises(ValueError, match="val_fraction"):
        ImageFolderDataModule(str(root), val_fraction=1.0)


def test_folder_errors_name_both_layouts(tmp_path):
    with pytest.raises(MissingDataError, match=r"<class>/ image folders \(or train/<class>/"):
        ImageFolderDataModule(str(tmp_path / "missing")).setup("fit")
    (tmp_path / "split" / "train" / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8), np.uint8), mode="L").save(tmp_path / "split" / "train" / "a" / "0.png")
    with pytest.raises(MissingDataError, match="no 'val/' folder beside it"):
        ImageFolderDataModule(str(tmp_path / "split")).setup("fit")


def test_mnist_takes_the_same_switches():
    dm = MNISTDataModule(crop_scale=(0.85, 1.0), auto_augment=None, re_prob=0.0)
    assert dm.hparams.hflip == 0.0 and dm.hparams.crop_scale == (0.85, 1.0)
    dm.setup("fit")
    assert _parts(dm.train_set.transform, T.RandomHorizontalFlip) == []
    rgb = MNISTDataModule(in_chans=3, hflip=0.5, auto_augment=None, re_prob=0.0)
    rgb.setup("fit")
    assert rgb.train_set[0][0].shape == (3, 28, 28) and rgb.in_chans == 3
    assert _parts(rgb.train_set.transform, T.RandomHorizontalFlip)[0].p == 0.5


def test_digits_folder(tmp_path):
    root = write_digits_folder(tmp_path / "digits", size=32)
    train = sorted((root / "train").glob("*/*.png"))
    val = sorted((root / "val").glob("*/*.png"))
    assert (len(train), len(val)) == (1438, 359)
    assert sorted(p.name for p in (root / "train").iterdir()) == [str(d) for d in range(10)]
    with Image.open(train[0]) as image:
        assert image.mode == "L" and image.size == (32, 32)
    assert not {p.name for p in train} & {p.name for p in val}


def test_randaugments_top_posterize_magnitude_blackens_instead_of_failing(tmp_path, write_image_folder):
    # The ImageNet recipe's rand-m9-mstd0.5-inc1 draws magnitude 10 (no bits kept) for ~2% of its posterize ops.
    from timm.data.auto_augment import AugmentOp, RandAugment

    from moh_lightning.data.image_transforms import posterize

    write_image_folder(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), img_size=32, num_workers=0, auto_augment="rand-m9-mstd0.5-inc1")
    dm.setup("fit")
    (augment,) = _parts(dm.train_set.transform, RandAugment)
    ops = [op for op in augment.ops if op.name.startswith("Posterize")]
    assert ops and all(op.aug_fn is posterize for op in ops)
    top = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    top.aug_fn = ops[0].aug_fn
    image = Image.new("RGB", (8, 8), (200, 100, 50))
    assert top(image).getextrema() == ((0, 0),) * 3 and posterize(image, 4).getpixel((0, 0)) == (192, 96, 48)


@pytest.mark.parametrize("flat", [True, False])
def test_classes_number_the_labels_in_the_order_given(tmp_path, flat):
    """A folder of zero/ ... nine/ numbered alphabetically put the per-class dashboards and sample grids in the order
    eight, five, four, ...; ``classes`` numbers them as listed, in every split."""
    words = ["zero", "one", "two"]
    rng = np.random.default_rng(0)
    for split in [""] if flat else ["train", "val"]:
        for word in words:
            (tmp_path / split / word).mkdir(parents=True)
            for i in range(4):
                image = Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
                image.save(tmp_path / split / word / f"{i}.png")
    data = ImageFolderDataModule(str(tmp_path), img_size=8, num_workers=0, val_fraction=0.5, classes=words)
    assert data.class_names == words and ImageFolderDataModule(str(tmp_path)).class_names == sorted(words)
    data.setup("fit")
    for split in (data.train_set, data.val_set):
        labelled = {(Path(path).parent.name, label) for path, label in split.samples}
        assert labelled == {(word, i) for i, word in enumerate(words)}
    with pytest.raises(ValueError, match=r"data.init_args.classes leaves out two: list every class folder .* once"):
        ImageFolderDataModule(str(tmp_path), img_size=8, classes=["zero", "one"]).setup("fit")
