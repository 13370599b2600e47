"""Quality of generated MNIST digits, judged by the suite's MNIST classifier instead of Inception.

Inception features say little about 32x32 grey digits, so the embedded DiT default is scored by a classifier trained
on the real digits (``moh fit --config vit_tiny_mnist_75.yaml``): the share of samples it assigns to their
conditioning class, and a Frechet distance between its pre-logit features of the samples and of the real training
digits (torch-fidelity's Frechet formula on these features).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_features_to_statistics, fid_statistics_to_metric

from moh_lightning.data.digits import load_mnist_5k
from moh_lightning.data.image_transforms import MNIST_MEAN, MNIST_STD
from moh_lightning.outputs import check_output_file


def _classifier_inputs(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 32, 32[, 3]) or (N, 28, 28) digits -> normalised (N, 1, 28, 28), the classifier's input."""
    if images.ndim == 4:
        images = images[..., 0]
    margin = (images.shape[1] - 28) // 2
    images = images[:, margin:margin + 28, margin:margin + 28]
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div(255.0).unsqueeze(1)
    return (x - MNIST_MEAN[0]) / MNIST_STD[0]


@torch.no_grad()
def _logits_and_features(model: torch.nn.Module, images: np.ndarray, batch_size: int = 500):
    logits, features = [], []
    x = _classifier_inputs(images)
    for start in range(0, len(x), batch_size):
        tokens = model.forward_features(x[start:start + batch_size])
        pre_logits = model.forward_head(tokens, pre_logits=True)
        features.append(pre_logits)
        logits.append(model.get_classifier()(pre_logits))
    return torch.cat(logits), torch.cat(features)


def score_digits(samples: np.ndarray, labels: np.ndarray, classifier: str) -> dict[str, float | list[float]]:
    """Conditioning-class accuracy (overall and per class), classifier-feature FID against the training digits, and
    the classifier's own accuracy on the held-out real digits (its ceiling)."""
    from moh_lightning.tasks.classification import ImageClassifier

    if not Path(classifier).is_file():
        raise SystemExit(f"moh digit_quality: --classifier {classifier}: no such checkpoint; train one with "
                         f"`moh fit --config vit_tiny_mnist_75.yaml`.")
    from moh_lightning.tasks.checkpoints import read_checkpoint

    read_checkpoint(classifier, ImageClassifier, "digit_quality")  # another task's checkpoint: one line, its tool
    model = ImageClassifier.load_from_checkpoint(classifier, map_location="cpu", weights_only=True).model.eval()
    logits, features = _logits_and_features(model, samples)
    predicted = logits.argmax(-1).numpy()
    correct = predicted == labels
    splits = load_mnist_5k()
    _, real_features = _logits_and_features(model, splits["train"][0])
    val_logits, _ = _logits_and_features(model, splits["val"][0])
    stats = [fid_features_to_statistics(f.double()) for f in (features, real_features)]
    classes = np.unique(labels)
    return {
        "class_accuracy": float(correct.mean()),
        "per_class_accuracy": [float(correct[labels == c].mean()) for c in classes],
        "classifier_fid": float(fid_statistics_to_metric(*stats, verbose=False)[KEY_METRIC_FID]),
        "classifier_real_val_accuracy": float((val_logits.argmax(-1).numpy() == splits["val"][1]).mean()),
        "num_samples": int(len(labels)),
    }


def digit_quality(samples: str, classifier: str, out: str | None = None, overwrite: bool = False) -> dict:
    """Scores ``moh sample`` output of a MNIST diffusion model with a trained MNIST classifier.

    Args:
        samples: ``samples.npz`` written by ``moh sample`` (``arr_0`` images, ``arr_1`` conditioning classes).
        classifier: ImageClassifier checkpoint trained on the real digits (``moh fit --config vit_tiny_mnist_75.yaml``).
        out: Also write the scores as JSON to this file; refused when it exists, unless ``overwrite``.
        overwrite: Replace an ``out`` file that exists.
    """
    if out:
        check_output_file(out, "--out", overwrite)
    path = Path(samples)
    if not path.is_file():
        raise SystemExit(f"moh digit_quality: --samples {samples}: no such file; pass the samples.npz of `moh sample`.")
    data = np.load(path)
    if "arr_1" not in data:
        raise SystemExit(f"moh digit_quality: --samples {samples} has no arr_1 (labels); sample with `moh sample`.")
    result = score_digits(data["arr_0"], data["arr_1"], classifier)
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result


__all__ = ["digit_quality", "score_digits"]
