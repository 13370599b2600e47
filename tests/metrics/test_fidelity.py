"""FID / sFID / IS / precision / recall pipeline with a randomly initialised Inception (no download possible)."""
from __future__ import annotations

import json
import math
import re
from unittest import mock

import numpy as np
import pytest
import torch
from golden import load_golden
from torch import nn
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

from moh_lightning.cli import main
from moh_lightning.metrics.fidelity import (
    INCEPTION_FILE,
    SFID_FEATURE,
    InceptionWeightsMissing,
    SpatialInceptionV3,
    compute_fidelity,
    inception_score,
    load_images,
)


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory) -> str:
    """A random Inception-v3 state dict in torch-fidelity's format, He-initialised so features stay O(1)."""
    with mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict", lambda self, state: None), \
            mock.patch("torch_fidelity.feature_extractor_inceptionv3.load_state_dict_from_url", return_value={}):
        net = FeatureExtractorInceptionV3("random", ["2048"])
    torch.manual_seed(0)
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    path = tmp_path_factory.mktemp("inception") / "random_inception.pth"
    torch.save(net.state_dict(), path)
    return str(path)


def _digits(n: int, seed: int) -> np.ndarray:
    images = load_images("mnist")
    return images[np.random.default_rng(seed).choice(len(images), n, replace=False)]


@pytest.mark.slow
def test_spatial_feature_is_mixed_6d_branch1x1_first_7_channels_hwc(inception_weights):
    net = SpatialInceptionV3("t", [SFID_FEATURE, "2048"], feature_extractor_weights_path=inception_weights)
    captured = {}
    net.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: captured.setdefault("map", o.clone()))
    x = torch.from_numpy(_digits(2, 0)).permute(0, 3, 1, 2).contiguous()
    spatial, pooled = net(x)
    assert spatial.shape == (2, 17 * 17 * 7) and pooled.shape == (2, 2048)
    expected = captured["map"][:, :7].permute(0, 2, 3, 1).reshape(2, -1)  # height, width, channel
    torch.testing.assert_close(spatial, expected)
    assert captured["map"].shape[1:] == (192, 17, 17)
    alone, = SpatialInceptionV3("t", [SFID_FEATURE], feature_extractor_weights_path=inception_weights)(x)
    torch.testing.assert_close(alone, spatial)


@pytest.mark.slow
def test_metrics_identity_perturbation_and_cache(inception_weights, tmp_path):
    reference = _digits(12, 1)
    same = compute_fidelity(reference, reference, "ref", inception_weights, batch_size=12, cache_root=str(tmp_path))
    assert abs(same["fid"]) < 1e-2 and abs(same["sfid"]) < 1e-2
    assert same["precision"] == pytest.approx(1.0) and same["recall"] == pytest.approx(1.0)
    assert any(tmp_path.iterdir()), "reference statistics were not cached"

    rng = np.random.default_rng(0)
    scores = []
    for sigma in (20, 120):
        noisy = np.clip(reference.astype(np.float32) + rng.normal(0, sigma, reference.shape), 0, 255).astype(np.uint8)
        scores.append(compute_fidelity(noisy, reference, "ref", inception_weights, batch_size=12,
                                       cache_root=str(tmp_path)))
    assert 0 < scores[0]["fid"] < scores[1]["fid"]
    assert 0 < scores[0]["sfid"] < scores[1]["sfid"]
    for score in scores:
        assert 0.0 <= score["precision"] <= 1.0 and 0.0 <= score["recall"] <= 1.0


@pytest.mark.slow
def test_fidelity_tool_on_npz_and_folder(inception_weights, tmp_path):
    from PIL import Image

    images = _digits(8, 2)
    np.savez(tmp_path / "samples.npz", arr_0=images)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image).save(folder / f"{i:03d}.png")
    np.testing.assert_array_equal(load_images(str(folder)), images)
    out = tmp_path / "metrics.json"
    main(["fidelity", "--samples", str(tmp_path / "samples.npz"), "--reference", str(folder),
          "--weights", inception_weights, "--cache_root", str(tmp_path / "cache"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert abs(result["fid"]) < 1e-2 and set(result) >= {"fid", "sfid", "inception_score", "precision", "recall"}
    with pytest.raises(SystemExit, match="--samples"):
        main(["fidelity", "--samples", str(tmp_path / "missing.npz"), "--weights", inception_weights])


def test_inception_score_is_the_number_of_confident_classes_per_adm_split():
    """Confident predictions spread evenly over c classes score c; over ADM's 5,000-sample splits, the mean of the
    splits' scores: 4 classes in the first split and 2 in the second give 3, where one split of all 6 would give 6."""
    logits = torch.full((10000, 1008), -30.0, dtype=torch.float64)
    labels = torch.cat([torch.arange(5000) % 4, 4 + torch.arange(5000) % 2])
    logits[torch.arange(10000), labels] = 30.0
    mean, std = inception_score(logits)
    assert mean == pytest.approx(3.0, rel=1e-6) and std == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("n", [3000, 5000, 7000])
def test_inception_score_equals_adms_evaluator_at_any_sample_count(n):
    """ADM's own compute_inception_score on the same logits (golden file): at 7,000 its splits are 5,000 + 2,000
    samples, in order; equal splits (3,500 + 3,500) or shuffled ones score otherwise."""
    golden, metadata = load_golden("inception_score")
    assert metadata["source"].startswith("openai/guided-diffusion@")
    mean, _ = inception_score(golden["logits"][:n])
    assert mean == pytest.approx(float(golden[f"is_{n}"]), rel=2e-6)


@pytest.mark.slow
def test_fidelity_scores_is_on_the_inception_logits(inception_weights):
    """The IS of ``compute_fidelity`` is that of the network's unbiased logits (ADM's softmax input), not of the
    2048-d pool features."""
    images = _digits(12, 3)
    net = SpatialInceptionV3("t", ["logits_unbiased", "2048"], feature_extractor_weights_path=inception_weights)
    with torch.no_grad():
        logits, pool = net(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())
    result = compute_fidelity(images, images, None, inception_weights, batch_size=6)
    # A random network scores barely above 1: compare log IS, the mean KL itself.
    expected = math.log(inception_score(logits)[0])
    assert math.log(result["inception_score"]) == pytest.approx(expected, rel=1e-3)
    assert math.log(inception_score(pool)[0]) != pytest.approx(expected, rel=0.2)


def _offline(*args, **kwargs):
    from urllib.error import URLError

    raise URLError("[Errno -3] Temporary failure in name resolution")


def test_offline_names_one_file_and_the_folder_torch_fidelity_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    images = np.zeros((4, 16, 16, 3), np.uint8)
    messages = []
    with mock.patch("torch_fidelity.feature_extractor_inceptionv3.load_state_dict_from_url", _offline):
        with pytest.raises(InceptionWeightsMissing) as offline:  # `moh fidelity` adds its offline alternative
            compute_fidelity(images, images, None)
    messages.append(str(offline.value))
    with pytest.raises(SystemExit) as missing:
        compute_fidelity(images, images, None, weights=str(tmp_path / "nowhere.pth"))
    messages.append(str(missing.value))
    for message in messages:
        assert len(message.splitlines()) == 1
        assert re.findall(r"[\w-]+\.pth", message.replace(str(tmp_path / "nowhere.pth"), "")) == [INCEPTION_FILE] * 2
        assert f"into {folder}/" in message and "curl -L -O https://" in message and "--weights" in message
    assert INCEPTION_FILE == "weights-inception-2015-12-05-6726825d.pth"


@pytest.mark.slow
def test_weights_in_that_folder_are_used_offline(inception_weights, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy(inception_weights, folder / INCEPTION_FILE)
    images = _digits(6, 4)
    with mock.patch("torch.hub.download_url_to_file", _offline):  # a download would fail
        result = compute_fidelity(images, images, None, batch_size=6)
    assert abs(result["fid"]) < 1e-2
