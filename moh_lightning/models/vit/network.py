"""The MoH-ViT network: timm's ``VisionTransformer`` with ``MoHAttention`` in each block (``block_fn``).

Nothing of ViT is re-implemented here: the config says which heads each layer shares and routes, and timm builds the
model. Unlike timm's own ViTs the MoH-ViTs are not TorchScript: ``MoHAttention`` is not (its router's gates come out
of a custom autograd function, and its forward takes a callable and a KV cache object).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from moh_lightning.layers import DropPath, MoHAttention
from moh_lightning.layers.moh_config import attention_layers
from moh_lightning.models.vit.config import ViTConfig
from moh_lightning.models.vit.weights import load_vit_weights


def create_vit(config: ViTConfig) -> VisionTransformer:
    """Builds timm's ``VisionTransformer`` with a MoH (or dense) attention layer in every block."""
    layers = attention_layers(config.moh, config.num_heads, config.depth)
    if config.head_dim is not None:
        layers = [{**layer, "attn_head_dim": config.head_dim} for layer in layers]
    model = VisionTransformer(
        img_size=config.img_size, patch_size=config.patch_size, in_chans=config.in_chans,
        num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
        num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm, drop_rate=config.drop_rate, drop_path_rate=config.drop_path_rate,
        global_pool=config.global_pool,
        block_fn=partial(MoHBlock, layers=layers, stochastic_depth=config.drop_path_rate > 0), **config.timm_kwargs,
    )
    assert all(isinstance(block.attn, MoHAttention) for block in model.blocks)
    if config.pretrained:
        load_vit_weights(model, config.pretrained, key="arch.pretrained")
    return model


class MoHBlock(Block):
    """timm's ``Block`` whose attention is the ``MoHAttention`` of its own layer, ``layers[depth]``.

    timm hands every block its index (``depth``) but passes it on only to its own differential attention, so the
    block picks its layer's head budget itself. timm's ``attn_layer`` is ignored: ``nn.Identity`` takes its place
    in the parent's constructor (it accepts and ignores timm's arguments), then the MoH layer replaces it under the
    same name, so the module order and the state dict are timm's.

    With ``stochastic_depth`` (the model's ``drop_path_rate`` > 0) both drop paths of every block are the suite's
    ``DropPath``, the first block's (rate 0, where timm puts ``nn.Identity``) too: a compiled block reads its rate
    from a tensor, so the blocks share one graph per head budget instead of one per rate.
    """

    def __init__(self, dim: int, num_heads: int, *, layers: Sequence[dict], stochastic_depth: bool = False,
                 depth: int = 0, qkv_bias: bool = False, qk_norm: bool = False, scale_attn_norm: bool = False,
                 proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0, drop_path: float = 0.0,
                 norm_layer: type[nn.Module] = nn.LayerNorm, attn_layer: object = None, device=None, dtype=None,
                 **kwargs) -> None:
        attention = dict(qkv_bias=qkv_bias, qk_norm=qk_norm, proj_bias=proj_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, norm_layer=norm_layer, device=device, dtype=dtype)
        super().__init__(dim, num_heads, scale_attn_norm=scale_attn_norm, depth=depth, attn_layer=nn.Identity,
                         drop_path=drop_path, **attention, **kwargs)
        self.attn = MoHAttention(dim, num_heads, scale_norm=scale_attn_norm, **attention, **layers[depth])
        if stochastic_depth:
            self.drop_path1, self.drop_path2 = DropPath(drop_path), DropPath(drop_path)


__all__ = ["MoHBlock", "create_vit"]
