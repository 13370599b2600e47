"""TransNeXt's configuration: sizes per stage, the attention geometry and the head budget, as one saved record.

Apart from the network because a config is data: tasks, checkpoints, the named-model registry and the exporters read
it (and derive each stage's grid and each block's budget from it) without building anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers
from moh_lightning.serialization import checkpoint_type
from moh_lightning.value_checks import check_numbers

NUM_STAGES = 4


@checkpoint_type(also_as="moh_lightning.models.transnext.TransNeXtConfig")
@dataclass
class TransNeXtConfig:
    """Architecture of a (MoH-)TransNeXt. Defaults are TransNeXt-S at 224 pixels for ImageNet-1k, dense.

    Per-stage settings take one value for every stage or a list of four.

    Args:
        img_size: Side of the square input; the attention geometry (windows, pooled grids, position tables) is built
            for it, so the model runs at this size only.
        patch_size: Stride of the first (overlapping, kernel ``2 * patch_size - 1``) patch embedding.
        in_chans: Image channels.
        num_classes: Classes of the linear head (0: no head).
        embed_dim: Token width of each stage.
        depth: Blocks in each stage.
        num_heads: Heads in each stage (width ``embed_dim / num_heads``).
        mlp_ratio: Hidden width of each stage's convolutional GLU over the token width (before its 2/3 factor).
        sr_ratio: How much each stage's pooled keys are coarser than its grid; 1 is full attention (the last stage).
        window_size: Side of the local window of aggregated attention (odd).
        pool_size: Side of the pooled grid in every aggregated stage, instead of ``grid // sr_ratio`` (TransNeXt's
            linear inference mode for other resolutions).
        pretrain_size: Input side the position bias was trained at (scales its offsets); ``img_size`` when None.
        qkv_bias: Biases on the query, key and value projections.
        drop_rate: Dropout after the attention projection and in the GLU.
        attn_drop_rate: Dropout on the attention weights.
        drop_path_rate: Stochastic depth of the last block, growing linearly from 0 over the blocks.
        global_pool: ``"avg"`` pools the last feature map before the head; ``""`` returns it unpooled.
        moh: Head budget and routing; lists in ``num_shared_heads`` / ``top_k`` have one entry per stage or one per
            block. None (the default) is TransNeXt's multi-head attention, the dense baseline.
    """

    img_size: int = 224
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int | list[int] = field(default_factory=lambda: [72, 144, 288, 576])
    depth: int | list[int] = field(default_factory=lambda: [5, 5, 22, 5])
    num_heads: int | list[int] = field(default_factory=lambda: [3, 6, 12, 24])
    mlp_ratio: float | list[float] = field(default_factory=lambda: [8.0, 8.0, 4.0, 4.0])
    sr_ratio: int | list[int] = field(default_factory=lambda: [8, 4, 2, 1])
    window_size: int = 3
    pool_size: int | None = None
    pretrain_size: int | None = None
    qkv_bias: bool = True
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.45
    global_pool: str = "avg"
    moh: MoHConfig | None = None

    def __post_init__(self) -> None:
        check_numbers({"arch": self}, "model.init_args")  # before a size of 0 reaches any arithmetic
        self.moh = as_moh_config(self.moh)
        if isinstance(self.img_size, (tuple, list)):  # timm passes (H, W)
            if len(set(self.img_size)) != 1:
                raise ValueError(f"img_size={self.img_size}: TransNeXt is built for square inputs.")
            self.img_size = int(self.img_size[0])
        if self.window_size < 1 or self.window_size % 2 == 0:
            raise ValueError(f"window_size={self.window_size} must be odd.")
        if self.global_pool not in ("avg", ""):
            raise ValueError(f"global_pool={self.global_pool!r}: choose 'avg' or '' (no pooling).")
        for dim, heads in zip(self.stage("embed_dim"), self.stage("num_heads"), strict=True):
            if dim % heads:
                raise ValueError(f"embed_dim={dim} is not divisible by num_heads={heads} in a stage.")
        if self.stage("sr_ratio")[-1] != 1:
            raise ValueError("sr_ratio of the last stage must be 1 (full attention).")
        attention_layers(self.layer_moh, self.layer_heads, sum(self.stage("depth")))

    def stage(self, key: str) -> list:
        """One value of a per-stage setting for each of the four stages."""
        value = getattr(self, key)
        if isinstance(value, (int, float)):
            return [value] * NUM_STAGES
        value = list(value)
        if len(value) != NUM_STAGES:
            raise ValueError(f"arch.{key} has {len(value)} entries: give one per stage ({NUM_STAGES}) or one value.")
        return value

    @property
    def grids(self) -> list[int]:
        """Side of each stage's token grid (what the strided convolutions make of ``img_size``)."""
        return stage_grids(self.img_size, self.patch_size)

    @property
    def layer_heads(self) -> list[int]:
        return [heads for heads, depth in zip(self.stage("num_heads"), self.stage("depth"), strict=True)
                for _ in range(depth)]

    @property
    def layer_moh(self) -> MoHConfig | None:
        """``moh`` with per-stage budget lists repeated over each stage's blocks (one entry per block)."""
        if self.moh is None:
            return None
        depths = self.stage("depth")
        return replace(self.moh, num_shared_heads=_per_block(self.moh.num_shared_heads, depths, "num_shared_heads"),
                       top_k=_per_block(self.moh.top_k, depths, "top_k"))

    @property
    def activated_fraction(self) -> float:
        """Share of all attention heads (over every block) a token uses."""
        return activated_fraction(self.layer_moh, self.layer_heads, sum(self.stage("depth")))


def _per_block(value: int | list[int] | None, depths: list[int], key: str) -> int | list[int] | None:
    if value is None or isinstance(value, int):
        return value
    value = list(value)
    if len(value) == len(depths):
        return [v for v, depth in zip(value, depths, strict=True) for _ in range(depth)]
    if len(value) == sum(depths):
        return value
    raise ValueError(f"arch.moh.{key} has {len(value)} entries: give one per stage ({len(depths)}), one per block "
                     f"({sum(depths)}) or a single int.")


def stage_grids(img_size: int, patch_size: int) -> list[int]:
    # The stem (kernel 2p - 1, stride p, padding p - 1) gives ceil(size / p); each later stage (3, 2, 1) halves, up.
    grids = [math.ceil(img_size / patch_size)]
    for _ in range(NUM_STAGES - 1):
        grids.append(math.ceil(grids[-1] / 2))
    return grids


__all__ = ["NUM_STAGES", "TransNeXtConfig", "stage_grids"]
