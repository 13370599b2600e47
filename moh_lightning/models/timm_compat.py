"""Every private timm name the suite uses, in one place, as ``lightning_compat.py`` does for Lightning.

timm's own models take ``feature_take_indices`` from the private ``timm.models._features``; TransNeXt's
``forward_intermediates`` follows the same contract, so it uses the same function rather than a copy.
``tests/models/test_timm_compat.py`` fails when the installed timm no longer has a listed name, or when another module
of the suite imports a private timm name.
"""
from __future__ import annotations

from timm.models._features import feature_take_indices

PRIVATE_TIMM_NAMES: tuple[str, ...] = ("timm.models._features.feature_take_indices",)

__all__ = ["PRIVATE_TIMM_NAMES", "feature_take_indices"]
