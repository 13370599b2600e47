"""The image transforms finished on the device (uint8 from the workers; normalisation and Random Erasing after the
copy) give what the worker-side transforms give: exactly for normalisation, in distribution for the erasing."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from moh_lightning.data.images import ImageFolderDataModule

KW = dict(img_size=32, batch_size=50, num_workers=0, auto_augment=None, hflip=0.0, crop_pct=1.0,
          crop_scale=(1.0, 1.0), mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))


def _module(root, device_augment, re_prob=0.0, training=False) -> ImageFolderDataModule:
    module = ImageFolderDataModule(str(root), re_prob=re_prob, device_augment=device_augment, **KW)
    module.trainer = SimpleNamespace(training=training, world_size=1,
                                     strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module.setup("fit")
    return module


def _batches(module, loader):
    return [module.on_after_batch_transfer(batch, 0)[0] for batch in loader]


def test_device_side_normalisation_equals_the_workers(tmp_path, write_image_folder):
    write_image_folder(tmp_path, per_class=10, size=(32, 32))
    workers, device = _module(tmp_path, False), _module(tmp_path, True)
    raw = next(iter(device.val_dataloader()))[0]
    assert raw.dtype == torch.uint8  # the workers hand over uint8: a quarter of the bytes to copy
    for ours, theirs in zip(_batches(device, device.val_dataloader()), _batches(workers, workers.val_dataloader()),
                            strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def _erased_share(images: torch.Tensor) -> tuple[float, float]:
    """Share of images with an erased (all-zero after normalisation) rectangle, and the mean erased area."""
    zero = (images == 0).all(1)                                   # (B, H, W): every channel zeroed
    area = zero.float().mean((1, 2))
    return float((area > 0).float().mean()), float(area[area > 0].mean())


def test_device_side_random_erasing_has_the_workers_distribution(tmp_path, write_image_folder):
    torch.manual_seed(0)
    write_image_folder(tmp_path, per_class=100, size=(32, 32))
    workers = _module(tmp_path, False, re_prob=0.5, training=True)
    device = _module(tmp_path, True, re_prob=0.5, training=True)
    # The training loaders, whose crop is the whole image here (crop_scale 1): only the erasing differs.
    worker_images = torch.cat([b[0] for b in workers.train_dataloader()])
    device_images = torch.cat(_batches(device, device.train_dataloader()))
    (worker_share, worker_area), (device_share, device_area) = map(_erased_share, (worker_images, device_images))
    assert abs(worker_share - 0.5) < 0.1 and abs(device_share - 0.5) < 0.1
    assert abs(worker_area - device_area) < 0.08
    device.trainer.training = False  # evaluation is never erased
    assert _erased_share(torch.cat(_batches(device, device.val_dataloader())))[0] == 0.0


def test_auto_finishes_on_the_device_only_for_a_cuda_trainer(tmp_path, write_image_folder):
    write_image_folder(tmp_path, per_class=1, size=(32, 32))
    module = ImageFolderDataModule(str(tmp_path), **KW)
    assert module.hparams.device_augment == "auto" and not module.device_side()
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda")))
    assert module.device_side()
