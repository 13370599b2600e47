"""The MoH-ViT's configuration: timm's ``VisionTransformer`` arguments and the head budget, as one saved record.

Apart from the network because a config is data: tasks, checkpoints and the named-model registry read it without
building anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers
from moh_lightning.serialization import checkpoint_type
from moh_lightning.value_checks import check_numbers


@checkpoint_type(also_as="moh_lightning.models.vit.ViTConfig")
@dataclass
class ViTConfig:
    """Architecture of a (MoH) ViT: timm's ``VisionTransformer`` arguments and the MoH head budget.

    Defaults are ViT-S/16 at 224 pixels for ImageNet-1k. ``head_dim`` is the width of one head
    (``embed_dim // num_heads`` when None). ``pretrained`` starts the network ``create_vit`` builds from weights: a
    timm model name (downloaded through timm, e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k``), a local file
    (``.safetensors`` or a ``torch.save``'d state dict, timm's names) or a ``moh fit`` checkpoint, any head budget
    (``load_vit_weights``: routers kept where their shapes fit, else fresh; the classifier head fresh when
    ``num_classes`` differs; the position embedding resampled to another grid and the patch embedding adapted to
    ``in_chans`` as timm does). ``ImageClassifier`` takes it as ``init_from``, its name in every task.
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
    pretrained: str | None = None

    def __post_init__(self) -> None:
        check_numbers({"arch": self}, "model.init_args")  # before a size of 0 reaches any arithmetic
        self.moh = as_moh_config(self.moh)
        attention_layers(self.moh, self.num_heads, self.depth)

    @property
    def activated_fraction(self) -> float:
        return activated_fraction(self.moh, self.num_heads, self.depth)


__all__ = ["ViTConfig"]
