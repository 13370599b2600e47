"""Evaluation tools: image-generation fidelity (FID, sFID, IS, precision, recall) through torch-fidelity."""
from moh_lightning.evaluation.fidelity import SFID_EXTRACTOR, SpatialInceptionV3, compute_fidelity, fidelity

__all__ = ["SFID_EXTRACTOR", "SpatialInceptionV3", "compute_fidelity", "fidelity"]
