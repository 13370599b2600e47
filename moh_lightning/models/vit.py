"""MoH Vision Transformer: timm's ``VisionTransformer`` with ``MoHAttention`` entering through ``attn_layer``.

Nothing of ViT is re-implemented here: the config says which heads each layer shares and routes, and timm
builds the model. Named configs follow the paper's activated-head budgets (Tab. 1) on timm's ViT-S/B shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from timm.models.vision_transformer import VisionTransformer

from moh_lightning.layers import ExecutionMode, MoHAttention, check_head_budget, layerwise


@dataclass
class ViTConfig:
    """Architecture of a (MoH) ViT. Head budgets are one int for every layer or a list with one per layer.

    ``num_shared_heads`` are always on; ``top_k`` of the remaining routed heads are picked per token.
    ``dense=True`` is plain multi-head attention with the same weights (the baseline).
    """

    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False
    drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    global_pool: str = "token"
    dense: bool = False
    num_shared_heads: int | list[int] = 2
    top_k: int | list[int] = 2
    two_stage_routing: bool = True
    execution: ExecutionMode = "auto"
    timm_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dense:
            return
        shared, top_k = self.layer_budgets()
        for layer, (s, k) in enumerate(zip(shared, top_k)):
            check_head_budget(self.num_heads, s, k, where=f"layer {layer}")

    def layer_budgets(self) -> tuple[list[int], list[int]]:
        """Per-layer (num_shared_heads, top_k), validated against ``depth``."""
        budgets = []
        for key in ("num_shared_heads", "top_k"):
            value = getattr(self, key)
            if isinstance(value, int):
                value = [value] * self.depth
            if len(value) != self.depth:
                raise ValueError(f"{key} has {len(value)} entries for depth={self.depth}: give one per layer "
                                 f"or a single int.")
            budgets.append(list(value))
        return budgets[0], budgets[1]

    @property
    def activated_fraction(self) -> float:
        if self.dense:
            return 1.0
        shared, top_k = self.layer_budgets()
        return sum(s + k for s, k in zip(shared, top_k)) / (self.num_heads * self.depth)


def create_vit(config: ViTConfig) -> VisionTransformer:
    """Builds timm's ``VisionTransformer`` with a MoH (or dense) attention layer in every block."""
    common = {"dense": config.dense, "two_stage_routing": config.two_stage_routing, "execution": config.execution}
    if config.dense:
        attn_layer = layerwise([0] * config.depth, [0] * config.depth, **common)
    else:
        attn_layer = layerwise(*config.layer_budgets(), **common)
    model = VisionTransformer(
        img_size=config.img_size, patch_size=config.patch_size, in_chans=config.in_chans,
        num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
        num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm, drop_rate=config.drop_rate, drop_path_rate=config.drop_path_rate,
        global_pool=config.global_pool, attn_layer=attn_layer, **config.timm_kwargs,
    )
    assert all(isinstance(block.attn, MoHAttention) for block in model.blocks)
    return model


# Paper Tab. 1 budgets on timm's ViT shapes. ViT-S has 6 heads per layer, so 75% / 80% are reached as the
# mean over layers, with more active heads in shallow layers than in deep ones, as MoH-TransNeXt does.
_VIT_S = {"embed_dim": 384, "depth": 12, "num_heads": 6}
_VIT_B = {"embed_dim": 768, "depth": 12, "num_heads": 12}
VIT_CONFIGS: dict[str, dict] = {
    "vit_s_100": {**_VIT_S, "dense": True, "drop_path_rate": 0.1},
    "vit_s_80": {**_VIT_S, "num_shared_heads": 2, "top_k": [3] * 10 + [2] * 2, "drop_path_rate": 0.1},
    "vit_s_75": {**_VIT_S, "num_shared_heads": 2, "top_k": [3] * 6 + [2] * 6, "drop_path_rate": 0.1},
    "vit_b_100": {**_VIT_B, "dense": True, "drop_path_rate": 0.1},
    "vit_b_75": {**_VIT_B, "num_shared_heads": 4, "top_k": 5, "drop_path_rate": 0.1},
    "vit_b_50": {**_VIT_B, "num_shared_heads": 2, "top_k": 4, "drop_path_rate": 0.1},
}


def vit_config(name: str, **overrides) -> ViTConfig:
    """A named config (``VIT_CONFIGS``) with keyword overrides."""
    if name not in VIT_CONFIGS:
        raise ValueError(f"Unknown ViT config {name!r}; choose one of {sorted(VIT_CONFIGS)}.")
    return ViTConfig(**{**VIT_CONFIGS[name], **overrides})


__all__ = ["VIT_CONFIGS", "ViTConfig", "create_vit", "vit_config"]
