"""`benchmarks/loader.py`: the ImageNet recipe's training loader alone, as rows of loader.json and its page."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from benchmarks import loader


@pytest.mark.slow
def test_synthetic_jpegs_rows_and_page(run_dir, capsys):
    loader.main(["--quick", "true", "--workers", "[0]", "--output", "out/loader.json"])
    rows = json.loads((run_dir / "out/loader.json").read_text())
    assert [(r["device_augment"], r["workers"]) for r in rows] == [(True, 0), (False, 0)]
    assert all(r["images_per_s"] > 0 and r["per_worker"] == r["images_per_s"] and r["batch"] == 16 for r in rows)
    # device_augment true hands the GPU uint8 images to normalise; false has the workers finish float ones.
    assert [(r["dtype"], r["shape"]) for r in rows] == [("uint8", [3, 224, 224]), ("float32", [3, 224, 224])]
    text = (run_dir / "out/loader.md").read_text()
    assert "synthetic JPEGs" in text and "| True | 0 |" in text and "not yet measured on a GPU" in text
    assert "loader: device_augment False" in capsys.readouterr().out
    assert not list(run_dir.glob("**/*.JPEG"))  # the synthetic folder is a temporary one, gone afterwards


def test_own_folder_is_read_not_written(run_dir):
    rng = np.random.default_rng(0)
    for split, count in (("train", 10), ("val", 1)):  # one quick batch an epoch: read again, epoch after epoch
        for label in ("cat", "dog"):
            (run_dir / "own" / split / label).mkdir(parents=True)
            for i in range(count):
                image = Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
                image.save(run_dir / "own" / split / label / f"{i}.JPEG")
    before = sorted(p.relative_to(run_dir) for p in (run_dir / "own").rglob("*"))
    loader.main(["--quick", "true", "--workers", "[1]", "--data", "own", "--output", "out/loader.json"])
    rows = json.loads((run_dir / "out/loader.json").read_text())
    assert [r["workers"] for r in rows] == [1, 1] and all(r["images_per_s"] > 0 for r in rows)
    assert "20 training images of the given folder" in (run_dir / "out/loader.md").read_text()
    assert sorted(p.relative_to(run_dir) for p in (run_dir / "own").rglob("*")) == before


def test_missing_folder_is_one_line_naming_the_option(run_dir):
    with pytest.raises(SystemExit) as exit_info:
        loader.main(["--quick", "true", "--data", "nowhere"])
    message = str(exit_info.value.code)
    assert "--data nowhere" in message and "\n" not in message
    assert not (run_dir / "results").exists()


def test_gpu_comparison_reads_the_compiled_dense_vit_s_row(run_dir):
    (run_dir / "results/gpu").mkdir(parents=True)
    step = {"config": "vit_s_75", "baseline": "vit_s_100", "device": "NVIDIA H100", "batch": 128}
    (run_dir / "results/gpu/steps.json").write_text(json.dumps([{**step, "compile": False, "baseline_ms": 100.0},
                                                                {**step, "compile": True, "baseline_ms": 64.0}]))
    rows = [{"device_augment": True, "workers": 1, "per_worker": 250.0, "images_per_s": 250.0},
            {"device_augment": True, "workers": 16, "per_worker": 200.0, "images_per_s": 3200.0},
            {"device_augment": False, "workers": 16, "per_worker": 100.0, "images_per_s": 1600.0}]
    text = "\n".join(loader.against_gpu(rows))
    assert "NVIDIA H100: 2000 images/s" in text and "16 workers (device_augment true): 3200 images/s, enough" in text
    assert "2000 / 250 = 8.0 at the rate of 1 worker and 2000 / 200 = 10.0 at the rate of 16 workers" in text
