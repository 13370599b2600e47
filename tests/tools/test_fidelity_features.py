"""`moh fidelity --features`: the Fréchet distance, precision and recall in a suite classifier's features."""
from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

from moh_lightning.cli import main
from moh_lightning.data.digits import DIGIT_WORDS, write_digits_folder
from moh_lightning.models.vit import ViTConfig, create_vit
from moh_lightning.tasks import ImageClassifier
from moh_lightning.tasks.checkpoints import write_checkpoint

TINY = dict(img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0,
            global_pool="avg", drop_path_rate=0.0, moh={"num_shared_heads": 2, "top_k": 1})
DATA = {"_class_path": "moh_lightning.data.images.ImageFolderDataModule", "data_dir": "digits", "img_size": 16,
        "in_chans": 1, "mean": [0.3], "std": [0.3], "crop_pct": 1.0, "interpolation": "bilinear"}


def _frechet(a: np.ndarray, b: np.ndarray) -> float:
    """The FID formula on two feature sets, with numpy and scipy alone."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    sigma_a, sigma_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = scipy.linalg.sqrtm(sigma_a @ sigma_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sigma_a + sigma_b - 2 * root))


def test_features_equal_a_direct_frechet_computation(tmp_path, capsys):
    torch.manual_seed(0)
    network = create_vit(ViTConfig(**TINY)).eval()
    checkpoint = write_checkpoint(tmp_path / "classifier.ckpt", ImageClassifier,
                                  {"arch": TINY, "mixup_alpha": 0.0, "cutmix_alpha": 0.0},
                                  {f"model.{k}": v for k, v in network.state_dict().items()}, DATA)
    digits = write_digits_folder(tmp_path / "digits", size=16, flat=True)
    reference = sorted(digits.glob("*/*.png"))[::30]  # 60 images of every class
    real = np.stack([np.asarray(Image.open(path).convert("RGB")) for path in reference])
    noise = np.random.default_rng(0).integers(-60, 60, real[:40].shape[:3])[..., None]  # grey stays grey
    samples = np.clip(real[:40].astype(int) + noise, 0, 255)
    np.savez(tmp_path / "samples.npz", arr_0=samples.astype(np.uint8))
    folder = tmp_path / "reference"
    folder.mkdir()
    for i, image in enumerate(real):
        Image.fromarray(image).save(folder / f"{i:03d}.png")
    out = tmp_path / "scores.json"
    main(["fidelity", "--samples", str(tmp_path / "samples.npz"), "--reference", str(folder),
          "--features", str(checkpoint), "--batch_size", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    def features(images: np.ndarray) -> np.ndarray:  # the classifier's validation input, by hand
        x = torch.from_numpy(images[..., 0]).float().div(255).sub(0.3).div(0.3).unsqueeze(1)
        with torch.no_grad():
            return network.forward_head(network.forward_features(x), pre_logits=True).double().numpy()

    assert result["classifier_frechet_distance"] == pytest.approx(_frechet(features(samples.astype(np.uint8)),
                                                                           features(real)), rel=1e-5)
    assert 0 <= result["classifier_precision"] <= 1 and 0 <= result["classifier_recall"] <= 1
    assert result["comparable_with_published_fid"] is False and "fid" not in result
    for text in (printed.splitlines()[0], result["note"]):
        assert "not comparable with published FID" in text
    assert str(checkpoint) in result["feature_space"] and "32 values" in result["feature_space"]
    assert {path.parent.name for path in reference} == set(DIGIT_WORDS)


def test_features_refuse_another_task(tmp_path):
    from tiny_models import dit_t4_config

    from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

    config = dit_t4_config()
    task = ClassConditionalDiffusion(config)
    checkpoint = write_checkpoint(tmp_path / "dit.ckpt", ClassConditionalDiffusion, {"arch": asdict(config)},
                                  task.state_dict(), {})
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((4, 8, 8, 3), np.uint8))
    with pytest.raises(SystemExit, match="ClassConditionalDiffusion checkpoint.*ImageClassifier"):
        main(["fidelity", "--samples", str(tmp_path / "s.npz"), "--reference", str(tmp_path / "s.npz"),
              "--features", str(checkpoint)])


def test_offline_without_inception_weights_names_features(tmp_path, monkeypatch):
    """Offline and without the Inception file, the line says where to put it and names the score that needs none."""
    import urllib.error

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # no cached weights
    monkeypatch.setattr(torch.hub, "urlopen", offline)
    np.savez(tmp_path / "samples.npz", arr_0=np.zeros((4, 16, 16, 3), np.uint8))
    with pytest.raises(SystemExit) as stop:
        main(["fidelity", "--samples", str(tmp_path / "samples.npz"), "--reference", str(tmp_path / "samples.npz"),
              "--cache_root", str(tmp_path / "cache")])
    line = str(stop.value.code)
    assert "\n" not in line and line.startswith("moh fidelity: cannot download torch-fidelity's Inception weights")
    assert "--weights <that file>" in line
    assert "or score offline without Inception: --features <the .ckpt of an image classifier" in line
    assert "moh fit --config vit_tiny_folder_digits_75.yaml" in line
