"""`moh predict` for every task: new images to a CSV of top-k classes, prompts to completions, one-line refusals."""
from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import tiny_llama_config

from moh_lightning.callbacks.predictions import predictions_folder
from moh_lightning.cli import main
from moh_lightning.data.hf_images import HFImageDataModule
from moh_lightning.models.vit import ViTConfig, create_vit
from moh_lightning.tasks import ImageClassifier, LanguageModel
from moh_lightning.tasks.checkpoints import write_checkpoint

TINY_VIT = dict(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=1, num_heads=4,
                mlp_ratio=2.0, global_pool="avg", moh={"num_shared_heads": 2, "top_k": 1})
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _vit_checkpoint(path: Path, **arch) -> Path:
    """A `moh fit`-layout checkpoint of a tiny random ImageClassifier."""
    config = ViTConfig(**{**TINY_VIT, **arch})
    state = {f"model.{name}": value for name, value in create_vit(config).state_dict().items()}
    hparams = {"arch": asdict(config), "mixup_alpha": 0.0, "cutmix_alpha": 0.0}
    return write_checkpoint(path, ImageClassifier, hparams, state, {})


def _new_images(folder: Path, count: int = 5) -> list[str]:
    """``count`` of scikit-learn's digits as PNGs at two depths of ``folder`` (no class folders, no labels)."""
    from sklearn.datasets import load_digits

    digits = (load_digits().images[:count] * 16).clip(0, 255).astype(np.uint8)
    paths = [folder / ("deeper" if i % 2 else ".") / f"digit{i}.png" for i in range(count)]
    for image, path in zip(digits, paths, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").resize((28, 28)).save(path)
    return sorted(str(Path(folder.name) / path.relative_to(folder)) for path in paths)


def _rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as file:
        return list(csv.reader(file))


@pytest.mark.slow
def test_predict_writes_the_top_classes_of_every_new_image_beside_the_run(run_dir, capsys):
    checkpoint = _vit_checkpoint(run_dir / "runs" / "mine" / "version_0" / "checkpoints" / "last.ckpt")
    images = _new_images(run_dir / "new")
    main(["predict", "--config", "vit_tiny_mnist_75.yaml", "--ckpt_path", str(checkpoint), "--trainer.logger=false",
          "--data.init_args.predict_dir", "new", *QUIET])
    written = run_dir / "runs" / "mine" / "version_0" / "predictions" / "new.csv"
    assert f"moh predict: 5 images classified: {written}" in capsys.readouterr().out
    header, *rows = _rows(written)
    assert header == ["file", *[f"{c}_{k}" for k in range(1, 6) for c in ("class", "probability")]]
    assert sorted(row[0] for row in rows) == images
    for row in rows:
        assert set(row[1::2]) <= set("0123456789")  # MNIST's class names, the digits
        probs = [float(p) for p in row[2::2]]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-5


def test_predict_names_the_folder_modules_classes_without_a_val_folder(run_dir, capsys):
    for name in ("cat", "dog"):  # only train/ class folders: predict needs no val/
        (run_dir / "pets" / "train" / name).mkdir(parents=True)
    _new_images(run_dir / "new", count=3)
    checkpoint = _vit_checkpoint(run_dir / "pets.ckpt", num_classes=2, img_size=32, patch_size=8)
    main(["predict", "--config", "vit_tiny_folder_digits_75.yaml", "--ckpt_path", str(checkpoint),
          "--data.init_args.data_dir", "pets", "--data.init_args.predict_dir", "new",
          "--predictions.output", "out", "--trainer.logger=false", *QUIET])
    header, *rows = _rows(run_dir / "out" / "new.csv")
    assert header == ["file", "class_1", "probability_1", "class_2", "probability_2"]
    assert len(rows) == 3 and all({row[1], row[3]} == {"cat", "dog"} for row in rows)
    assert f"moh predict: 3 images classified: {Path('out') / 'new.csv'}" in capsys.readouterr().out


def test_the_datasets_module_names_classes_by_its_label_column(tmp_path, write_image_folder):
    write_image_folder(tmp_path / "pets")  # RGB images of cats and dogs
    (tmp_path / "new").mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "new" / "red.jpg")
    data = HFImageDataModule("imagefolder", data_dir=str(tmp_path / "pets"), cache_dir=str(tmp_path / "cache"),
                             img_size=24, in_chans=1, num_workers=0, predict_dir=str(tmp_path / "new"))
    assert data.class_names == ["cat", "dog"]
    data.setup("predict")
    images, index = next(iter(data.predict_dataloader()))
    assert images.shape == (1, 1, 24, 24) and index.tolist() == [0]  # read as grayscale, as in_chans=1 trains


def test_predict_continues_every_prompt_as_moh_generate_does(run_dir, capsys):
    config = tiny_llama_config()
    torch.manual_seed(0)
    task = LanguageModel(config)
    task.configure_model()
    checkpoint = write_checkpoint(run_dir / "lm.ckpt", LanguageModel, {"arch": asdict(config)}, task.state_dict(),
                                  {"tokenizer": "byte"})
    (run_dir / "prompts.txt").write_text("def parse(\n\nimport os\nclass A:\n")
    main(["predict", "--config", "llm_stdlib_75.yaml", "--ckpt_path", str(checkpoint), "--trainer.logger=false",
          "--data.init_args.predict_prompts", "prompts.txt", "--model.init_args.max_new_tokens=12", *QUIET])
    written = run_dir / "predictions" / "prompts.jsonl"
    assert f"moh predict: 3 prompts continued: {written}" in capsys.readouterr().out
    lines = [json.loads(line) for line in written.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == ["def parse(", "import os", "class A:"] and lines[0]["completion"]
    main(["generate", "--checkpoint", str(checkpoint), "--prompt", "def parse(", "--max_new_tokens", "12"])
    assert lines[0]["prompt"] + lines[0]["completion"] in capsys.readouterr().out


@pytest.mark.parametrize("config, says", [
    ("vit_tiny_mnist_75.yaml", "pass --data.init_args.predict_dir <folder>"),
    ("llm_stdlib_75.yaml", "pass --data.init_args.predict_prompts <file>"),
    ("dit_mnist_90.yaml", "use moh sample --checkpoint"),
])
def test_predict_without_its_input_stops_in_one_line(config, says, run_dir):
    with pytest.raises(SystemExit) as stop:
        main(["predict", "--config", config, "--trainer.logger=false"])
    message = str(stop.value.code)
    assert message.startswith("moh predict: ") and says in message and "\n" not in message


@pytest.mark.slow
def test_predict_input_that_is_not_there_is_named(run_dir):
    (run_dir / "empty").mkdir()
    for folder, says in (("missing", "no such folder"), ("empty", "no image file")):
        with pytest.raises(SystemExit, match=f"predict_dir='{folder}': {says}"):
            main(["predict", "--config", "vit_tiny_mnist_75.yaml", "--trainer.logger=false",
                  "--data.init_args.predict_dir", folder])


def test_predictions_go_beside_the_checkpoints_run(tmp_path):
    class Trainer:
        ckpt_path, log_dir = None, str(tmp_path / "runs" / "x" / "version_3")

    trainer = Trainer()
    assert predictions_folder("out", trainer) == Path("out")
    assert predictions_folder(None, trainer) == tmp_path / "runs" / "x" / "version_3" / "predictions"
    trainer.ckpt_path = "runs/a/version_1/checkpoints/last.ckpt"
    assert predictions_folder(None, trainer) == Path("runs/a/version_1/predictions")
    trainer.ckpt_path = "downloads/theirs.ckpt"
    assert predictions_folder(None, trainer) == Path("downloads/predictions")
