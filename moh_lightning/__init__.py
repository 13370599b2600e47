"""moh-lightning: Mixture-of-Head attention (Jin et al., ICML 2025) for PyTorch Lightning.

``from moh_lightning import MoHAttention`` gives the block; ``import moh_lightning.models`` registers the named models
with timm, as importing timm does for its own: ``timm.create_model("moh_vit_small_patch16_224_75")``. Importing the
package alone loads nothing, so ``moh --help`` answers before torch would have loaded.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["MoHAttention", "activated_head_fraction", "moh_layers", "pop_load_balance_loss"]


def __getattr__(name: str):
    # PEP 562: the block's names load torch and timm only when first asked for.
    if name in __all__:
        return getattr(importlib.import_module("moh_lightning.layers"), name)
    raise AttributeError(f"module 'moh_lightning' has no attribute {name!r}")
