"""``moh fidelity``: FID / sFID / IS / precision / recall of generated images (``moh_lightning.metrics.fidelity``)."""
from __future__ import annotations

import json
from pathlib import Path

from moh_lightning.metrics.fidelity import compute_fidelity, load_images, reference_cache_name


def fidelity(
        samples: str,
        reference: str = "mnist",
        weights: str | None = None,
        cache_name: str | None = None,
        cache_root: str | None = None,
        batch_size: int = 50,
        device: str = "cpu",
        out: str | None = None,
) -> dict[str, float]:
    """FID / sFID / IS / precision / recall of a folder or .npz of samples against a reference set.

    Args:
        samples: ``.npz`` with ``arr_0`` (N, H, W, 3) uint8 (as ``moh sample`` writes), or a folder of images.
        reference: Same formats, or ``mnist`` for the embedded training digits (32x32).
        weights: Local torch-fidelity Inception-v3 weights file, for machines without internet.
        cache_name: Cache entry of the reference statistics; the reference's name and a hash of its files' paths,
            sizes and times when omitted. Reused across runs.
        cache_root: Folder of the cache (torch-fidelity's default under the torch hub folder when omitted).
        batch_size: Images per Inception forward.
        device: ``cpu`` or ``cuda``.
        out: Also write the metrics as JSON to this file.
    """
    name = cache_name or reference_cache_name(reference)
    result = compute_fidelity(load_images(samples), load_images(reference, "reference"), name, weights, batch_size,
                              device, cache_root, verbose=True)
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result



__all__ = ["fidelity"]
