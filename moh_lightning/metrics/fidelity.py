"""FID, sFID, IS, precision and recall of generated images through torch-fidelity, as ADM's evaluator reports them.

torch-fidelity's ``inception-v3-compat`` extractor reproduces the TF Inception of the FID reference code, and gives
FID (pool features, 2048), the logits and precision / recall (pool features, k = 3 neighbours). The IS is computed here
from its unbiased logits (ADM's softmax input: the pool features times the logit weights, no bias), over ADM's
fixed 5,000-sample chunks: torch-fidelity's IS takes a number of equal splits instead, which differs from ADM's score
whenever N is not a multiple of 5,000.

sFID (Nash et al., 2021) is not in torch-fidelity, so it is added here as a registered feature extractor. ADM's
evaluator (openai/guided-diffusion ``evaluations/evaluator.py``) takes the TF tensor ``mixed_6/conv:0``, keeps its
first 7 channels of the 17x17 map and flattens them in height-width-channel order: 17 * 17 * 7 = 2023 values, then
computes an FID on them. In the TF graph ``mixed_6`` is the fourth 17x17 Inception-C block and ``conv`` its 1x1 branch
(conv, batch norm, ReLU); torch-fidelity's weight conversion maps that block to ``Mixed_6d`` and the branch to
``Mixed_6d.branch1x1``, whose output is captured here with a forward hook.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import torch_fidelity
from torch.utils.data import Dataset
from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
from torch_fidelity.metric_fid import (
    KEY_METRIC_FID,
    fid_features_to_statistics,
    fid_featuresdict_to_statistics,
    fid_statistics_to_metric,
)
from torch_fidelity.metric_prc import prc_features_to_metric, prc_featuresdict_to_metric
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
from torch_fidelity.utils import create_feature_extractor, extract_featuresdict_from_input_id_cached

from moh_lightning.data.cache import entry_name, file_stats
from moh_lightning.errors import MissingDataError
from moh_lightning.serialization import load_file

# ADM's evaluator (guided-diffusion evaluations/evaluator.py) scores IS over consecutive chunks of 5,000 samples.
IS_SPLIT_SIZE = 5000

#: The file torch-fidelity downloads, and the name it looks for in torch hub's checkpoints folder before downloading.
INCEPTION_FILE = URL_INCEPTION_V3.rsplit("/", 1)[1]

SFID_EXTRACTOR = "inception-v3-compat-sfid"
SFID_FEATURE = "spatial_2023"
SFID_CHANNELS = 7


class SpatialInceptionV3(FeatureExtractorInceptionV3):
    """torch-fidelity's TF-compatible Inception-v3 that also provides ADM's spatial sFID feature (2023 values)."""

    def __init__(self, name: str, features_list: list[str], **kwargs) -> None:
        super().__init__(name, features_list, **kwargs)
        self._spatial: torch.Tensor | None = None
        self.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module: torch.nn.Module, inputs, output: torch.Tensor) -> None:
        self._spatial = output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        others = [f for f in self.features_list if f != SFID_FEATURE]
        # The spatial map is computed before the '768' pooling point: stop the parent there when nothing else is asked.
        self.features_list, requested = others or ["768"], self.features_list
        try:
            computed = dict(zip(self.features_list, super().forward(x), strict=True))
        finally:
            self.features_list = requested
        spatial = self._spatial[:, :SFID_CHANNELS]                              # (B, 7, 17, 17)
        computed[SFID_FEATURE] = spatial.permute(0, 2, 3, 1).flatten(1).to(torch.float32)  # HWC order, (B, 2023)
        self._spatial = None
        return tuple(computed[f] for f in requested)

    @staticmethod
    def get_provided_features_list() -> tuple[str, ...]:
        return (*FeatureExtractorInceptionV3.get_provided_features_list(), SFID_FEATURE)

    @staticmethod
    def get_default_feature_layer_for_metric(metric: str) -> str:
        if metric == "fid":
            return SFID_FEATURE
        return FeatureExtractorInceptionV3.get_default_feature_layer_for_metric(metric)


if SFID_EXTRACTOR not in FEATURE_EXTRACTORS_REGISTRY:
    torch_fidelity.register_feature_extractor(SFID_EXTRACTOR, SpatialInceptionV3)


class ImageArrayDataset(Dataset):
    """uint8 images (N, H, W, 3) or (N, H, W) served as torch-fidelity expects: (3, H, W) uint8 tensors."""

    def __init__(self, images: np.ndarray) -> None:
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"expected uint8 images (N, H, W[, 3]), got {images.dtype} {images.shape}.")
        self.images = images if images.ndim == 4 else np.repeat(images[..., None], 3, axis=-1)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        image = torch.from_numpy(np.ascontiguousarray(self.images[index])).permute(2, 0, 1)
        return image.expand(3, -1, -1).contiguous() if image.shape[0] == 1 else image


def load_images(source: str, key: str = "samples") -> np.ndarray:
    """uint8 (N, H, W, 3) from an ADM-style ``.npz`` (``arr_0``), a folder of PNG / JPEG files, or ``mnist``.

    ``mnist`` is the training split of the embedded digits, padded to 32x32 as the diffusion task sees them.
    """
    if source == "mnist":
        from moh_lightning.data.digits import load_mnist_5k

        digits = load_mnist_5k()["train"][0]
        return np.pad(digits, ((0, 0), (2, 2), (2, 2)))[..., None].repeat(3, axis=-1)
    files = _image_files(source)
    if files:
        if files[0].suffix == ".npz":
            return np.load(files[0])["arr_0"]
        from PIL import Image

        return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    raise SystemExit(f"moh fidelity: --{key} {source}: not an .npz with arr_0, a folder of images, nor 'mnist'.")


def _image_files(source: str) -> list[Path]:
    """The ``.npz`` file, or the images of a folder, that ``load_images`` reads."""
    path = Path(source)
    if path.suffix == ".npz" and path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    return []


def reference_cache_name(source: str) -> str:
    """The cache entry of a reference set's features: its name and a hash of its files' absolute paths, sizes and
    times, so another folder's ``ref.npz``, or this one rewritten, is never scored against stale statistics."""
    if source == "mnist":
        return source
    return entry_name(Path(source).stem, file_stats(_image_files(source)))


def inception_weights_help() -> str:
    """Where torch-fidelity finds its Inception weights without a network, and how to get them, in words.

    torch-fidelity fetches them with ``torch.hub.load_state_dict_from_url``, which first looks for the file under
    ``<torch hub>/checkpoints/`` (``$TORCH_HOME/hub``, by default ``~/.cache/torch/hub``) and downloads only when it is
    not there.
    """
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    return (f"put {INCEPTION_FILE} into {folder}/ (on a machine with internet: curl -L -O {URL_INCEPTION_V3}), or "
            f"pass --weights <that file>")


class InceptionWeightsMissing(MissingDataError):
    """torch-fidelity's Inception weights are not on this machine and cannot be downloaded."""


def _weights_tag(weights: str | None) -> str:
    """Cache names depend on the Inception weights: a different (e.g. random test) file must not reuse them."""
    if weights is None:
        return "tf"
    return hashlib.sha1(str(Path(weights).resolve()).encode()).hexdigest()[:8]


def inception_score(logits: torch.Tensor, split_size: int = IS_SPLIT_SIZE) -> tuple[float, float]:
    """Inception Score of (N, classes) logits as ADM's ``compute_inception_score``: mean and std over chunks.

    The samples are cut in order (no shuffling) into chunks of ``split_size``, the last one holding the remainder
    as ADM's ``range(0, N, split_size)`` does; each chunk scores exp(mean_x KL(p(y|x) || p(y))) with p(y) its own
    mean prediction, and the IS is the mean of the chunks' scores (ADM reports no spread; the std is the population
    std of the same scores). Log-probabilities come from ``log_softmax`` in float64, where ADM takes the log of
    float32 probabilities: the same score, without its -inf for a probability that underflows.
    """
    log_probs = logits.double().log_softmax(1)
    scores = []
    for chunk in log_probs.split(split_size):
        probs = chunk.exp()
        log_marginal = probs.mean(0, keepdim=True).log()
        scores.append((probs * (chunk - log_marginal)).sum(1).mean().exp())
    scores = torch.stack(scores)
    return float(scores.mean()), float(scores.std(correction=0))


def compute_fidelity(samples: np.ndarray, reference: np.ndarray, reference_name: str | None = None,
                     weights: str | None = None, batch_size: int = 50, device: str = "cpu",
                     cache_root: str | None = None, verbose: bool = False) -> dict[str, float]:
    """FID, sFID, IS (mean and std), precision and recall (k = 3) of ``samples`` against ``reference``.

    Both are uint8 (N, H, W, 3) arrays. ``reference_name`` names the cache entry of the reference features and
    statistics (computed once, then reused; ``reference_cache_name`` makes one that changes with the files); None
    disables caching. ``weights`` is a local torch-fidelity Inception
    weights file (``INCEPTION_FILE``); None takes torch hub's copy, downloading it when there is none
    (``InceptionWeightsMissing`` where that fails, saying where to put the file: ``inception_weights_help``).
    """
    if weights is not None and not Path(weights).is_file():
        raise SystemExit(f"moh fidelity: --weights {weights}: no such file; {inception_weights_help()}.")
    if weights is not None:
        load_file(weights)  # torch-fidelity unpickles it in full: first refused here if it would run code
    kwargs = dict(
        input1=ImageArrayDataset(samples), input2=ImageArrayDataset(reference), batch_size=batch_size,
        feature_extractor_weights_path=weights, verbose=verbose, cache_root=cache_root,
        cache=reference_name is not None, cuda=device.startswith("cuda"),
    )
    if reference_name is not None:
        kwargs["input2_cache_name"] = f"{reference_name}-{_weights_tag(weights)}"
    # One Inception pass per image set gives every feature; torch-fidelity's metric functions then take the
    # features (its calculate_metrics would run one pass per feature extractor, i.e. twice).
    try:
        extractor = create_feature_extractor(SFID_EXTRACTOR, ["2048", "logits_unbiased", SFID_FEATURE], **kwargs)
    except OSError as error:  # urllib's URLError when the download fails, e.g. offline
        raise InceptionWeightsMissing(f"cannot download torch-fidelity's Inception weights ({error}); "
                                      f"{inception_weights_help()}") from None
    generated = extract_featuresdict_from_input_id_cached(1, extractor, **kwargs)
    real = extract_featuresdict_from_input_id_cached(2, extractor, **kwargs)

    def frechet(layer: str) -> float:
        stats = [fid_featuresdict_to_statistics(features, layer) for features in (generated, real)]
        return float(fid_statistics_to_metric(*stats, verbose)[KEY_METRIC_FID])

    inception, inception_std = inception_score(generated["logits_unbiased"])
    prc = prc_featuresdict_to_metric(generated, real, "2048", **kwargs)
    return {
        "fid": frechet("2048"),
        "sfid": frechet(SFID_FEATURE),
        "inception_score": inception,
        "inception_score_std": inception_std,
        "precision": float(prc["precision"]),
        "recall": float(prc["recall"]),
        "num_samples": len(samples),
        "num_reference": len(reference),
    }


def feature_fidelity(generated: torch.Tensor, real: torch.Tensor) -> dict[str, float]:
    """Fréchet distance, precision and recall (k = 3) between two sets of features (N, D) of any network, with
    torch-fidelity's own functions (those ``compute_fidelity`` applies to Inception's): the FID formula in another
    feature space, whose numbers are comparable only with each other."""
    stats = [fid_features_to_statistics(features.double()) for features in (generated, real)]
    prc = prc_features_to_metric(generated.float(), real.float(), verbose=False)
    return {"frechet_distance": float(fid_statistics_to_metric(*stats, verbose=False)[KEY_METRIC_FID]),
            "precision": float(prc["precision"]), "recall": float(prc["recall"])}


__all__ = ["INCEPTION_FILE", "IS_SPLIT_SIZE", "ImageArrayDataset", "InceptionWeightsMissing", "SFID_EXTRACTOR",
           "SFID_FEATURE", "SpatialInceptionV3", "compute_fidelity", "feature_fidelity", "inception_score",
           "inception_weights_help", "load_images", "reference_cache_name"]
