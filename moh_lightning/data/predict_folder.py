"""``moh predict`` for the image data modules: the images of a folder, at any depth and without labels."""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from moh_lightning.data.image_transforms import eval_transform


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
