"""Diffusion maths (schedules' losses) used by the class-conditional diffusion task."""
from moh_lightning.diffusion.gaussian_diffusion import GaussianDiffusionLoss

__all__ = ["GaussianDiffusionLoss"]
