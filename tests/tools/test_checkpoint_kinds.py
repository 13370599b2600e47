"""Every tool reads the checkpoint's task first and, given another kind, stops in one line."""
from __future__ import annotations

import pytest
import torch

from moh_lightning.cli import main as moh
from moh_lightning.models.llama import LlamaConfig
from moh_lightning.tasks.checkpoints import checkpoint_task, read_checkpoint


def _checkpoint(path, class_path):
    torch.save({"hyper_parameters": {"_class_path": class_path, "lr": 1e-3}, "state_dict": {}}, path)
    return str(path)


@pytest.fixture
def checkpoints(tmp_path):
    return {"vit": _checkpoint(tmp_path / "vit.ckpt", "moh_lightning.tasks.ImageClassifier"),
            "lm": _checkpoint(tmp_path / "lm.ckpt", "moh_lightning.tasks.LanguageModel"),
            "dit": _checkpoint(tmp_path / "dit.ckpt", "moh_lightning.tasks.ClassConditionalDiffusion"),
            "transnext": _checkpoint(tmp_path / "tn.ckpt", "moh_lightning.tasks.classification.TransNeXtClassifier")}


@pytest.mark.parametrize("args,kind,fits", [
    (["generate", "--checkpoint", "{vit}", "--prompt", "x"], "ImageClassifier", "export-timm"),
    (["export-hf", "--checkpoint", "{dit}", "--out", "o"], "ClassConditionalDiffusion", "moh sample"),
    (["sample", "--checkpoint", "{lm}"], "LanguageModel", "moh generate"),
    (["export-timm", "--checkpoint", "{lm}", "--out", "o"], "LanguageModel", "moh lm-eval"),
])
def test_wrong_kind_stops_in_one_line(args, kind, fits, checkpoints, run_dir):
    with pytest.raises(SystemExit) as stop:
        moh([a.format(**checkpoints) for a in args])
    message = str(stop.value.code)
    assert "\n" not in message and f"is a {kind} checkpoint" in message and fits in message, message


def test_lm_eval_checks_too(checkpoints):
    from moh_lightning.tools.lm_eval import MoHLM

    with pytest.raises(SystemExit, match="moh lm-eval: .* is a ClassConditionalDiffusion checkpoint"):
        MoHLM(checkpoints["dit"])


def test_digit_quality_checks_its_classifier(checkpoints):
    import numpy as np

    from moh_lightning.tools.digit_quality import score_digits

    with pytest.raises(SystemExit, match="digit_quality: .* is a TransNeXtClassifier checkpoint.*export-timm"):
        score_digits(np.zeros((2, 32, 32, 3), np.uint8), np.zeros(2, np.int64), checkpoints["transnext"])


def test_kind_without_class_path():
    assert checkpoint_task({"hyper_parameters": {"arch": LlamaConfig()}}) == "LanguageModel"
    assert checkpoint_task({"hyper_parameters": {}, "state_dict": {"model.y_embedder.embedding_table.weight": 0}}) \
        == "ClassConditionalDiffusion"
    assert checkpoint_task({"hyper_parameters": {}, "state_dict": {}}) == "unknown"


def test_right_kind_passes(checkpoints):
    from moh_lightning.tasks.classification import ImageClassifier, TransNeXtClassifier

    raw = read_checkpoint(checkpoints["transnext"], (ImageClassifier, TransNeXtClassifier), "export-timm")
    assert raw["hyper_parameters"]["lr"] == 1e-3
