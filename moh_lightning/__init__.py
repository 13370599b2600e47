"""moh-lightning: Mixture-of-Head attention (Jin et al., ICML 2025) for PyTorch Lightning.

Importing the package registers its named models with timm, as importing timm does for its own:
``import moh_lightning; timm.create_model("moh_vit_small_patch16_224_75")``.
"""
from moh_lightning.layers import MoHAttention, activated_head_fraction, moh_layers, pop_load_balance_loss
from moh_lightning.models import transnext, vit  # noqa: F401  (their @register_model functions)

__version__ = "0.1.0"
__all__ = ["MoHAttention", "activated_head_fraction", "moh_layers", "pop_load_balance_loss"]
