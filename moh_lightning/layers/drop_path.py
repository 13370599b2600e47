"""Stochastic depth whose rate a compiled block reads from a tensor, so blocks of different rates share one graph.

Stochastic depth gives each block its own rate (linear from 0 over the depth), and timm's ``DropPath`` keeps it as a
Python float that ``drop_path`` branches on and hands to ``bernoulli_``. Dynamo specialises such a float: a compiled
block is traced again for every rate, so regional compilation compiled every ViT and TransNeXt block on its own, and
after ``torch._dynamo.config.recompile_limit`` (8) blocks the rest ran eagerly.
"""
from __future__ import annotations

import torch
from timm.layers import DropPath as TimmDropPath


class DropPath(TimmDropPath):
    """timm's ``DropPath`` (same arguments, ``drop_prob`` and ``scale_by_keep``) with the keep probability also in a
    0-d buffer, which the forward reads under ``torch.compile``: one graph serves every rate, 0 included.

    Eager forwards are timm's, draw for draw, so eager training is unchanged. A compiled forward draws the per-sample
    mask from the buffer (``bernoulli_`` with a tensor probability, another random stream than with a float; Inductor
    draws from its own generator in any case). The buffer is not saved: state dicts are timm's.
    """

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__(drop_prob, scale_by_keep)
        self.register_buffer("keep_prob", torch.tensor(1.0 - drop_prob), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return super().forward(x)
        if not self.training:
            return x
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(self.keep_prob)    # (B, 1, ...)
        if self.scale_by_keep:
            # timm does not scale at keep 0 (a mask of zeros); the clamp keeps that case 0 rather than 0 / 0.
            mask = mask / self.keep_prob.clamp_min(torch.finfo(self.keep_prob.dtype).tiny)
        return x * mask


__all__ = ["DropPath"]
