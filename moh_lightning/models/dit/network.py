"""Diffusion Transformer (DiT, Peebles & Xie, ICCV 2023) with Mixture-of-Head attention in every block.

The network follows DiT exactly: patchify, fixed 2-D sin-cos position embedding, timestep and label embedders
(label dropout for classifier-free guidance), adaLN-Zero blocks, a zero-initialised final layer and a learned
variance (the output has twice the input channels). The only change is the attention block: ``MoHAttention``
with a per-layer head budget (MoH-DiT, paper section 4.2), or ``dense=True`` for the DiT baseline.

The named models (the paper's sizes with the authors' per-layer budgets, fewer active heads in shallow layers, and
the small pixel-space models of the 32x32 MNIST default) are the shipped configs in ``cli_configs/``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from timm.layers import Mlp, PatchEmbed
from torch import nn

from moh_lightning.layers import MoHAttention
from moh_lightning.layers.moh_config import attention_layers
from moh_lightning.models.dit.config import DiTConfig


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: per-sample affine of normalised tokens (B, N, C) by (B, C) shift and scale."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of the (possibly fractional) timestep, then a two-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """(B,) timesteps -> (B, dim) cos / sin features at geometrically spaced frequencies."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Module):
    """Class embedding table with one extra "null" class; labels are dropped to it for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: torch.Tensor, train: bool) -> torch.Tensor:
        if train and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class DiTBlock(nn.Module):
    """Transformer block whose norms are modulated and residual branches gated by the condition (adaLN-Zero)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, head_dim: int | None = None,
                 **moh: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = MoHAttention(hidden_size, num_heads=num_heads, attn_head_dim=head_dim, qkv_bias=True, **moh)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """Modulated norm and a linear map from tokens to patches of the output channels."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Class-conditional diffusion transformer: ``forward(x, t, y)`` predicts noise (and the variance interpolation).

    Built from a ``DiTConfig``; ``config.moh`` sets each block's head budget (MoH-DiT, paper section 4.2).
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.in_chans = config.in_chans
        self.out_channels = config.in_chans * 2 if config.learn_sigma else config.in_chans
        self.learn_sigma = config.learn_sigma
        self.patch_size = config.patch_size
        self.num_classes = config.num_classes
        input_size, patch_size, hidden_size = config.input_size, config.patch_size, config.embed_dim
        heads = [config.num_heads] * config.depth if isinstance(config.num_heads, int) else list(config.num_heads)
        layers = attention_layers(config.moh, heads, config.depth)

        self.x_embedder = PatchEmbed(input_size, patch_size, config.in_chans, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(config.num_classes, hidden_size, config.class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        # Fixed sin-cos embedding, a buffer so that neither the optimiser nor the EMA touches it.
        self.register_buffer("pos_embed", torch.zeros(1, num_patches, hidden_size), persistent=False)
        self.blocks = nn.ModuleList([
            DiTBlock(hidden_size, heads[i], config.mlp_ratio, config.head_dim, **layers[i])
            for i in range(config.depth)
        ])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's initialisation: xavier linears, sin-cos positions, N(0, 0.02) embeddings, zeroed adaLN and output."""
        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.apply(_basic_init)

        grid = int(self.x_embedder.num_patches ** 0.5)
        self.pos_embed.copy_(sincos_pos_embed_2d(self.pos_embed.shape[-1], grid).unsqueeze(0))

        w = self.x_embedder.proj.weight.data  # initialised like a linear layer, not a conv
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)

        for block in self.blocks:  # adaLN-Zero: every block starts as the identity
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, p*p*C) tokens -> (B, C, H, W) image."""
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Noisy input (B, C, H, W), timesteps (B,), labels (B,) -> (B, out_channels, H, W)."""
        x = self.x_embedder(x) + self.pos_embed                                # (B, N, D)
        c = self.t_embedder(t) + self.y_embedder(y, self.training)              # (B, D)
        for block in self.blocks:
            x = block(x, c)                                                     # (B, N, D)
        x = self.final_layer(x, c)                                              # (B, N, p*p*C_out)
        return self.unpatchify(x)                                               # (B, C_out, H, W)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float,
                         channels: int | None = None) -> torch.Tensor:
        """Classifier-free guidance: conditional and null-class passes in one batch, guided noise returned.

        The first ``channels`` noise channels are guided (all when None; DiT's code guides three of the four latent
        channels, for reproducibility of its published numbers); the others, and the variance channels, are the
        conditional pass's.
        """
        null = torch.full_like(y, self.num_classes)
        out = self.forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))
        cond, uncond = out.chunk(2)
        guided = self.in_chans if channels is None else channels
        eps = uncond[:, :guided] + cfg_scale * (cond[:, :guided] - uncond[:, :guided])
        return torch.cat([eps, cond[:, guided:]], dim=1)


def sincos_pos_embed_2d(embed_dim: int, grid_size: int) -> torch.Tensor:
    """(grid_size**2, embed_dim) fixed embedding: half the channels encode the row, half the column (MAE / DiT)."""
    if embed_dim % 4:
        raise ValueError(f"hidden_size={embed_dim} must be a multiple of 4 for the 2-D sin-cos position embedding.")
    coords = torch.arange(grid_size, dtype=torch.float64)
    grid_w, grid_h = torch.meshgrid(coords, coords, indexing="xy")  # width first, as DiT's numpy code

    def embed_1d(pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(embed_dim // 4, dtype=torch.float64) / (embed_dim / 4))
        out = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    return torch.cat([embed_1d(grid_w), embed_1d(grid_h)], dim=1).float()


__all__ = ["DiT", "DiTBlock", "FinalLayer", "LabelEmbedder", "TimestepEmbedder", "sincos_pos_embed_2d"]
