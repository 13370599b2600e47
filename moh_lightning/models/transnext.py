"""TransNeXt (Shi, CVPR 2024) with Mixture-of-Head attention: the paper's MoH-ViT (section 4.1, Tab. 1).

The network is TransNeXt in native PyTorch: an overlapping patch embedding, four stages that halve the grid and
widen the tokens, and in each block a token mixer and a convolutional GLU. Stages whose ``sr_ratio`` is above 1 mix
with *aggregated attention* (pixel-focused attention): each query attends, under one softmax, to the keys of its own
``window_size`` x ``window_size`` neighbourhood and to keys pooled from the whole feature map. Queries and keys are
l2-normalised (cosine similarity) and scaled by a learnable per-head temperature and by the log of the number of keys
a query sees; a learnable query embedding is added to the queries, a continuous relative position bias (a small MLP
on log-spaced offsets) to the pooled similarities, and learnable tokens give the local window a query-dependent bias
on the values. The last stage (``sr_ratio`` 1) attends to every token with the same cosine similarity and bias.

MoH enters both token mixers the same way it enters every model of the suite: the attention layers *are*
``MoHAttention`` (same ``qkv`` / ``proj`` / ``router`` modules, same gates from ``MoHRouter``), with TransNeXt's
similarity in place of the dot product. Each head's output is multiplied by its gate before the output projection,
so ``moh_layers``, the load-balance loss and the head-load dashboards see TransNeXt's layers unchanged. Head budgets
are given per stage (the authors' ``shared_head`` / ``routed_head`` lists are ``num_shared_heads`` / ``top_k``) or per
block. The named models (``moh_transnext_small_75`` ...) are registered with timm on ``import moh_lightning``, with
timm's backbone interface (``features_only``, ``forward_intermediates``, FX feature extraction, ``torch.export``). They
are not TorchScript: their attention is ``MoHAttention``'s (see ``tests/test_timm_contract.py``).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, register_notrace_function, trunc_normal_
from timm.models import build_model_with_cfg, register_model
from timm.models._features import feature_take_indices
from timm.models._registry import generate_default_cfgs
from torch import nn

from moh_lightning.layers import MoHAttention
from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers
from moh_lightning.serialization import checkpoint_type, read_weights_file

NUM_STAGES = 4


@checkpoint_type
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
        self.moh = as_moh_config(self.moh)
        if isinstance(self.img_size, (tuple, list)):  # timm passes (H, W)
            if len(set(self.img_size)) != 1:
                raise ValueError(f"img_size={self.img_size}: TransNeXt is built for square inputs.")
            self.img_size = int(self.img_size[0])
        if self.window_size < 1 or self.window_size % 2 == 0:
            raise ValueError(f"window_size={self.window_size} must be odd.")
        if self.global_pool not in ("avg", ""):
            raise ValueError(f"global_pool={self.global_pool!r}: choose 'avg' or '' (no pooling).")
        for dim, heads in zip(self.stage("embed_dim"), self.stage("num_heads")):
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
        return _stage_grids(self.img_size, self.patch_size)

    @property
    def layer_heads(self) -> list[int]:
        return [heads for heads, depth in zip(self.stage("num_heads"), self.stage("depth")) for _ in range(depth)]

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
        return [v for v, depth in zip(value, depths) for _ in range(depth)]
    if len(value) == sum(depths):
        return value
    raise ValueError(f"arch.moh.{key} has {len(value)} entries: give one per stage ({len(depths)}), one per block "
                     f"({sum(depths)}) or a single int.")


def _stage_grids(img_size: int, patch_size: int) -> list[int]:
    # The stem (kernel 2p - 1, stride p, padding p - 1) gives ceil(size / p); each later stage (3, 2, 1) halves, up.
    grids = [math.ceil(img_size / patch_size)]
    for _ in range(NUM_STAGES - 1):
        grids.append(math.ceil(grids[-1] / 2))
    return grids


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
    """Pre-norm residual block: token mixer (aggregated or full MoH attention), then convolutional GLU."""

    def __init__(self, attn: TransNeXtAttention, dim: int, mlp_ratio: float, drop: float, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ConvolutionalGLU(dim, int(dim * mlp_ratio), drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

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
        x = x.flatten(2).transpose(1, 2)                                             # (B, N, C)
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
        pretrain_grids = _stage_grids(arch.pretrain_size or arch.img_size, arch.patch_size)
        layers = attention_layers(arch.layer_moh, arch.layer_heads, sum(depths))
        total = sum(depths)
        drop_path = [arch.drop_path_rate * i / max(total - 1, 1) for i in range(total)]  # linear from 0
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


# ---------------------------------------------------------------------------------------------------------------------
# Weights in the authors' layout (SkyworkAI/MoH MoH-ViT and DaiShiResearch/TransNeXt checkpoints).
#
# Their modules are named per stage (patch_embed1, block1.0, norm1, ...); the aggregated attention has separate q and
# kv projections (ours: one qkv, the same rows in the same order), its MLP bias is cpb_fc1 / cpb_fc2, its pooled-token
# norm is attn.norm (ours: pool_norm, as attn.norm is MoHAttention's), the GLU's depthwise convolution sits one level
# deeper (mlp.dwconv.dwconv), and the routers are wg (routed heads), wg_0 (shared / routed balance) and wg_1 (shared
# heads). Their geometry buffers are not saved; ours are recomputed.
_AUTHORS_STAGE = re.compile(r"^(patch_embed|block|norm)([1-4])\.(.*)$")
_AUTHORS_ATTENTION = {"wg.": "router.routed_router.", "wg_0.": "router.type_router.",
                      "wg_1.": "router.shared_router.", "cpb_fc1.": "cpb.fc1.", "cpb_fc2.": "cpb.fc2.",
                      "norm.": "pool_norm."}
_GEOMETRY_BUFFERS = ("relative_pos_index", "relative_coords_table", "seq_length_scale", "padding_mask")


def is_authors_layout(state_dict: dict) -> bool:
    """Whether the names are the authors' (``block1.0.attn...``) rather than ours (``stages.0.blocks.0.attn...``)."""
    return any(_AUTHORS_STAGE.match(key) for key in state_dict)


def from_authors_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A (MoH-)TransNeXt state dict under the authors' names -> the same tensors under this module's names.

    Names it does not know are kept as they are, so that loading reports them as unexpected.
    """
    out, q_parts = {}, {}
    for key, tensor in state_dict.items():
        if key.split(".")[-1].rstrip("1234") in _GEOMETRY_BUFFERS:
            continue
        match = _AUTHORS_STAGE.match(key)
        if match is None:
            out[key] = tensor
            continue
        kind, stage, rest = match.group(1), int(match.group(2)) - 1, match.group(3)
        if kind == "patch_embed":
            out[("patch_embed." if stage == 0 else f"stages.{stage}.downsample.") + rest] = tensor
        elif kind == "norm":
            out[f"stages.{stage}.norm.{rest}"] = tensor
        else:
            block, _, name = rest.partition(".")
            prefix = f"stages.{stage}.blocks.{block}."
            if name.startswith("mlp.dwconv.dwconv."):
                name = "mlp.dwconv." + name.removeprefix("mlp.dwconv.dwconv.")
            elif name.startswith("attn."):
                attn = name.removeprefix("attn.")
                if attn.startswith(("q.", "kv.")):  # joined into qkv below
                    q_parts[(prefix, attn)] = tensor
                    continue
                for theirs, ours in _AUTHORS_ATTENTION.items():
                    if attn.startswith(theirs):
                        attn = ours + attn.removeprefix(theirs)
                        break
                name = "attn." + attn
            out[prefix + name] = tensor
    for (prefix, attn), tensor in q_parts.items():
        if not attn.startswith("q."):
            continue
        suffix = attn.removeprefix("q.")
        kv = q_parts.get((prefix, "kv." + suffix))
        if kv is None:
            out[f"{prefix}attn.q.{suffix}"] = tensor  # incomplete: reported as unexpected on load
            continue
        out[f"{prefix}attn.qkv.{suffix}"] = torch.cat([tensor, kv])
    for (prefix, attn), tensor in q_parts.items():
        if attn.startswith("kv.") and (prefix, "q." + attn.removeprefix("kv.")) not in q_parts:
            out[f"{prefix}attn.{attn}"] = tensor
    return out


def checkpoint_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The network's weights, under our names, from what a checkpoint file holds.

    Accepts a bare state dict (ours, a timm export, or the authors'), the authors' training checkpoint
    (``{"model": ...}``, their released files) and a ``moh fit`` checkpoint (``{"state_dict": {"model.<name>": ...}}``).
    """
    if isinstance(checkpoint.get("model"), dict):
        checkpoint = checkpoint["model"]
    elif isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = {key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items()}
    checkpoint = {key.removeprefix("module."): value for key, value in checkpoint.items()}  # saved under DDP
    return from_authors_state_dict(checkpoint) if is_authors_layout(checkpoint) else checkpoint


WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def weights_file(source: str | Path) -> Path:
    """A local checkpoint file for ``source``: a file path, or a hub repo id holding one weights file
    (``Chat-UniVi/MoH-ViT-S-75``) or a repo id and the file in it (``owner/name/file.pth``), through
    ``huggingface_hub`` (its cache first)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    source = str(source)
    if path.exists() or source.count("/") < 1 or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{source}: no such checkpoint file ({', '.join(WEIGHT_SUFFIXES)}), and not a hub "
                                f"repo id (owner/name).")
    import huggingface_hub

    parts = source.split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    unreachable = f"cannot fetch {source} from the Hugging Face hub; download the checkpoint file and give its path"
    if not filename:
        try:
            files = [f for f in huggingface_hub.list_repo_files(repo_id) if f.endswith(WEIGHT_SUFFIXES)]
        except Exception as error:  # offline, unknown repository, no access: one line says what to do
            raise FileNotFoundError(f"{unreachable} ({type(error).__name__}).") from None
        if len(files) != 1:
            raise FileNotFoundError(f"{repo_id} holds {len(files)} weight files ({', '.join(files) or 'none'}): "
                                    f"name one as {repo_id}/<file>.")
        filename = files[0]
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, filename))
    except Exception as error:
        raise FileNotFoundError(f"{unreachable} ({type(error).__name__}).") from None


def load_pretrained(model: TransNeXt, source: str | Path) -> None:
    """Loads weights (ours, a timm export or the authors') into ``model``; every tensor must match, none be left."""
    state = checkpoint_state_dict(read_weights_file(weights_file(source)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{source} does not fit this TransNeXt: {len(missing)} missing weights "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}), {len(unexpected)} "
                         f"unexpected ({', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''}). "
                         f"Check that the config names the same model (sizes and head budgets).")


# ---------------------------------------------------------------------------------------------------------------------
# Named models, registered with timm. The MoH budgets are the authors' (SkyworkAI/MoH, MoH-ViT/transnext.py): every
# head shared in the first two stages, shared heads plus top-k routed ones in the last two; the dense baselines are
# TransNeXt's own sizes. Each name maps to the config fields that differ from TransNeXtConfig's defaults.
_SMALL = {}
_BASE = {"embed_dim": [96, 192, 384, 768], "depth": [5, 5, 23, 5], "num_heads": [4, 8, 16, 32], "drop_path_rate": 0.6}
_MICRO = {"embed_dim": [48, 96, 192, 384], "depth": [2, 2, 15, 2], "num_heads": [2, 4, 8, 16], "drop_path_rate": 0.15}


def _moh(shared: list[int], top_k: list[int]) -> dict:
    return {"moh": {"num_shared_heads": shared, "top_k": top_k}}


NAMED_MODELS: dict[str, dict] = {
    "transnext_small": _SMALL,
    "transnext_base": _BASE,
    "transnext_micro": _MICRO,
    "moh_transnext_small_80": {**_SMALL, **_moh([3, 6, 3, 8], [0, 0, 6, 12])},
    "moh_transnext_small_75": {**_SMALL, **_moh([3, 6, 3, 4], [0, 0, 6, 12])},
    "moh_transnext_base_75": {**_BASE, **_moh([4, 8, 4, 5], [0, 0, 8, 16])},
    "moh_transnext_base_50": {**_BASE, **_moh([2, 2, 2, 4], [2, 4, 6, 8])},
    # Not a model of the paper: TransNeXt-Micro's sizes at about 75% of the heads, small enough for a CPU.
    "moh_transnext_micro_75": {**_MICRO, **_moh([2, 4, 2, 3], [0, 0, 4, 8])},
}

# Where the authors published weights (their layout: load them with moh_lightning.tools.authors_models).
AUTHORS_HUB_IDS = {
    "moh_transnext_small_80": "Chat-UniVi/MoH-ViT-S-80",
    "moh_transnext_small_75": "Chat-UniVi/MoH-ViT-S-75",
    "moh_transnext_base_75": "Chat-UniVi/MoH-ViT-B-75",
    "moh_transnext_base_50": "Chat-UniVi/MoH-ViT-B-50",
    "transnext_small": "DaiShiResearch/transnext-small-224-1k",
    "transnext_base": "DaiShiResearch/transnext-base-224-1k",
    "transnext_micro": "DaiShiResearch/transnext-micro-224-1k",
}


def transnext_config(name: str, **overrides: Any) -> TransNeXtConfig:
    """The config of a named model, with ``overrides`` (e.g. ``num_classes``) on top."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown TransNeXt model {name!r}: choose one of {', '.join(NAMED_MODELS)}.")
    return TransNeXtConfig(**{**NAMED_MODELS[name], **overrides})


def config_arguments(arch: TransNeXtConfig, name: str) -> dict:
    """The fields of ``arch`` that differ from the named model's: what rebuilds ``arch`` from ``name``."""
    base, ours = asdict(transnext_config(name)), asdict(arch)
    return {key: value for key, value in ours.items() if value != base[key]}


def _cfg(name: str) -> dict:
    origin = AUTHORS_HUB_IDS.get(name)
    return {
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7), "crop_pct": 0.875,
        "interpolation": "bicubic", "fixed_input_size": True, "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD, "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        "paper_ids": "arXiv:2410.11842" if name.startswith("moh") else "arXiv:2311.17132",
        "origin_url": f"https://huggingface.co/{origin}" if origin else None,
    }


default_cfgs = generate_default_cfgs({name: _cfg(name) for name in NAMED_MODELS})


def _filter_state_dict(state_dict: dict, model: TransNeXt) -> dict:
    """timm's hook on pretrained weights: a suite / timm-export file as it is, an authors' checkpoint converted."""
    return checkpoint_state_dict(state_dict)


def _create(name: str, pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    def build(**fields: Any) -> TransNeXt:
        return TransNeXt(transnext_config(name, **fields))

    # features_only takes the four stages' maps through forward_intermediates, the stages after the last one dropped.
    out_indices = kwargs.pop("out_indices", tuple(range(NUM_STAGES)))
    return build_model_with_cfg(build, name, pretrained, pretrained_filter_fn=_filter_state_dict,
                                feature_cfg={"out_indices": out_indices, "feature_cls": "getter"}, **kwargs)


@register_model
def transnext_small(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """TransNeXt-S (dense multi-head attention), 49.7M parameters."""
    return _create("transnext_small", pretrained, **kwargs)


@register_model
def transnext_base(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """TransNeXt-B (dense multi-head attention), 89.7M parameters."""
    return _create("transnext_base", pretrained, **kwargs)


@register_model
def transnext_micro(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """TransNeXt-Micro (dense multi-head attention), 12.8M parameters."""
    return _create("transnext_micro", pretrained, **kwargs)


@register_model
def moh_transnext_small_80(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """MoH-ViT-S at 80% heads (paper Tab. 1): TransNeXt-S, heads shared [3, 6, 3, 8] + top-k [0, 0, 6, 12]."""
    return _create("moh_transnext_small_80", pretrained, **kwargs)


@register_model
def moh_transnext_small_75(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """MoH-ViT-S at 75% heads (paper Tab. 1): TransNeXt-S, heads shared [3, 6, 3, 4] + top-k [0, 0, 6, 12]."""
    return _create("moh_transnext_small_75", pretrained, **kwargs)


@register_model
def moh_transnext_base_75(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """MoH-ViT-B at 75% heads (paper Tab. 1): TransNeXt-B, heads shared [4, 8, 4, 5] + top-k [0, 0, 8, 16]."""
    return _create("moh_transnext_base_75", pretrained, **kwargs)


@register_model
def moh_transnext_base_50(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """MoH-ViT-B at 50% heads (paper Tab. 1): TransNeXt-B, heads shared [2, 2, 2, 4] + top-k [2, 4, 6, 8]."""
    return _create("moh_transnext_base_50", pretrained, **kwargs)


@register_model
def moh_transnext_micro_75(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """TransNeXt-Micro at 75.6% heads (not in the paper; CPU-sized): shared [2, 4, 2, 3] + top-k [0, 0, 4, 8]."""
    return _create("moh_transnext_micro_75", pretrained, **kwargs)


__all__ = [
    "AUTHORS_HUB_IDS", "AggregatedAttention", "ContinuousPositionBias", "ConvolutionalGLU", "NAMED_MODELS",
    "OverlapPatchEmbed", "TransNeXt", "TransNeXtAttention", "TransNeXtBlock", "TransNeXtConfig", "TransNeXtStage",
    "checkpoint_state_dict", "config_arguments", "create_transnext", "from_authors_state_dict", "is_authors_layout",
    "load_pretrained", "relative_position_table", "transnext_config", "weights_file",
]
