"""The TransNeXt network in native PyTorch, with MoH (or dense) attention in every block.

An overlapping patch embedding, four stages that halve the grid and widen the tokens, and in each block a token mixer
(``attention``) and a convolutional GLU; timm's classifier and backbone interface (``forward_features``,
``forward_head``, ``feature_info``, ``forward_intermediates``). Head budgets are given per stage (the authors'
``shared_head`` / ``routed_head`` lists are ``num_shared_heads`` / ``top_k``) or per block, in the config.
"""
from __future__ import annotations

import math

import torch
from timm.layers import trunc_normal_
from torch import nn

from moh_lightning.layers import DropPath
from moh_lightning.layers.moh_config import attention_layers
from moh_lightning.models.timm_compat import feature_take_indices
from moh_lightning.models.transnext.attention import (
    AggregatedAttention,
    TransNeXtAttention,
    relative_position_table,
)
from moh_lightning.models.transnext.config import NUM_STAGES, TransNeXtConfig, stage_grids


class ConvolutionalGLU(nn.Module):
    """Gated linear unit whose gate branch passes a 3x3 depthwise convolution and GELU (TransNeXt's channel mixer).

    The hidden width is 2/3 of ``hidden_features``, so the two branches together cost what one MLP of that width
    would.
    """

    def __init__(self, dim: int, hidden_features: int, drop: float = 0.0) -> None:
        super().__init__()
        hidden = int(2 * hidden_features / 3)
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.dwconv = nn.Conv2d(hidden, hidden, kernel_size=3, padding=1, groups=hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)                                  # (B, N, hidden) each
        batch, length, hidden = gate.shape
        gate = self.dwconv(gate.transpose(1, 2).reshape(batch, hidden, height, width)).flatten(2).transpose(1, 2)
        return self.drop(self.fc2(self.drop(self.act(gate) * value)))


class TransNeXtBlock(nn.Module):
    """Pre-norm residual block: token mixer (aggregated or full MoH attention), then convolutional GLU.

    ``drop_path`` is the block's stochastic depth rate, None in a model without stochastic depth. A rate of 0 (the
    first block's) is a ``DropPath`` too, whose compiled forward reads its rate from a tensor: a stage's blocks of
    one head budget share one compiled graph whatever their rates.
    """

    def __init__(self, attn: TransNeXtAttention, dim: int, mlp_ratio: float, drop: float,
                 drop_path: float | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ConvolutionalGLU(dim, int(dim * mlp_ratio), drop)
        self.drop_path = nn.Identity() if drop_path is None else DropPath(drop_path)

    def forward(self, x: torch.Tensor, height: int, width: int, position: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), height, width, position))
        return x + self.drop_path(self.mlp(self.norm2(x), height, width))


class OverlapPatchEmbed(nn.Module):
    """Strided convolution whose kernel overlaps its neighbours, then LayerNorm over channels: (B, C, H, W) out."""

    def __init__(self, in_chans: int, embed_dim: int, kernel_size: int, stride: int, img_size: int) -> None:
        super().__init__()
        self.img_size = (img_size, img_size)  # the input side this embedding receives
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size, stride=stride, padding=kernel_size // 2)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TransNeXtStage(nn.Module):
    """Downsampling (none in the first stage: the stem did it), blocks on the stage's grid, a final LayerNorm.

    The stage holds the grid's relative-position table for the continuous position bias of all its blocks.
    """

    def __init__(self, downsample: nn.Module, blocks: list[TransNeXtBlock], dim: int, grid: int,
                 position: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grid = grid
        self.register_buffer("position_index", position[0], persistent=False)
        self.register_buffer("position_table", position[1], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)                                                       # (B, C, H, W)
        batch, channels, height, width = x.shape
        # A tensor of its own, as every later block's input: given a view (Dynamo guards on its base), the stage's
        # first compiled block would be a graph of its own.
        x = x.flatten(2).transpose(1, 2).clone()                                     # (B, N, C)
        position = (self.position_index, self.position_table)
        for block in self.blocks:
            x = block(x, height, width, position)
        return self.norm(x).transpose(1, 2).reshape(batch, channels, height, width)


class TransNeXt(nn.Module):
    """TransNeXt classifier with MoH (or dense) attention in every block, built from a ``TransNeXtConfig``.

    ``forward_features`` returns the last stage's (B, C, H, W) map, ``forward_head`` pools it and classifies, as in
    timm; ``feature_info`` and ``forward_intermediates`` give the four stages' maps to a detection or segmentation
    neck (``timm.create_model(..., features_only=True)``). The blocks' attention layers are ``MoHAttention``
    subclasses, so ``moh_layers(model)`` lists the routed ones in stage and block order.
    """

    def __init__(self, arch: TransNeXtConfig) -> None:
        super().__init__()
        self.arch = arch
        dims, depths, heads = arch.stage("embed_dim"), arch.stage("depth"), arch.stage("num_heads")
        mlp_ratios, sr_ratios = arch.stage("mlp_ratio"), arch.stage("sr_ratio")
        grids = arch.grids
        pretrain_grids = stage_grids(arch.pretrain_size or arch.img_size, arch.patch_size)
        layers = attention_layers(arch.layer_moh, arch.layer_heads, sum(depths))
        total = sum(depths)
        drop_path = [arch.drop_path_rate * i / max(total - 1, 1) if arch.drop_path_rate > 0 else None
                     for i in range(total)]                                          # linear from 0
        self.num_classes = arch.num_classes
        self.in_chans = arch.in_chans
        self.num_features = self.head_hidden_size = dims[-1]
        self.global_pool = arch.global_pool

        self.patch_embed = OverlapPatchEmbed(arch.in_chans, dims[0], 2 * arch.patch_size - 1, arch.patch_size,
                                             arch.img_size)
        stages, first = [], 0
        for i in range(NUM_STAGES):
            full = sr_ratios[i] == 1
            key_grid = grids[i] if full else (arch.pool_size or grids[i] // sr_ratios[i])
            if key_grid < 1:
                raise ValueError(f"stage {i}: a {grids[i]}x{grids[i]} grid pooled by sr_ratio={sr_ratios[i]} leaves "
                                 f"no keys; lower sr_ratio or raise img_size.")
            blocks = []
            for j in range(depths[i]):
                common = {"qkv_bias": arch.qkv_bias, "attn_drop": arch.attn_drop_rate, "proj_drop": arch.drop_rate,
                          **layers[first + j]}
                attn = (TransNeXtAttention(dims[i], heads[i], grids[i], key_grid, **common) if full else
                        AggregatedAttention(dims[i], heads[i], grids[i], key_grid, arch.window_size, **common))
                blocks.append(TransNeXtBlock(attn, dims[i], mlp_ratios[i], arch.drop_rate, drop_path[first + j]))
            first += depths[i]
            downsample = nn.Identity() if i == 0 else OverlapPatchEmbed(dims[i - 1], dims[i], 3, 2, grids[i - 1])
            position = relative_position_table(grids[i], key_grid, pretrain_grids[i])
            stages.append(TransNeXtStage(downsample, blocks, dims[i], grids[i], position))
        self.stages = nn.ModuleList(stages)
        self.feature_info = [{"num_chs": dims[i], "reduction": arch.patch_size * 2 ** i, "module": f"stages.{i}"}
                             for i in range(NUM_STAGES)]
        self.head = nn.Linear(dims[-1], arch.num_classes) if arch.num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """TransNeXt's initialisation of every layer, routers included: truncated-normal linears, fan-out normal
        convolutions, unit norms (the attention layers initialise their own parameters)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels // module.groups
                nn.init.normal_(module.weight, 0.0, math.sqrt(2.0 / fan_out))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay_keywords(self) -> set[str]:
        """Parameter-name keywords TransNeXt's recipe trains without weight decay (besides norms and biases)."""
        return {"query_embedding", "relative_pos_bias_local", "cpb", "temperature"}

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: int | list[int] | None = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """The (B, C_i, H_i, W_i) maps of the stages in ``indices`` (the last n for an int, all for None), and unless
        ``intermediates_only`` the last stage's map first, as timm's hierarchical models return them.

        Every stage ends with its own LayerNorm, so the maps are normalised whatever ``norm`` says. ``stop_early`` runs
        no stage past the last one asked for.
        """
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt={output_fmt!r}: TransNeXt's stages give NCHW maps.")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        stages = self.stages[:max_index + 1] if stop_early else self.stages
        intermediates = []
        x = self.patch_embed(x)
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                intermediates.append(x)
        return intermediates if intermediates_only else (x, intermediates)

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drops the stages after the last of ``indices`` (and the head, unless ``prune_head`` is False and no stage
        was dropped); returns the absolute indices. The stages' norms stay: each belongs to its stage's output."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        pruned_end = max_index < len(self.stages) - 1
        self.stages = self.stages[:max_index + 1]
        if pruned_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_head or pruned_end:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)                                                      # (B, C0, H0, W0)
        for stage in self.stages:
            x = stage(x)
        return x                                                                     # (B, C3, H3, W3)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(2, 3))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def create_transnext(arch: TransNeXtConfig) -> TransNeXt:
    """Builds a (MoH-)TransNeXt from its config."""
    return TransNeXt(arch)


__all__ = ["ConvolutionalGLU", "OverlapPatchEmbed", "TransNeXt", "TransNeXtBlock", "TransNeXtStage",
           "create_transnext"]
