"""``moh fidelity``: FID / sFID / IS / precision / recall of generated images (``moh_lightning.metrics.fidelity``), or
the Fréchet distance, precision and recall in the feature space of a classifier trained by the suite."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import torch
from jsonargparse.typing import PositiveInt
from PIL import Image

from moh_lightning.data.image_transforms import eval_transform
from moh_lightning.metrics.fidelity import (
    InceptionWeightsMissing,
    compute_fidelity,
    feature_fidelity,
    load_images,
    reference_cache_name,
)
from moh_lightning.outputs import check_name, check_output_file
from moh_lightning.tasks.checkpoints import read_checkpoint
from moh_lightning.tasks.classification import ImageClassifier

#: What every result in a classifier's feature space says about itself: in the printed line and the written file.
NOT_FID = ("not comparable with published FID (Inception-v3 features of ImageNet): only with other scores in the "
           "same classifier's features")

#: The shipped config that trains a classifier for ``--features`` on a folder of one's own images.
FEATURES_CONFIG = "vit_tiny_folder_digits_75.yaml"


def fidelity(
        samples: str,
        reference: str = "mnist",
        weights: str | None = None,
        features: str | None = None,
        cache_name: str | None = None,
        cache_root: str | None = None,
        batch_size: PositiveInt = 50,
        device: str = "cpu",
        out: str | None = None,
        overwrite: bool = False,
) -> dict[str, float | str]:
    """FID / sFID / IS / precision / recall of a folder or .npz of samples against a reference set.

    Args:
        samples: ``.npz`` with ``arr_0`` (N, H, W, 3) uint8 (as ``moh sample`` writes), or a folder of images.
        reference: Same formats, or ``mnist`` for the embedded training digits (32x32).
        weights: Local torch-fidelity Inception-v3 weights file, for machines without internet.
        features: An image classifier's checkpoint (``moh fit`` with a ViT, e.g. ``vit_tiny_folder_digits_75.yaml``
            trained on the reference images): score in its pre-logit features instead of Inception's, the Fréchet
            distance, precision and recall (k = 3) only. Its numbers compare runs scored with that classifier, never
            published FIDs, and say so. No Inception weights needed.
        cache_name: Cache entry of the reference statistics; the reference's name and a hash of its files' paths,
            sizes and times when omitted. Reused across runs.
        cache_root: Folder of the cache (torch-fidelity's default under the torch hub folder when omitted).
        batch_size: Images per Inception forward.
        device: ``cpu`` or ``cuda``.
        out: Also write the metrics as JSON to this file; refused when it exists, unless ``overwrite``.
        overwrite: Replace an ``out`` file that exists.
    """
    if out:
        check_output_file(out, "--out", overwrite)
    check_name(cache_name, "--cache_name")
    if features is not None:
        result = classifier_fidelity(load_images(samples), load_images(reference, "reference"), features,
                                     batch_size, device)
        print(f"moh fidelity: Fréchet distance in the features of {features}, {NOT_FID}.")
    else:
        name = cache_name or reference_cache_name(reference)
        try:
            result = compute_fidelity(load_images(samples), load_images(reference, "reference"), name, weights,
                                      batch_size, device, cache_root, verbose=True)
        except InceptionWeightsMissing as error:
            raise SystemExit(f"moh fidelity: {error}; or score offline without Inception: --features <the .ckpt of "
                             f"an image classifier trained on the reference images, e.g. by `moh fit --config "
                             f"{FEATURES_CONFIG} --data.init_args.data_dir <their folder>`> gives a Fréchet "
                             f"distance, precision and recall comparable only with scores in that classifier's "
                             f"features.") from None
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result


def classifier_fidelity(samples: np.ndarray, reference: np.ndarray, checkpoint: str, batch_size: int = 50,
                        device: str = "cpu") -> dict[str, float | str]:
    """The Fréchet distance, precision and recall of uint8 (N, H, W, 3) ``samples`` against ``reference`` in the
    pooled pre-logit features (``forward_head(..., pre_logits=True)``) of an ``ImageClassifier`` checkpoint, each
    image read as the classifier's validation images were (its data module's size, channels, crop and
    normalisation)."""
    raw = read_checkpoint(checkpoint, ImageClassifier, "fidelity --features")
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location=device, weights_only=True).model.eval()
    transform, mode = _validation_transform(raw.get("datamodule_hyper_parameters") or {})
    generated, real = (_pre_logits(model, images, transform, mode, batch_size, device)
                       for images in (samples, reference))
    scores = feature_fidelity(generated, real)
    return {
        "classifier_frechet_distance": scores["frechet_distance"],
        "classifier_precision": scores["precision"],
        "classifier_recall": scores["recall"],
        "feature_space": f"{checkpoint}: pre-logit features ({generated.shape[1]} values)",
        "comparable_with_published_fid": False,
        "note": f"Fréchet distance in an image classifier's features, {NOT_FID}",
        "num_samples": len(samples),
        "num_reference": len(reference),
    }


def _validation_transform(data_hparams: dict):
    """The classifier's validation transform and PIL mode, from its data module's saved settings (the suite's image
    modules only: a class path from a file is never imported from elsewhere)."""
    class_path = str(data_hparams.get("_class_path", ""))
    module, _, name = class_path.rpartition(".")
    if not module.startswith("moh_lightning.data."):
        raise SystemExit(f"moh fidelity --features: the checkpoint's data module {class_path or '(none)'} is not one "
                         f"of the suite's image modules; give a classifier trained with `moh fit` on images.")
    settings = {key: value for key, value in data_hparams.items() if not key.startswith("_")}
    data = getattr(importlib.import_module(module), name)(**settings)  # its normalisation defaults, e.g. MNIST's
    hp = data.hparams
    transform = eval_transform(hp.img_size, hp.in_chans, hp.interpolation, hp.crop_pct, data.mean, data.std)
    return transform, "L" if hp.in_chans == 1 else "RGB"


@torch.no_grad()
def _pre_logits(model: torch.nn.Module, images: np.ndarray, transform, mode: str, batch_size: int,
                device: str) -> torch.Tensor:
    features = []
    for start in range(0, len(images), batch_size):
        batch = torch.stack([transform(Image.fromarray(image).convert(mode))
                             for image in images[start:start + batch_size]]).to(device)
        features.append(model.forward_head(model.forward_features(batch), pre_logits=True).float().cpu())
    return torch.cat(features)


__all__ = ["NOT_FID", "classifier_fidelity", "fidelity"]
