"""A Hugging Face ``datasets`` image data module (a local imagefolder here; hub ids the same way)."""
from __future__ import annotations

import pytest

from moh_lightning.data.hf_images import HFImageDataModule
from moh_lightning.trainer_cli import MoHLightningCLI


def test_local_imagefolder_through_datasets(tmp_path, write_image_folder):
    write_image_folder(tmp_path / "pets", per_class=6)
    dm = HFImageDataModule("imagefolder", data_dir=str(tmp_path / "pets"), cache_dir=str(tmp_path / "cache"),
                           img_size=24, num_workers=0, batch_size=4, hflip=0.0, in_chans=1, auto_augment=None)
    assert dm.num_classes == 2 and dm.in_chans == 1
    dm.setup("fit")
    assert len(dm.train_set) == 12 and len(dm.val_set) == 12  # val/ is datasets' validation split
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 1, 24, 24) and set(labels.tolist()) <= {0, 1}


def test_without_a_validation_split_holds_out_a_fraction(tmp_path, write_image_folder):
    write_image_folder(tmp_path / "pets", per_class=10)
    dm = HFImageDataModule("imagefolder", data_dir=str(tmp_path / "pets"), cache_dir=str(tmp_path / "cache"),
                           val_split=None, val_fraction=0.2, img_size=24, num_workers=0)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (16, 4)


def test_classes_reach_the_model_and_offline_hub_name_says_what_to_pass(tmp_path, write_image_folder, monkeypatch):
    write_image_folder(tmp_path / "pets")
    cli = MoHLightningCLI(args=["--config", "vit_tiny_folder_digits_75.yaml", "--trainer.logger", "false",
                                "--data", "moh_lightning.data.hf_images.HFImageDataModule",
                                "--data.init_args.dataset", "imagefolder",
                                "--data.init_args.data_dir", str(tmp_path / "pets"),
                                "--data.init_args.cache_dir", str(tmp_path / "cache")], run=False)
    assert cli.model.hparams.arch["num_classes"] == 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dm = HFImageDataModule("someone/not-cached-images", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(OSError, match="pass a local folder instead") as error:
        dm.setup("fit")
    assert "\n" not in str(error.value)
