"""The image transforms every image task shares: timm's ``create_transform`` with the suite's switches, and their
last steps (uint8 to float, normalisation, Random Erasing) on the device after the copy (``DeviceAugment``)."""
from __future__ import annotations

import torch
from PIL import Image
from timm.data import auto_augment as timm_auto_augment
from timm.data import create_transform
from timm.data.random_erasing import RandomErasing

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


def normalisation(in_chans: int, mean, std, default_mean, default_std) -> tuple[tuple, tuple]:
    """``mean`` / ``std`` as given, else the defaults, averaged down to one channel for grayscale input."""
    if in_chans not in (1, 3):
        raise ValueError(f"data.init_args.in_chans={in_chans}: choose 1 (grayscale) or 3 (RGB).")
    mean = tuple(mean) if mean is not None else tuple(default_mean)
    std = tuple(std) if std is not None else tuple(default_std)
    if in_chans == 1 and len(mean) == 3 and len(std) == 3 and (mean, std) == (tuple(default_mean),
                                                                            tuple(default_std)):
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    if in_chans == 3 and len(mean) == 1 and len(std) == 1:  # one value for every channel, as [0.5] for [-1, 1]
        mean, std = mean * 3, std * 3
    if len(mean) != in_chans or len(std) != in_chans:
        raise ValueError(f"data.init_args.mean={list(mean)} / std={list(std)}: give one value per channel "
                         f"(in_chans={in_chans}).")
    return mean, std


def image_transforms(img_size: int, in_chans: int, crop_scale, hflip: float, auto_augment, re_prob: float,
                     interpolation: str, crop_pct: float, mean, std, on_device: bool = False, ratio=None,
                     color_jitter: float = 0.4):
    """timm's ``create_transform`` for training and for validation, with timm's own argument names.

    ``ratio`` is the random-resized crop's aspect-ratio range (None: timm's 3/4-4/3); ``color_jitter`` applies only
    without ``auto_augment``, as in timm. ``on_device``: the loader workers crop, flip and augment only, and hand over
    uint8 tensors (a quarter of float32's bytes to copy); normalisation and Random Erasing run on the device after the
    copy (``DeviceAugment``), as timm's ``PrefetchLoader`` does.
    """
    size = (in_chans, img_size, img_size)
    train = create_transform(size, is_training=True, scale=tuple(crop_scale), hflip=hflip,
                             ratio=tuple(ratio) if ratio is not None else None, color_jitter=color_jitter,
                             auto_augment=auto_augment, re_prob=re_prob, interpolation=interpolation,
                             mean=mean, std=std, use_prefetcher=on_device)
    for step in train.transforms:
        for op in getattr(step, "ops", ()):  # RandAugment's and AugMix's
            if op.aug_fn is timm_auto_augment.posterize:
                op.aug_fn = posterize
    return train, eval_transform(img_size, in_chans, interpolation, crop_pct, mean, std, on_device)


def posterize(image: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize op, at 0 bits too: an all-black image, as TensorFlow's RandAugment and older Pillow give.

    RandAugment's top magnitude keeps no bits (``inc1``), and ``rand-m9-mstd0.5`` draws it (9 + 0.5 sigma, clipped at
    10) for about 2% of its posterize ops; Pillow 13 (this suite's) refuses 0 bits, so a loader worker stopped an
    ImageNet-recipe run with a ValueError within its first thousand or so images.
    """
    if bits_to_keep <= 0:
        return Image.new(image.mode, image.size)
    return timm_auto_augment.posterize(image, bits_to_keep)


def eval_transform(img_size: int, in_chans: int, interpolation: str, crop_pct: float, mean, std,
                   on_device: bool = False):
    """timm's ``create_transform`` for validation, test and prediction: resize, centre crop, normalise (on the device
    after the copy when ``on_device``: uint8 out)."""
    return create_transform((in_chans, img_size, img_size), is_training=False, crop_pct=crop_pct,
                            interpolation=interpolation, mean=mean, std=std, use_prefetcher=on_device)


class DeviceAugment:
    """The last steps of the image transforms on the device, after the batch is copied there (timm's prefetcher's
    work, as a ``LightningDataModule`` hook): uint8 to float, normalisation, and in training Random Erasing.

    ``device_augment``: ``auto`` does this when the Trainer runs on CUDA (the loader workers then deliver what the GPU
    consumes with fewer cores), ``true`` on any device, ``false`` never (the workers normalise and erase, as timm's
    transforms alone do). Mixup / CutMix run on the device in the task either way.
    """

    def device_side(self) -> bool:
        """Whether this run's loaders hand over uint8 images for the device to finish."""
        setting = self.hparams.device_augment
        if setting == "auto":
            return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return bool(setting)

    def transforms(self):
        """(training, validation) transforms of this module's switches, finished on the device when ``device_side``."""
        hp = self.hparams
        self._device_side = self.device_side()
        # ratio and color_jitter are the folder module's; the others keep timm's defaults.
        return image_transforms(hp.img_size, hp.in_chans, hp.crop_scale, hp.hflip, hp.auto_augment, hp.re_prob,
                                hp.interpolation, hp.crop_pct, self.mean, self.std, on_device=self._device_side,
                                ratio=hp.get("ratio"), color_jitter=hp.get("color_jitter", 0.4))

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if not getattr(self, "_device_side", False) or not isinstance(batch, (tuple, list)) \
                or batch[0].dtype != torch.uint8:
            return batch
        images = batch[0]
        channels = images.shape[1]
        mean = torch.tensor(self.mean, device=images.device).view(1, channels, 1, 1) * 255
        std = torch.tensor(self.std, device=images.device).view(1, channels, 1, 1) * 255
        images = (images.float() - mean) / std
        if self.hparams.re_prob > 0 and self.trainer is not None and self.trainer.training:
            images = self._random_erasing(images.device)(images)
        return (images, *batch[1:])

    def _random_erasing(self, device: torch.device) -> RandomErasing:
        erasing = getattr(self, "_erasing", None)
        if erasing is None or erasing.device != device:
            # timm's own, as its prefetcher and its worker-side transform use it: the same distribution either side.
            erasing = self._erasing = RandomErasing(self.hparams.re_prob, mode="const", device=device)
        return erasing
