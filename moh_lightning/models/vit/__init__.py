"""MoH Vision Transformer: timm's ``VisionTransformer`` with ``MoHAttention`` entering through ``attn_layer``.

``config`` is the architecture and head budget, ``network`` builds timm's ViT from it, ``weights`` starts it from timm
weights or a suite checkpoint, and ``registry`` names the paper's models for ``timm.create_model`` (importing this
package registers them).
"""
from moh_lightning.models.vit.config import ViTConfig
from moh_lightning.models.vit.network import create_vit
from moh_lightning.models.vit.registry import GENERIC_VIT, NAMED_VITS, named_vit_config
from moh_lightning.models.vit.weights import load_vit_weights

__all__ = ["GENERIC_VIT", "NAMED_VITS", "ViTConfig", "create_vit", "load_vit_weights", "named_vit_config"]
