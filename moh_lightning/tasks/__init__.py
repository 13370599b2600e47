"""One LightningModule per task, each on the shared ``MoHTask`` base.

``TASKS`` is the registry the tests iterate: a new task is covered by adding it here and shipping a config for it.
"""
from moh_lightning.tasks.base import MoHTask
from moh_lightning.tasks.classification import ImageClassifier
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion
from moh_lightning.tasks.language_model import LanguageModel

TASKS: dict[str, type[MoHTask]] = {
    "classification": ImageClassifier,
    "diffusion": ClassConditionalDiffusion,
    "language_model": LanguageModel,
}

__all__ = ["TASKS", "ClassConditionalDiffusion", "ImageClassifier", "LanguageModel", "MoHTask"]
