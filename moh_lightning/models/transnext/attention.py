"""TransNeXt's two token mixers as ``MoHAttention`` layers: full attention and pixel-focused aggregated attention.

Apart from the network because this is where TransNeXt differs from every other model of the suite: its similarity
(l2-normalised queries and keys, a learnable per-head temperature, the log of the number of keys a query sees, a
learnable query embedding, a continuous relative position bias) and, in stages whose ``sr_ratio`` is above 1, each
query attending under one softmax to its own ``window_size`` x ``window_size`` neighbourhood and to keys pooled from
the whole map. The layers *are* ``MoHAttention`` (same ``qkv`` / ``proj`` / ``router`` modules, same gates from
``MoHRouter``): each head's output is multiplied by its gate before the output projection, so ``moh_layers``, the
load-balance loss and the head-load dashboards see TransNeXt's layers unchanged. They override only
``MoHAttention.attend``, the attention core; with ``execution="sparse"`` it computes only the selected (token, head)
pairs, as ``layers/head_sparse_attention.py`` does for plain attention. ``auto`` computes every head and masks: no
measurement says where skipping heads pays for these cores.
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
    ``qkv``, ``proj`` and ``router`` are ``MoHAttention``'s, and so are its ``route`` and ``merge`` steps; head-sparse
    execution goes through ``MoHAttention.attend`` with the position bias as its mask.
    """

    def __init__(self, dim: int, num_heads: int, grid: int, key_grid: int, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, **moh: Any) -> None:
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **moh)
        self.grid = grid
        self.key_grid = key_grid
        # softplus(temperature) = 1 / 0.24 at initialisation.
        self.temperature = nn.Parameter(torch.full((num_heads, 1, 1), math.log(math.expm1(1 / 0.24))))
        self.query_embedding = nn.Parameter(trunc_normal_(torch.empty(num_heads, 1, self.head_dim), std=0.02))
        self.cpb = ContinuousPositionBias(num_heads)
        self.register_buffer("seq_length_scale", torch.tensor(math.log(grid * grid)), persistent=False)

    def forward(self, x: torch.Tensor, height: int, width: int, position: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """Tokens (B, N, C) of a ``height`` x ``width`` grid; ``position`` = (index, table) of the stage."""
        q, k, v = self._qkv(check_token_grid(x, height, width, self.grid))
        gates = self.route(x, q)
        return self.merge(self.attend(q, k, v, gates, attn_mask=self.cpb(*position).to(q.dtype)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None, *,
               attn_mask: torch.Tensor) -> torch.Tensor:
        """Gated head outputs (B, N, h, d) of TransNeXt's similarity; ``attn_mask`` (h, N, N) is the position bias."""
        queries, keys = self._scaled_queries(F.normalize(q, dim=-1)), F.normalize(k, dim=-1)
        if self._runs_head_sparse(gates, q):
            # The head-sparse backends scale by SDPA's default 1 / sqrt(d); TransNeXt's temperature is the scale.
            return super().attend(queries * self.head_dim ** 0.5, keys, v, gates, attn_mask=attn_mask)
        out = F.scaled_dot_product_attention(queries, keys, v, attn_mask=attn_mask,
                                             dropout_p=self.attn_drop.p if self.training else 0.0, scale=1.0)
        return _gated(out.transpose(1, 2), gates)                                    # (B, N, h, d)

    def _head_sparse(self, gates: torch.Tensor, num_queries: int, num_keys: int, decoding: bool = False,
                     causal: bool = False) -> bool:
        # Nothing has measured where skipping heads pays for TransNeXt's cores: auto computes every head.
        return self.execution == "sparse" and super()._head_sparse(gates, num_queries, num_keys, decoding, causal)

    def _runs_head_sparse(self, gates: torch.Tensor | None, q: torch.Tensor) -> bool:
        return (gates is not None and not isinstance(q, torch.fx.Proxy)
                and self._head_sparse(gates, q.shape[2], q.shape[2]))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v                                                               # (B, h, N, d)

    def _scaled_queries(self, q_unit: torch.Tensor, heads: slice = slice(None),
                        tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Unit queries of the ``heads`` (at the ``tokens`` rows, when gathered) with the query embedding, the
        temperature and the log-length scale of those heads and tokens."""
        length_scale = self.seq_length_scale if tokens is None else self.seq_length_scale[tokens]
        scaled = (q_unit + self.query_embedding[heads]) * F.softplus(self.temperature[heads]) * length_scale
        return scaled.to(q_unit.dtype)


class AggregatedAttention(TransNeXtAttention):
    """Pixel-focused aggregated attention: a local window and pooled keys under one softmax, as a ``MoHAttention``.

    Every query attends to the keys of its ``window_size`` x ``window_size`` neighbourhood (positions outside the
    map are masked) and to keys of the map pooled to ``pool_grid`` x ``pool_grid`` (1x1 convolution, GELU, adaptive
    average pooling, LayerNorm, then the layer's own key and value projections). The local similarities get a
    learned bias per window position, the pooled ones the continuous position bias; after the softmax the local
    weights also get a query-dependent bias from learnable tokens. The log-length scale counts the keys each query
    really sees. One ``qkv`` projection serves the queries and the local keys and values; the pooled tokens use its
    key and value rows. Head-sparse, the shared heads run this on every query, and each routed head on its selected
    queries only, gathered with their windows' keys and values.
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
        outside, neighbours = _window(grid, window_size)                              # (N, L)
        self.register_buffer("window_outside", outside, persistent=False)
        self.register_buffer("window_index", neighbours, persistent=False)
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
        q, k, v = self._qkv(check_token_grid(x, height, width, self.grid))
        gates = self.route(x, q)
        return self.merge(self.attend(q, k, v, gates, attn_mask=self.cpb(*position).to(q.dtype),
                                      pooled=self._pooled_keys_values(x)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None, *,
               attn_mask: torch.Tensor, pooled: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Gated head outputs (B, N, h, d) over each query's window and the ``pooled`` keys and values (B, h, P, d);
        ``attn_mask`` (h, N, P) is the pooled keys' position bias."""
        q_unit, k_unit = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        k_pool, v_pool = F.normalize(pooled[0], dim=-1), pooled[1]
        if not self._runs_head_sparse(gates, q):
            out = self._aggregate(q_unit, k_unit, v, k_pool, v_pool, attn_mask)
            return _gated(out.transpose(1, 2), gates)                                # (B, N, h, d)
        batch, heads, length, dim = q.shape
        shared = self.num_shared_heads
        # Rows b * N + i of one flat buffer and a last row for the routed heads' padding slots, as in
        # layers/head_sparse_attention.py: the result is a view of the buffer.
        out = q.new_zeros(batch * length + 1, heads, dim)
        tokens = out[:batch * length].view(batch, length, heads, dim)
        if shared:
            part = slice(0, shared)
            own = self._aggregate(q_unit[:, part], k_unit[:, part], v[:, part], k_pool[:, part], v_pool[:, part],
                                  attn_mask, part)
            tokens[:, :, part] = own.transpose(1, 2) * gates[..., part, None]
        if heads > shared:
            part = slice(shared, heads)
            selected = self._attend_routed(q_unit[:, part], k_unit[:, part], v[:, part], k_pool[:, part],
                                           v_pool[:, part], attn_mask, gates[..., part], part)
            if selected is not None:
                rows, values = selected
                out[rows, torch.arange(shared, heads, device=q.device)[None, :, None]] = values
        return tokens

    def _aggregate(self, q_unit: torch.Tensor, k_unit: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, bias: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """Every query of the ``heads`` (unit queries and keys (B, h', N, d)): their outputs (B, h', N, d)."""
        queries = self._scaled_queries(q_unit, heads)
        local = self._local_scores(queries, k_unit) + self.relative_pos_bias_local[heads, None]
        local = local.masked_fill(self.window_outside, float("-inf"))                # (B, h', N, L)
        pooled = queries @ k_pool.transpose(-2, -1) + bias[heads]                    # (B, h', N, P)
        weights = self.attn_drop(torch.cat([local, pooled], dim=-1).softmax(dim=-1))
        w_local, w_pool = weights.split([self.local_len, self.pool_len], dim=-1)
        w_local = w_local + q_unit @ self.learnable_tokens[heads] + self.learnable_bias[heads]
        return self._local_mix(w_local, v) + w_pool @ v_pool

    def _attend_routed(self, q_unit, k_unit, v, k_pool, v_pool, bias, gates, heads: slice):
        """The routed ``heads`` on their selected queries only: the flat-buffer row of each slot (B, E, S) and its
        gated output (B, E, S, d), or None when no token selected a routed head.

        Each head's selected queries are gathered into slots padded to the largest count over (sequence, head) (one
        host read), with their windows' keys and values; padding slots write to the buffer's last row.
        """
        batch, _, length, _ = q_unit.shape
        selected = gates.transpose(1, 2) != 0                                       # (B, E, N)
        width = int(selected.sum(-1).max())
        if width == 0:
            return None
        order = selected.to(torch.uint8).sort(dim=-1, descending=True, stable=True)
        real, slots = order.values[..., :width].bool(), order.indices[..., :width]   # (B, E, S): token of each slot
        sequence = torch.arange(batch, device=q_unit.device)[:, None, None]
        head = torch.arange(q_unit.shape[1], device=q_unit.device)[None, :, None]
        window, outside = (sequence[..., None], head[..., None], self.window_index[slots]), self.window_outside[slots]
        q_slots = q_unit[sequence, head, slots]                                      # (B, E, S, d)
        queries = self._scaled_queries(q_slots, heads, slots)
        local = (queries[..., None, :] * k_unit[window]).sum(-1) + self.relative_pos_bias_local[heads, None]
        local = local.masked_fill(outside, float("-inf"))                           # (B, E, S, L)
        pooled = queries @ k_pool.transpose(-2, -1) + bias[heads][head, slots]       # (B, E, S, P)
        weights = self.attn_drop(torch.cat([local, pooled], dim=-1).softmax(dim=-1))
        w_local, w_pool = weights.split([self.local_len, self.pool_len], dim=-1)
        w_local = w_local + q_slots @ self.learnable_tokens[heads] + self.learnable_bias[heads]
        v_window = v[window].masked_fill(outside[..., None], 0.0)                    # (B, E, S, L, d)
        out = (w_local[..., None, :] @ v_window).squeeze(-2) + w_pool @ v_pool
        out = out * gates[sequence, slots, head][..., None]
        return torch.where(real, sequence * length + slots, batch * length), out


def _gated(out: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
    """Head outputs (B, N, h, d) weighted by their gates (B, N, h)."""
    return out if gates is None else out * gates[..., None].to(out.dtype)


def _window(grid: int, window_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L) True where a token's window position falls outside the ``grid`` x ``grid`` map, and (N, L) the token at
    each window position (clamped onto the map outside it)."""
    r = window_size // 2
    pos = torch.arange(grid, device="cpu")
    offsets = torch.arange(window_size, device="cpu") - r
    rows = pos[:, None] + offsets[None]                                              # (G, w)
    valid_axis = (rows >= 0) & (rows < grid)
    valid = valid_axis[:, None, :, None] & valid_axis[None, :, None, :]              # (y, x, dy, dx)
    rows = rows.clamp(0, grid - 1)
    index = rows[:, None, :, None] * grid + rows[None, :, None, :]
    return ~valid.reshape(grid * grid, window_size * window_size), index.reshape(grid * grid, -1)


__all__ = ["AggregatedAttention", "ContinuousPositionBias", "TransNeXtAttention", "check_token_grid",
           "relative_position_table"]
