"""A folder of one's own images to samples by class name: `dit_folder_90.yaml` on a flat folder, `moh sample
--classes` by name, and the names in the files, `sample_args.json` and the head-load views."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import run_checkpoints

from moh_lightning.cli import main
from moh_lightning.configs import resolve_config
from moh_lightning.data.digits import DIGIT_WORDS, write_digits_folder
from moh_lightning.layers import activated_head_fraction
from moh_lightning.trainer_cli import MoHLightningCLI

FEW_STEPS = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
             "--trainer.enable_progress_bar", "false", "--trainer.callbacks+=null"]


@pytest.fixture(scope="module")
def dit_checkpoint(tmp_path_factory):
    """dit_folder_90.yaml trained two steps on scikit-learn's digits as a flat folder of 16x16 grey PNGs."""
    root = tmp_path_factory.mktemp("walk")
    write_digits_folder(root / "digits", size=16, flat=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        main(["fit", "--config", "dit_folder_90.yaml", "--data.init_args.data_dir", "digits",
              "--data.init_args.in_chans", "1", "--data.init_args.img_size", "16", "--data.init_args.val_fraction",
              "0.05", *FEW_STEPS])
    return run_checkpoints("dit_folder_90", root) / "last.ckpt"


@pytest.mark.slow
def test_dit_folder_trains_from_a_flat_folder_and_keeps_its_class_names(dit_checkpoint):
    raw = torch.load(dit_checkpoint, map_location="cpu", weights_only=True)
    names = raw["hyper_parameters"]["class_names"]
    assert names == sorted(DIGIT_WORDS)  # labels numbered by the sorted folder names
    arch = raw["hyper_parameters"]["arch"]
    assert (arch["img_size"], arch["in_chans"], arch["num_classes"]) == (16, 1, 10)  # all from the data
    assert raw["datamodule_hyper_parameters"]["mean"] == [0.5]  # [-1, 1]
    summary = (dit_checkpoint.parents[1] / "head_load" / "summary.md").read_text()
    assert "collapsed" in summary
    loads = json.loads((dit_checkpoint.parents[1] / "head_load" / "loads.json").read_text())
    classes = next(group for group in loads["groups"] if group["kind"] == "class")
    shown = [label.split(": ")[1] for label in classes["labels"]]  # the classes the validation batches held
    assert shown == names[:len(shown)] and len(shown) > 1  # per-class views: in index order, named


@pytest.mark.slow
def test_sample_by_name_writes_named_files(dit_checkpoint, tmp_path, capsys):
    out = tmp_path / "samples"
    main(["sample", "--checkpoint", str(dit_checkpoint), "--out_dir", str(out), "--num_samples", "3",
          "--classes", "[zero, seven]", "--steps", "2", "--sampler", "ddim"])
    zero, seven = sorted(DIGIT_WORDS).index("zero"), sorted(DIGIT_WORDS).index("seven")
    assert sorted(path.name for path in (out / "images").iterdir()) == [
        f"000000_c{zero}_zero.png", f"000001_c{seven}_seven.png", f"000002_c{zero}_zero.png"]
    args = json.loads((out / "sample_args.json").read_text())
    assert args["classes"] == ["zero", "seven"]
    assert list(args["class_names"].items()) == [(str(zero), "zero"), (str(seven), "seven")]  # in the order asked
    assert "samples of zero, seven" in capsys.readouterr().out
    main(["sample", "--checkpoint", str(dit_checkpoint), "--out_dir", str(tmp_path / "by_number"), "--num_samples",
          "1", "--classes", f"[{seven}]", "--steps", "2", "--sampler", "ddim"])
    assert [path.name for path in (tmp_path / "by_number" / "images").iterdir()] == [f"000000_c{seven}_seven.png"]
    with pytest.raises(SystemExit, match="'sevn' is not a class of this checkpoint \\(did you mean 'seven'\\?\\)"):
        main(["sample", "--checkpoint", str(dit_checkpoint), "--out_dir", str(tmp_path / "x"), "--classes", "[sevn]"])


@pytest.mark.slow
def test_vit_folder_config_trains_on_a_flat_folder_with_its_classes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_digits_folder(tmp_path / "digits", size=32, flat=True)
    cli = MoHLightningCLI(args=["fit", "--config", resolve_config("vit_tiny_folder_digits_75.yaml"),
                                "--data.init_args.data_dir", "digits", "--trainer.fast_dev_run", "1"])
    assert cli.trainer.global_step == 1 and math.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert cli.datamodule.class_names == sorted(DIGIT_WORDS)  # the folder names, sorted, are the classes
    assert cli.model.model.num_classes == 10 and cli.model.model.patch_embed.proj.in_channels == 1  # from the data
    assert activated_head_fraction(cli.model) == pytest.approx(0.75, abs=0.01)  # the budget in the config's name


def test_the_grid_has_a_row_per_class_in_the_order_asked(tmp_path):
    """`moh sample --classes "[zero, one, ..., nine]"` once drew its rows in label order: eight, five, four, ..."""
    from PIL import Image

    from moh_lightning.tools.sample import save_class_grid

    labels = np.array([9, 1, 4, 9, 1, 4])  # e.g. zero, one, two as numbered by their sorted folder names
    images = np.stack([np.full((2, 2, 3), label * 20, np.uint8) for label in labels])
    save_class_grid(images, labels, tmp_path / "grid.png", per_class=2, rows=[9, 1, 4])
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert [int(grid[row * 2, 0, 0]) for row in range(3)] == [180, 20, 80]
    save_class_grid(images, labels, tmp_path / "drawn.png", per_class=2)  # drawn classes: label order
    assert [int(np.asarray(Image.open(tmp_path / "drawn.png"))[row * 2, 0, 0]) for row in range(3)] == [20, 80, 180]
