"""The key/value cache of causal decoding, one per attention layer.

Apart from the attention block because the decoder LM owns and builds the caches (one per layer, sized to
its sequence length) while the block only writes into the one it is handed.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of the tokens decoded so far, for one attention layer.

    Preallocated to ``max_len`` so a decode step writes in place instead of concatenating.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 device=None, dtype=None) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``k, v`` (B, h_kv, n, d) and returns every cached key and value so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; decoding position {end - 1} needs a "
                             f"larger cache (raise max_len / max_seq_len).")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]
