"""DiT's configuration: the network's sizes and the per-block head budget, as one saved record.

Apart from the network because a config is data: the diffusion task, its checkpoints and the exporters read it
without building anything.
"""
from __future__ import annotations

from dataclasses import dataclass

from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers
from moh_lightning.serialization import checkpoint_type
from moh_lightning.value_checks import check_numbers


@checkpoint_type(also_as="moh_lightning.models.dit.DiTConfig")
@dataclass
class DiTConfig:
    """Architecture of a (MoH-)DiT. Defaults are DiT-XL/2 on 32x32x4 SD-VAE latents of ImageNet 256.

    Args:
        input_size: Height = width of the input (latent or pixel) grid.
        patch_size: Side of the square patches the grid is cut into.
        in_chans: Channels of the input (4 for SD-VAE latents, 1 for grey pixels); timm's name, as ViT's.
        embed_dim: Token width.
        depth: Number of blocks.
        num_heads: Heads per block, or one entry per block (the authors' L/XL MoH models grow heads with depth).
        head_dim: Width of one head; ``embed_dim // num_heads`` when None.
        mlp_ratio: MLP hidden width over token width.
        class_dropout_prob: Probability of replacing a label by the null class in training (classifier-free guidance).
        num_classes: Number of conditioning classes.
        learn_sigma: Also output the variance interpolation (twice the input channels) as DiT does.
        moh: Head budget and routing; None (the default) is DiT's multi-head attention, the dense baseline.
        img_size: Side of the images of a pixel-space model, the name every image task and data module uses (``moh``
            links the image data module's here); sets ``input_size``. None for latent models, whose grid is the
            VAE's, smaller than the images.
    """

    input_size: int = 32
    patch_size: int = 2
    in_chans: int = 4
    embed_dim: int = 1152
    depth: int = 28
    num_heads: int | list[int] = 16
    head_dim: int | None = None
    mlp_ratio: float = 4.0
    class_dropout_prob: float = 0.1
    num_classes: int = 1000
    learn_sigma: bool = True
    moh: MoHConfig | None = None
    img_size: int | None = None

    def __post_init__(self) -> None:
        check_numbers({"arch": self}, "model.init_args")  # before a size of 0 reaches any arithmetic
        self.moh = as_moh_config(self.moh)
        if self.img_size is not None:
            self.input_size = self.img_size
        if self.input_size % self.patch_size:
            raise ValueError(f"input_size={self.input_size} is not divisible by patch_size={self.patch_size}.")
        attention_layers(self.moh, self.num_heads, self.depth)

    @property
    def activated_fraction(self) -> float:
        return activated_fraction(self.moh, self.num_heads, self.depth)

    def __setstate__(self, state: dict) -> None:
        # Checkpoints written before the rename hold DiT's own name for the input channels.
        if "in_channels" in state:
            state["in_chans"] = state.pop("in_channels")
        self.__dict__.update(state)


__all__ = ["DiTConfig"]
