"""The MoH-ViT network: timm's ``VisionTransformer`` with ``MoHAttention`` entering through ``attn_layer``.

Nothing of ViT is re-implemented here: the config says which heads each layer shares and routes, and timm builds the
model. Unlike timm's own ViTs the MoH-ViTs are not TorchScript: ``MoHAttention`` is not (its router's gates come out
of a custom autograd function, and its forward takes a callable and a KV cache object).
"""
from __future__ import annotations

from timm.models.vision_transformer import VisionTransformer

from moh_lightning.layers import MoHAttention, layerwise
from moh_lightning.layers.moh_config import attention_layers
from moh_lightning.models.vit.config import ViTConfig
from moh_lightning.models.vit.weights import load_dense_timm_weights


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
    if config.pretrained:
        load_dense_timm_weights(model, config.pretrained)
    return model


__all__ = ["create_vit"]
