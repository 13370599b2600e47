"""FID / sFID / IS / precision / recall pipeline with a randomly initialised Inception (no download possible)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from unittest import mock

import numpy as np
import pytest
import torch
import torch_fidelity.utils
from golden import load_golden
from torch import nn
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
from torch_fidelity.metric_fid import fid_statistics_to_metric

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


def _offline(*args, **kwargs):
    from urllib.error import URLError

    raise URLError("[Errno -3] Temporary failure in name resolution")


def _on_the_span(stat_1: dict, stat_2: dict, verbose: bool) -> dict:
    """torch-fidelity's Fréchet distance, taken in an orthonormal basis of a span that holds both covariances' columns
    and the means' difference: 33 dimensions, not Inception's 2,048 or sFID's 2,023. With N images a set, a covariance
    has rank N - 1 at most, and in any such basis the distance is the full one (the means' distance, the traces and
    the nonzero eigenvalues of the covariances' product all stay): the same maths on a 33-matrix instead of a
    2,048-matrix, whose eigenvalues take seconds, six times in this module. Checked: each covariance keeps its trace in
    the span, which for a positive semi-definite matrix means all of it lies there."""
    probe = np.random.default_rng(0).standard_normal((len(stat_1["mu"]), 16))  # 16 > N - 1: the whole column space
    basis = np.linalg.qr(np.concatenate([stat_1["sigma"] @ probe, stat_2["sigma"] @ probe,
                                         (stat_1["mu"] - stat_2["mu"])[:, None]], 1))[0]
    reduced = [{"mu": basis.T @ stat["mu"], "sigma": basis.T @ stat["sigma"] @ basis} for stat in (stat_1, stat_2)]
    for stat, small in zip((stat_1, stat_2), reduced, strict=True):
        assert np.trace(small["sigma"]) == pytest.approx(np.trace(stat["sigma"]), rel=1e-9, abs=1e-12)
    return fid_statistics_to_metric(*reduced, verbose)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """Four digits, the fewest for precision and recall's 3 neighbours (each image's 4th nearest, itself included);
    every image costs an Inception pass at 299x299."""
    return _digits(4, 1)


@pytest.fixture(scope="module")
def scored(inception_weights, reference, tmp_path_factory) -> dict:
    """The pipeline's three runs, read by the tests below (their Fréchet distances on the features' span:
    ``_on_the_span``). ``moh fidelity`` scores an ``.npz`` of the reference
    against a folder of the same images offline: no ``--weights``, the file in torch hub's checkpoints folder, every
    download failing; it caches the reference's features. Then two noisy copies of the reference against them: the
    first offline again (the cache's entry reused), the second with the weights file given (an entry of its own:
    another network's features are never reused)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("fidelity")
    hub = root / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    shutil.copy(inception_weights, hub / INCEPTION_FILE)
    np.savez(root / "samples.npz", arr_0=reference)
    folder = root / "folder"
    folder.mkdir()
    for i, image in enumerate(reference):
        Image.fromarray(image).save(folder / f"{i:03d}.png")
    cache, out = root / "cache", root / "metrics.json"
    rng = np.random.default_rng(0)
    noisy = [np.clip(reference.astype(np.float32) + rng.normal(0, sigma, reference.shape), 0, 255).astype(np.uint8)
             for sigma in (20, 120)]
    reads, extract = [], torch_fidelity.utils.get_featuresdict_from_dataset

    def counted(dataset, feat_extractor, batch_size, cuda, save_cpu_ram, verbose):
        reads.append(len(dataset))
        # save_cpu_ram: the batches loaded here, not in 4 forked worker processes per image set.
        return extract(dataset, feat_extractor, batch_size, cuda, True, verbose)
    with mock.patch.dict(os.environ, {"TORCH_HOME": str(root / "torch")}), \
            mock.patch("torch.hub.download_url_to_file", _offline), \
            mock.patch("torch_fidelity.utils.get_featuresdict_from_dataset", counted), \
            mock.patch("moh_lightning.metrics.fidelity.fid_statistics_to_metric", _on_the_span):
        main(["fidelity", "--samples", str(root / "samples.npz"), "--reference", str(folder), "--cache_name", "ref",
              "--cache_root", str(cache), "--batch_size", "4", "--out", str(out)])
        cached = sorted(cache.rglob("*"))
        counts = [sum(reads)]
        perturbed = []
        for images, weights in zip(noisy, (None, inception_weights), strict=True):
            perturbed.append(compute_fidelity(images, reference, "ref", weights, batch_size=4, cache_root=str(cache)))
            counts.append(sum(reads) - sum(counts))
    return {"same": json.loads(out.read_text()), "folder": load_images(str(folder)), "cached": cached,
            "perturbed": perturbed, "images_read": counts}


@pytest.fixture(scope="module")
def direct(inception_weights, reference) -> dict:
    """The reference through the network itself: its logits, pool features, sFID feature and Mixed_6d's 1x1 map."""
    net = SpatialInceptionV3("t", [SFID_FEATURE, "2048", "logits_unbiased"],
                             feature_extractor_weights_path=inception_weights)
    captured = {}
    net.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: captured.setdefault("map", o.clone()))
    x = torch.from_numpy(reference).permute(0, 3, 1, 2).contiguous()
    with torch.no_grad():
        spatial, pool, logits = net(x)
    return {"x": x, "spatial": spatial, "pool": pool, "logits": logits, "map": captured["map"]}


@pytest.mark.slow
def test_spatial_feature_is_mixed_6d_branch1x1_first_7_channels_hwc(inception_weights, direct):
    spatial, n = direct["spatial"], len(direct["x"])
    assert spatial.shape == (n, 17 * 17 * 7) and direct["pool"].shape == (n, 2048)
    expected = direct["map"][:, :7].permute(0, 2, 3, 1).reshape(n, -1)  # height, width, channel
    torch.testing.assert_close(spatial, expected)
    assert direct["map"].shape[1:] == (192, 17, 17)
    with torch.no_grad():
        alone, = SpatialInceptionV3("t", [SFID_FEATURE], feature_extractor_weights_path=inception_weights)(
            direct["x"][:2])
    torch.testing.assert_close(alone, spatial[:2])


@pytest.mark.slow
def test_metrics_identity_perturbation_and_cache(scored, reference):
    same = scored["same"]
    assert abs(same["fid"]) < 1e-2 and abs(same["sfid"]) < 1e-2
    assert same["precision"] == pytest.approx(1.0) and same["recall"] == pytest.approx(1.0)
    assert scored["cached"], "reference statistics were not cached"
    # Images through Inception: both sets, then the noisy ones alone (the reference's features from the cache), then
    # both again (other weights, another entry).
    n = len(reference)
    assert scored["images_read"] == [2 * n, n, 2 * n]
    low, high = scored["perturbed"]
    assert 0 < low["fid"] < high["fid"]
    assert 0 < low["sfid"] < high["sfid"]
    for score in scored["perturbed"]:
        assert 0.0 <= score["precision"] <= 1.0 and 0.0 <= score["recall"] <= 1.0


@pytest.mark.slow
def test_fidelity_tool_on_npz_and_folder(scored, reference, inception_weights, tmp_path):
    np.testing.assert_array_equal(scored["folder"], reference)
    result = scored["same"]  # `moh fidelity` on the .npz against the folder
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
def test_fidelity_scores_is_on_the_inception_logits(scored, direct):
    """The IS of ``compute_fidelity`` is that of the network's unbiased logits (ADM's softmax input), not of the
    2048-d pool features."""
    # A random network scores barely above 1: compare log IS, the mean KL itself.
    expected = math.log(inception_score(direct["logits"])[0])
    assert math.log(scored["same"]["inception_score"]) == pytest.approx(expected, rel=1e-3)
    assert math.log(inception_score(direct["pool"])[0]) != pytest.approx(expected, rel=0.2)


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
def test_weights_in_that_folder_are_used_offline(scored):
    """``scored``'s ``moh fidelity`` ran with no ``--weights``, the file in torch hub's folder, downloads failing."""
    assert abs(scored["same"]["fid"]) < 1e-2
