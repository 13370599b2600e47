"""MoH Vision Transformer: timm's ``VisionTransformer`` with ``MoHAttention`` entering through ``attn_layer``.

Nothing of ViT is re-implemented here: the config says which heads each layer shares and routes, and timm
builds the model. The named models (the paper's budgets on ViT-S/B) are the shipped configs in ``cli_configs/``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from timm.models.vision_transformer import VisionTransformer

from moh_lightning.layers import MoHAttention, layerwise
from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers


@dataclass
class ViTConfig:
    """Architecture of a (MoH) ViT: timm's ``VisionTransformer`` arguments and the MoH head budget.

    Defaults are ViT-S/16 at 224 pixels for ImageNet-1k. ``head_dim`` is the width of one head
    (``embed_dim // num_heads`` when None).
    """

    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    head_dim: int | None = None
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False
    drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    global_pool: str = "token"
    moh: MoHConfig | None = field(default_factory=lambda: MoHConfig(num_shared_heads=2, top_k=2))
    timm_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.moh = as_moh_config(self.moh)
        attention_layers(self.moh, self.num_heads, self.depth)

    @property
    def activated_fraction(self) -> float:
        return activated_fraction(self.moh, self.num_heads, self.depth)


def create_vit(config: ViTConfig) -> VisionTransformer:
    """Builds timm's ``VisionTransformer`` with a MoH (or dense) attention layer in every block."""
    layers = attention_layers(config.moh, config.num_heads, config.depth)
    common = {key: value for key, value in layers[0].items() if key not in ("num_shared_heads", "top_k")}
    if config.head_dim is not None:
        common["attn_head_dim"] = config.head_dim
    attn_layer = layerwise([layer.get("num_shared_heads", 0) for layer in layers],
                           [layer.get("top_k", 0) for layer in layers], **common)
    model = VisionTransformer(
        img_size=config.img_size, patch_size=config.patch_size, in_chans=config.in_chans,
        num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
        num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm, drop_rate=config.drop_rate, drop_path_rate=config.drop_path_rate,
        global_pool=config.global_pool, attn_layer=attn_layer, **config.timm_kwargs,
    )
    assert all(isinstance(block.attn, MoHAttention) for block in model.blocks)
    return model


__all__ = ["ViTConfig", "create_vit"]
