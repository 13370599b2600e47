"""TransNeXt's two token mixers as ``MoHAttention`` layers: full attention and pixel-focused aggregated attention.

Apart from the network because this is where TransNeXt differs from every other model of the suite: its similarity
(l2-normalised queries and keys, a learnable per-head temperature, the log of the number of keys a query sees, a
learnable query embedding, a continuous relative position bias) and, in stages whose ``sr_ratio`` is above 1, each
query attending under one softmax to its own ``window_size`` x ``window_size`` neighbourhood and to keys pooled from
the whole map. The layers *are* ``MoHAttention`` (same ``qkv`` / ``proj`` / ``router`` modules, same gates from
``MoHRouter``): each head's output is multiplied by its gate before the output projection, so ``moh_layers``, the
load-balance loss and the head-load dashboards see TransNeXt's layers unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function, trunc_normal_
from torch import nn

from moh_lightning.layers import MoHAttention


def relative_position_table(query_grid: int, key_grid: int, pretrain_grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-spaced relative offsets between a query grid and a (pooled) key grid, for the continuous position bias.

    Keys sit at the centres of the adaptive-average-pooling cells. Offsets are scaled so that the pretraining grid
    spans [-8, 8] and mapped through sign(x) * log2(1 + |x|) / log2(8). Returns ``index`` (Nq, Nk) into ``table``
    (T, 2): the distinct (dy, dx) pairs, which are every pair of a distinct dy and a distinct dx, since rows and
    columns are independent.
    """
    axis = torch.arange(query_grid, dtype=torch.float32, device="cpu")
    key_axis = F.adaptive_avg_pool1d(axis[None], key_grid)[0]
    offsets = (axis[:, None] - key_axis[None, :]) / max(pretrain_grid - 1, 1) * 8        # (Gq, Gk) per axis
    values, inverse = torch.unique(offsets, return_inverse=True)
    count = len(values)
    # A query (qy, qx) and a key (ky, kx) meet at dy = offsets[qy, ky], dx = offsets[qx, kx].
    index = inverse[:, None, :, None] * count + inverse[None, :, None, :]                 # (qy, qx, ky, kx)
    index = index.reshape(query_grid * query_grid, key_grid * key_grid)
    table = torch.stack(torch.meshgrid(values, values, indexing="ij"), dim=-1).reshape(-1, 2)
    table = torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)
    return index, table


class ContinuousPositionBias(nn.Module):
    """A two-layer MLP from a relative offset (dy, dx) to one bias per head."""

    def __init__(self, num_heads: int, hidden: int = 512) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, hidden)
        self.fc2 = nn.Linear(hidden, num_heads)

    def forward(self, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """(Nq, Nk) indices into a (T, 2) table of offsets -> (h, Nq, Nk) bias."""
        bias = self.fc2(F.relu(self.fc1(table)))                                       # (T, h)
        return bias.t()[:, index]


@register_notrace_function  # under an FX trace the sizes are proxies: the check runs when the graph does
def check_token_grid(x: torch.Tensor, height: int, width: int, grid: int) -> torch.Tensor:
    """``x`` itself, once its ``height`` x ``width`` grid is the ``grid`` the layer was built for: a traced graph keeps
    a check whose output it uses."""
    if height != grid or width != grid:
        raise ValueError(f"a {height}x{width} token grid reached an attention layer built for {grid}x{grid}: "
                         f"TransNeXt runs at the img_size it was built for.")
    return x


class TransNeXtAttention(MoHAttention):
    """TransNeXt's full attention (its last stage) as a ``MoHAttention``: routed heads, TransNeXt's similarity.

    Similarity is the cosine of queries (plus a learnable query embedding) and keys, times a learnable per-head
    temperature (softplus, 1 / 0.24 at initialisation) and log(number of keys), plus the continuous position bias.
    ``qkv``, ``proj`` and ``router`` are ``MoHAttention``'s; each head's output is scaled by its gate.
    """

    def __init__(self, dim: int, num_heads: int, grid: int, key_grid: int, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, **moh: Any) -> None:
        if moh.get("execution", "auto") == "sparse":
            raise ValueError("execution='sparse' is not supported by TransNeXt's attention (it computes every head "
                             "and weights it by its gate): use 'auto' or 'dense'.")
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **moh)
        self.grid = grid
        self.key_grid = key_grid
        # softplus(temperature) = 1 / 0.24 at initialisation.
        self.temperature = nn.Parameter(torch.full((num_heads, 1, 1), math.log(math.expm1(1 / 0.24))))
        self.query_embedding = nn.Parameter(trunc_normal_(torch.empty(num_heads, 1, self.head_dim), std=0.02))
        self.cpb = ContinuousPositionBias(num_heads)
        self.register_buffer("seq_length_scale", torch.tensor(math.log(grid * grid)), persistent=False)

    def _route(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
        """This forward's gates (B, N, h) from the layer's router, recorded as ``MoHAttention`` records them."""
        if self.router is None:
            return None
        routing = self.router(x, q=q)
        if not isinstance(x, torch.fx.Proxy):  # an FX trace's proxies must not outlive it (see MoHAttention)
            self.last_gates = routing.gates.detach()
            self.load_balance_loss = routing.load_balance_loss
        return routing.gates

    def _scaled_queries(self, q_unit: torch.Tensor) -> torch.Tensor:
        scaled = (q_unit + self.query_embedding) * F.softplus(self.temperature) * self.seq_length_scale
        return scaled.to(q_unit.dtype)

    def _merge_heads(self, out: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """(B, h, N, d) head outputs -> gated, concatenated and projected (B, N, C)."""
        batch, _, length, _ = out.shape
        out = out.transpose(1, 2)                                                    # (B, N, h, d)
        if gates is not None:
            out = out * gates[..., None].to(out.dtype)
        return self.proj_drop(self.proj(out.reshape(batch, length, self.attn_dim)))

    def forward(self, x: torch.Tensor, height: int, width: int, position: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """Tokens (B, N, C) of a ``height`` x ``width`` grid; ``position`` = (index, table) of the stage."""
        x = check_token_grid(x, height, width, self.grid)
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        gates = self._route(x, q)                                                    # q, k, v: (B, h, N, d)
        bias = self.cpb(*position).to(q.dtype)                                       # (h, N, N)
        out = F.scaled_dot_product_attention(
            self._scaled_queries(F.normalize(q, dim=-1)), F.normalize(k, dim=-1), v, attn_mask=bias,
            dropout_p=self.attn_drop.p if self.training else 0.0, scale=1.0)
        return self._merge_heads(out, gates)


class AggregatedAttention(TransNeXtAttention):
    """Pixel-focused aggregated attention: a local window and pooled keys under one softmax, as a ``MoHAttention``.

    Every query attends to the keys of its ``window_size`` x ``window_size`` neighbourhood (positions outside the
    map are masked) and to keys of the map pooled to ``pool_grid`` x ``pool_grid`` (1x1 convolution, GELU, adaptive
    average pooling, LayerNorm, then the layer's own key and value projections). The local similarities get a
    learned bias per window position, the pooled ones the continuous position bias; after the softmax the local
    weights also get a query-dependent bias from learnable tokens. The log-length scale counts the keys each query
    really sees. One ``qkv`` projection serves the queries and the local keys and values; the pooled tokens use its
    key and value rows.
    """

    def __init__(self, dim: int, num_heads: int, grid: int, pool_grid: int, window_size: int = 3,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0, **moh: Any) -> None:
        super().__init__(dim, num_heads, grid, pool_grid, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, **moh)
        self.window_size = window_size
        self.local_len = window_size * window_size
        self.pool_len = pool_grid * pool_grid
        self.sr = nn.Conv2d(dim, dim, kernel_size=1)
        self.pool_norm = nn.LayerNorm(dim)
        self.relative_pos_bias_local = nn.Parameter(trunc_normal_(torch.empty(num_heads, self.local_len), std=4e-4))
        self.learnable_tokens = nn.Parameter(trunc_normal_(torch.empty(num_heads, self.head_dim, self.local_len),
                                                           std=0.02))
        self.learnable_bias = nn.Parameter(torch.zeros(num_heads, 1, self.local_len))
        outside = _outside_window(grid, window_size)                                  # (N, L)
        self.register_buffer("window_outside", outside, persistent=False)
        seen = (~outside).sum(-1, keepdim=True).float() + self.pool_len               # keys per query
        self.register_buffer("seq_length_scale", seen.log(), persistent=False)        # (N, 1)

    def _window_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """(B, h, N, d) -> the L window positions' (B, h, H, W, d) views, row by row, zeros outside the map."""
        batch, heads, _, dim = t.shape
        r, grid = self.window_size // 2, self.grid
        padded = F.pad(t.reshape(batch, heads, grid, grid, dim), (0, 0, r, r, r, r))
        return [padded[:, :, dy:dy + grid, dx:dx + grid] for dy in range(self.window_size)
                for dx in range(self.window_size)]

    def _local_scores(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Similarity of each query to the keys of its window: (B, h, N, L), without gathering the windows."""
        batch, heads, length, dim = queries.shape
        grid_queries = queries.reshape(batch, heads, self.grid, self.grid, dim)
        scores = [(grid_queries * view).sum(-1) for view in self._window_views(keys)]   # L x (B, h, H, W)
        return torch.stack(scores, dim=-1).reshape(batch, heads, length, self.local_len)

    def _local_mix(self, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Sum over each query's window of weight (B, h, N, L) times value: (B, h, N, d)."""
        batch, heads, length, dim = values.shape
        weights = weights.reshape(batch, heads, self.grid, self.grid, self.local_len, 1)
        out = sum(weights[..., i, :] * view for i, view in enumerate(self._window_views(values)))
        return out.reshape(batch, heads, length, dim)

    def _pooled_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, channels = x.shape
        feature_map = x.transpose(1, 2).reshape(batch, channels, self.grid, self.grid)
        pooled = F.adaptive_avg_pool2d(F.gelu(self.sr(feature_map)), self.key_grid)
        pooled = self.pool_norm(pooled.flatten(2).transpose(1, 2))                   # (B, P, C)
        kv = F.linear(pooled, self.qkv.weight[channels:],
                      None if self.qkv.bias is None else self.qkv.bias[channels:])
        k, v = kv.reshape(batch, self.pool_len, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v                                                                  # (B, h, P, d)

    def forward(self, x: torch.Tensor, height: int, width: int, position: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        x = check_token_grid(x, height, width, self.grid)
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        gates = self._route(x, q)
        q_unit = F.normalize(q, dim=-1)
        queries = self._scaled_queries(q_unit)                                       # (B, h, N, d)

        local = self._local_scores(queries, F.normalize(k, dim=-1)) + self.relative_pos_bias_local[:, None]
        local = local.masked_fill(self.window_outside, float("-inf"))                # (B, h, N, L)

        k_pool, v_pool = self._pooled_keys_values(x)
        pooled = queries @ F.normalize(k_pool, dim=-1).transpose(-2, -1) + self.cpb(*position).to(q.dtype)

        weights = self.attn_drop(torch.cat([local, pooled], dim=-1).softmax(dim=-1))
        w_local, w_pool = weights.split([self.local_len, self.pool_len], dim=-1)
        w_local = w_local + q_unit @ self.learnable_tokens + self.learnable_bias     # (B, h, N, L)
        out = self._local_mix(w_local, v) + w_pool @ v_pool                          # (B, h, N, d)
        return self._merge_heads(out, gates)


def _outside_window(grid: int, window_size: int) -> torch.Tensor:
    """(N, L) True where a token's window position falls outside the ``grid`` x ``grid`` map."""
    r = window_size // 2
    pos = torch.arange(grid, device="cpu")
    offsets = torch.arange(window_size, device="cpu") - r
    rows = pos[:, None] + offsets[None]                                              # (G, w)
    valid_axis = (rows >= 0) & (rows < grid)
    valid = valid_axis[:, None, :, None] & valid_axis[None, :, None, :]              # (y, x, dy, dx)
    return ~valid.reshape(grid * grid, window_size * window_size)


__all__ = ["AggregatedAttention", "ContinuousPositionBias", "TransNeXtAttention", "check_token_grid",
           "relative_position_table"]
