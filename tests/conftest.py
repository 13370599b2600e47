import os

import numpy as np
import pytest
import torch
from PIL import Image

# Two threads at most: the suite runs on a 2-core CI machine.
torch.set_num_threads(min(2, torch.get_num_threads()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """An empty working folder, so relative run folders land in tmp and shipped configs resolve by name."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def write_image_folder():
    """Writes random PNGs in ImageNet's layout (root/{train,val}/{cat,dog}/i.png)."""
    def write(root, per_class: int = 4, size: tuple[int, int] = (40, 48)) -> None:
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            for label in ("cat", "dog"):
                folder = root / split / label
                folder.mkdir(parents=True)
                for i in range(per_class):
                    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return write
