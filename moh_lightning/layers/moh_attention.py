"""Mixture-of-Head attention (MoH, Jin et al., ICML 2025, arXiv 2410.11842).

Attention heads are experts: per token, a router keeps ``num_shared_heads`` always-on shared heads and the
``top_k`` best of the remaining routed heads, and the heads' outputs are summed with the routing scores as
weights before the output projection (paper Eq. 4)::

    MoH(x) = sum_i g_i * H_i(x) @ W_O^i

``MoHAttention`` is a drop-in for ``timm.layers.Attention``: the attention weights carry timm's names and
shapes (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``), the routers live in ``router``, so a timm
state dict loads into it (routers freshly initialised) and ``dense=True`` computes exactly timm's output.
The block knows nothing of tasks: ViT, DiT and the decoder LM all use it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moh_lightning.layers.head_sparse_attention import head_sparse_attention, use_head_sparse

RouterType = Literal["learned", "query_norm"]
ExecutionMode = Literal["auto", "dense", "sparse"]


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


class RouterOutput:
    """Per-token head gates (B, N, h), zero where a head is off, and the layer's load-balance loss."""

    __slots__ = ("gates", "load_balance_loss")

    def __init__(self, gates: torch.Tensor, load_balance_loss: torch.Tensor | None) -> None:
        self.gates = gates
        self.load_balance_loss = load_balance_loss


def load_balance_loss(probs: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None,
                      top_k: int) -> torch.Tensor:
    """Paper Eq. 7 over the routed heads, scaled by E / k so that a perfectly balanced router gives 1.

    ``probs`` (T, E) are the routed-head softmax scores, ``selected`` (T, E) the top-k indicator and
    ``valid`` (T,) marks real (non-padding) tokens. f_i is the fraction of tokens selecting head i (it sums
    to k over heads), P_i the mean score; balanced routing has f_i = k / E and P_i = 1 / E. Under
    torch.distributed with several processes, f_i counts the tokens of every rank while P_i stays local.
    """
    num_routed = probs.shape[-1]
    weight = probs.new_ones(probs.shape[0], 1) if valid is None else valid.to(probs.dtype)[:, None]
    # Counts in float32: in bf16 a sum over more than 256 tokens would round.
    counts = torch.cat([(selected.float() * weight.float()).sum(0), weight.float().sum()[None]])  # (E + 1,)
    local_tokens = counts[-1].clamp_min(1.0).to(probs.dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        # f_i from global counts (no gradient flows through them) and P_i local: DDP averages the ranks'
        # gradients, and the mean over ranks of the per-rank losses is the 1-process loss over all ranks'
        # tokens when every rank holds the same number of tokens (the mean of the local P_i is then the
        # global P_i). Every rank reaches this call in the same order, as DDP's own all-reduces do.
        counts = counts.detach().clone()
        torch.distributed.all_reduce(counts)
    fraction = (counts[:-1] / counts[-1].clamp_min(1.0)).to(probs.dtype)
    mean_prob = (probs * weight).sum(0) / local_tokens
    return (fraction * mean_prob).sum() * (num_routed / top_k)


def _select_top_k(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Boolean (T, E) mask of each token's ``top_k`` highest-scoring routed heads."""
    indices = probs.topk(top_k, dim=-1).indices
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, indices, True)


class MoHRouter(nn.Module):
    """Two-stage MoH router (paper Eq. 5-6) with the authors' gate scaling.

    Shared gates are softmax(W_s x) * h_s, routed gates are softmax(W_r x) kept on the top-k, renormalised
    over them and multiplied by k; the two groups are weighted by 2 * alpha_1 and 2 * alpha_2 with
    [alpha_1, alpha_2] = softmax(W_h x). A uniform router therefore gives every active head gate 1, which is
    multi-head attention's plain sum. ``two_stage=False`` fixes alpha_1 = alpha_2 = 1/2 (the Tab. 6 ablation).
    """

    def __init__(self, dim: int, num_heads: int, num_shared_heads: int, top_k: int, two_stage: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.num_shared_heads = num_shared_heads
        self.num_routed_heads = num_heads - num_shared_heads
        self.top_k = top_k
        # A router over a single head would be a softmax over one logit: constant 1, so none is built.
        self.shared_router = nn.Linear(dim, num_shared_heads, bias=False, **dd) if num_shared_heads > 1 else None
        self.routed_router = nn.Linear(dim, self.num_routed_heads, bias=False, **dd) if self.num_routed_heads else None
        has_both = num_shared_heads > 0 and self.num_routed_heads > 0
        self.type_router = nn.Linear(dim, 2, bias=False, **dd) if two_stage and has_both else None

    def forward(self, x: torch.Tensor, q: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> RouterOutput:
        tokens = x.reshape(-1, x.shape[-1])                                           # (T, C)
        loss = shared = routed = None
        if self.num_shared_heads:
            if self.shared_router is not None:
                shared = self.shared_router(tokens).softmax(-1) * self.num_shared_heads
            else:
                shared = tokens.new_ones(tokens.shape[0], 1)
        if self.routed_router is not None:
            probs = self.routed_router(tokens).softmax(-1)                          # (T, E)
            selected = _select_top_k(probs, self.top_k)
            kept = probs * selected
            routed = kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).eps) * self.top_k
            if self.training and self.top_k < self.num_routed_heads:
                loss = load_balance_loss(probs, selected, valid, self.top_k)
        if self.type_router is not None:
            alpha = self.type_router(tokens).softmax(-1) * 2
            shared, routed = shared * alpha[:, :1], routed * alpha[:, 1:]
        groups = [g for g in (shared, routed) if g is not None]
        gates = torch.cat(groups, dim=-1).reshape(*x.shape[:-1], self.num_heads)
        return RouterOutput(gates, loss)


class _StraightThrough(torch.autograd.Function):
    """Forward: the {0, 1} selection; backward: the gradient of the real-valued score (paper Eq. 9-10)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        return selected.to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class QueryNormRouter(nn.Module):
    """Parameter-free router for continue-tuning a pretrained model into MoH (paper section 4.4).

    Each routed head is scored by the l2 norm of its query, divided by the standard deviation of those norms
    across the routed heads (as the authors' MoH-LLaMA3 code does); the top-k get gate 1, the others 0, and
    shared heads always 1, so with every head active the layer is exactly the pretrained one. The quantised
    gates pass the scores' gradient straight through.
    """

    def __init__(self, num_heads: int, num_shared_heads: int, top_k: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_shared_heads = num_shared_heads
        self.num_routed_heads = num_heads - num_shared_heads
        self.top_k = top_k

    def forward(self, x: torch.Tensor, q: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> RouterOutput:
        if q is None:
            raise ValueError("QueryNormRouter scores heads by their queries: pass q (B, h, N, d).")
        batch, _, length, _ = q.shape
        shared = q.new_ones(batch * length, self.num_shared_heads)
        if not self.num_routed_heads:
            return RouterOutput(shared.reshape(batch, length, self.num_heads), None)
        norms = q[:, self.num_shared_heads:].float().norm(dim=-1)                  # (B, E, N)
        norms = norms.permute(0, 2, 1).reshape(batch * length, self.num_routed_heads)
        logits = norms / norms.std(-1, keepdim=True).clamp_min(1e-6)
        probs = logits.softmax(-1)
        selected = _select_top_k(probs, self.top_k)
        routed = _StraightThrough.apply(probs, selected).to(q.dtype)
        loss = None
        if self.training and self.top_k < self.num_routed_heads:
            loss = load_balance_loss(probs, selected, valid, self.top_k)
        gates = torch.cat([shared, routed], dim=-1).reshape(batch, length, self.num_heads)
        return RouterOutput(gates, loss)


class MoHAttention(nn.Module):
    """Multi-head self-attention whose heads are experts picked per token by a router.

    Args:
        dim: Token width.
        num_heads: Total heads h (shared + routed).
        attn_head_dim: Width of one head; ``dim // num_heads`` when None (timm's name for it).
        num_shared_heads: Heads 0..h_s-1, always active.
        top_k: Routed heads active per token, out of the ``num_heads - num_shared_heads`` routed ones.
        dense: Plain multi-head attention with the same attention weights and no router (the baseline).
        two_stage_routing: Learn the shared / routed balance alpha (Eq. 6); False fixes it at 1/2 each.
        router: ``"learned"`` (Eq. 5-6) or ``"query_norm"`` (parameter-free, for continue-tuning).
        num_kv_heads: Key/value heads for grouped-query attention; ``num_heads`` when None.
        causal: Each token attends only to itself and earlier tokens.
        execution: ``"dense"`` computes every head and weights it by its gate, ``"sparse"`` only the
            selected (token, head) pairs, ``"auto"`` picks from the shapes.

    The other arguments are timm's ``Attention`` arguments with the same meaning. After a forward,
    ``last_gates`` holds that forward's gates (B, N, h), detached, zero where a head was not selected, and in
    training ``load_balance_loss`` the layer's Eq. 7 loss (read it with ``pop_load_balance_loss``).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            attn_head_dim: int | None = None,
            dim_out: int | None = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.0,
            proj_drop: float = 0.0,
            norm_layer: Callable[..., nn.Module] | None = None,
            *,
            num_shared_heads: int = 0,
            top_k: int | None = None,
            dense: bool = False,
            two_stage_routing: bool = True,
            router: RouterType = "learned",
            num_kv_heads: int | None = None,
            causal: bool = False,
            execution: ExecutionMode = "auto",
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        head_dim = attn_head_dim
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}: set attn_head_dim.")
            head_dim = dim // num_heads
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}.")
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("qk_norm / scale_norm need a norm_layer.")
        if execution not in ("auto", "dense", "sparse"):
            raise ValueError(f"execution={execution!r}: choose 'auto', 'dense' or 'sparse'.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim ** -0.5
        self.fused_attn = True  # timm reads this flag; SDPA is always used here.
        self.causal = causal
        self.execution = execution

        self.qkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

        self.router: MoHRouter | QueryNormRouter | None = None
        if not dense:
            top_k = check_head_budget(num_heads, num_shared_heads, top_k)
            if router == "learned":
                self.router = MoHRouter(dim, num_heads, num_shared_heads, top_k, two_stage_routing, **dd)
            elif router == "query_norm":
                self.router = QueryNormRouter(num_heads, num_shared_heads, top_k)
            else:
                raise ValueError(f"router={router!r}: choose 'learned' or 'query_norm'.")
        self.last_gates: torch.Tensor | None = None
        self.load_balance_loss: torch.Tensor | None = None

    @property
    def is_moh(self) -> bool:
        return self.router is not None

    @property
    def active_heads(self) -> int:
        """Heads each token uses: h_s + k, or h for the dense layer."""
        if self.router is None:
            return self.num_heads
        return self.router.num_shared_heads + (self.router.top_k if self.router.num_routed_heads else 0)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: torch.Tensor | None = None,
            is_causal: bool = False,
            padding_mask: torch.Tensor | None = None,
            position_embedding: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
            kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` (B, N, C).

        ``padding_mask`` (B, N) is True for real tokens: padded tokens are neither attended to nor routed,
        and do not count in the load-balance statistics. ``position_embedding(q, k)`` rotates queries and
        keys (RoPE) after q/k norm. ``kv_cache`` appends this call's keys and values and attends over all of
        them (causal decoding with a cache). ``attn_mask`` and ``is_causal`` are timm's arguments.
        """
        batch, length, _ = x.shape
        if padding_mask is not None and kv_cache is not None:
            raise ValueError("padding_mask with kv_cache is not supported: decode unpadded sequences.")
        qkv = self.qkv(x).reshape(batch, length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.transpose(1, 2).split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = self.q_norm(q), self.k_norm(k)                                         # (B, h, N, d)

        gates = None
        if self.router is not None:
            routing = self.router(x, q=q, valid=None if padding_mask is None else padding_mask.reshape(-1))
            gates = routing.gates
            if padding_mask is not None:
                gates = gates * padding_mask[..., None].to(gates.dtype)
            self.last_gates = gates.detach()
            self.load_balance_loss = routing.load_balance_loss

        if position_embedding is not None:
            q, k = position_embedding(q, k)
        offset = 0
        if kv_cache is not None:
            offset = kv_cache.length
            k, v = kv_cache.update(k, v)

        causal = self.causal or is_causal
        dropout_p = self.attn_drop.p if self.training else 0.0
        if gates is not None and self._head_sparse(gates, length, k.shape[2], kv_cache is not None):
            out = head_sparse_attention(q, k, v, gates.to(q.dtype), self.router.num_shared_heads, causal=causal,
                                        offset=offset, key_padding_mask=padding_mask, attn_mask=attn_mask,
                                        dropout_p=dropout_p)                           # (B, N, h, d)
        else:
            mask = _attention_mask(attn_mask, padding_mask, causal, length, k.shape[2], offset, x.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None and offset == 0,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )                                                                          # (B, h, N, d)
            out = out.transpose(1, 2)                                                  # (B, N, h, d)
            if gates is not None:
                out = out * gates[..., None].to(out.dtype)
        out = self.norm(out.reshape(batch, length, self.attn_dim))
        return self.proj_drop(self.proj(out))

    def _head_sparse(self, gates: torch.Tensor, num_queries: int, num_keys: int, decoding: bool) -> bool:
        """Whether this forward computes only the selected (token, head) pairs (``execution``, else the shapes)."""
        # The straight-through router passes a gradient to unselected heads' gates, which needs their outputs.
        if isinstance(self.router, QueryNormRouter) and gates.requires_grad:
            if self.execution == "sparse":
                raise ValueError("execution='sparse' cannot train the query_norm router: its straight-through "
                                 "gradient needs every head's output. Use execution='auto' or 'dense'.")
            return False
        return use_head_sparse(self.execution, num_queries, num_keys, self.active_heads / self.num_heads, decoding)


def _attention_mask(attn_mask: torch.Tensor | None, padding_mask: torch.Tensor | None, causal: bool,
                    num_queries: int, num_keys: int, offset: int, device) -> torch.Tensor | None:
    """One boolean / additive mask for SDPA from timm's mask, key padding and causality.

    Returns None when SDPA's own ``is_causal`` (queries and keys aligned) or no mask at all is enough.
    """
    needs_explicit_causal = causal and (padding_mask is not None or attn_mask is not None or offset > 0
                                        or num_queries != num_keys)
    if padding_mask is None and not needs_explicit_causal:
        return attn_mask
    allowed = torch.ones(1, 1, num_queries, num_keys, dtype=torch.bool, device=device)
    if padding_mask is not None:
        allowed = allowed & padding_mask[:, None, None, :num_keys].bool()
    if needs_explicit_causal:
        query_pos = torch.arange(num_queries, device=device)[:, None] + offset
        allowed = allowed & (torch.arange(num_keys, device=device)[None, :] <= query_pos)
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return allowed & attn_mask
    return attn_mask.masked_fill(~allowed, float("-inf"))


def check_head_budget(num_heads: int, num_shared_heads: int, top_k: int | None, where: str = "") -> int:
    """Validates one layer's head budget and returns its top-k; errors name the offending key."""
    at = f" ({where})" if where else ""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads}{at} must be at least 1.")
    if not 0 <= num_shared_heads <= num_heads:
        raise ValueError(f"num_shared_heads={num_shared_heads}{at} must be between 0 and num_heads={num_heads}.")
    num_routed = num_heads - num_shared_heads
    if top_k is None:
        top_k = num_routed
    if num_routed and not 1 <= top_k <= num_routed:
        raise ValueError(f"top_k={top_k}{at} must be between 1 and the {num_routed} routed heads "
                         f"(num_heads={num_heads} - num_shared_heads={num_shared_heads}).")
    if not num_routed and top_k:
        raise ValueError(f"top_k={top_k}{at}: every head is shared (num_shared_heads={num_shared_heads}), "
                         f"so set top_k: 0 or fewer shared heads.")
    return top_k


def layerwise(num_shared_heads: Sequence[int], top_k: Sequence[int], **kwargs) -> type[MoHAttention]:
    """A ``MoHAttention`` class whose successive instances take successive per-layer head budgets.

    timm builds its blocks in depth order through the ``attn_layer`` hook and requires a class there, so the
    per-layer budgets of the paper's configurations (e.g. fewer active heads in shallow layers) ride on the
    class. ``kwargs`` are shared by every layer. Building more layers than budgets is an error.
    """
    if len(num_shared_heads) != len(top_k):
        raise ValueError(f"num_shared_heads has {len(num_shared_heads)} entries but top_k has {len(top_k)}: "
                         f"give one budget per layer in both.")
    budgets = list(zip(num_shared_heads, top_k))
    counter = {"built": 0}

    class LayerwiseMoHAttention(MoHAttention):
        def __init__(self, dim: int, num_heads: int = 8, **layer_kwargs) -> None:
            index = counter["built"]
            if index >= len(budgets):
                raise ValueError(f"{len(budgets)} per-layer head budgets given but layer {index} was built: "
                                 f"give one entry per layer in num_shared_heads and top_k.")
            shared, k = budgets[index]
            if not kwargs.get("dense", False):
                check_head_budget(num_heads, shared, k, where=f"layer {index}")
            counter["built"] += 1
            super().__init__(dim, num_heads, **{**kwargs, **layer_kwargs, "num_shared_heads": shared, "top_k": k})

    LayerwiseMoHAttention.num_budgets = len(budgets)
    LayerwiseMoHAttention.built = staticmethod(lambda: counter["built"])
    return LayerwiseMoHAttention


def moh_layers(model: nn.Module) -> list[MoHAttention]:
    """Every routed ``MoHAttention`` in ``model``, in module order (dense layers excluded)."""
    return [m for m in model.modules() if isinstance(m, MoHAttention) and m.is_moh]


def pop_load_balance_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean of the MoH layers' load-balance losses from the last training forward, cleared once read.

    Clearing releases the routers' graph with the step, so nothing outlives it. None when no layer has one.
    """
    losses = []
    for layer in moh_layers(model):
        if layer.load_balance_loss is not None:
            losses.append(layer.load_balance_loss)
            layer.load_balance_loss = None
    if not losses:
        return None
    return torch.stack(losses).mean()


def activated_head_fraction(model: nn.Module) -> float:
    """Share of all attention heads each token uses, over every ``MoHAttention`` layer (dense ones at 100%)."""
    layers = [m for m in model.modules() if isinstance(m, MoHAttention)]
    total = sum(m.num_heads for m in layers)
    return sum(m.active_heads for m in layers) / total if total else 1.0


__all__ = [
    "KVCache", "MoHAttention", "MoHRouter", "QueryNormRouter", "RouterOutput", "activated_head_fraction",
    "check_head_budget", "layerwise", "load_balance_loss", "moh_layers", "pop_load_balance_loss",
]
