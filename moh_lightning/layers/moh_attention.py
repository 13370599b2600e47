"""Mixture-of-Head attention (MoH, Jin et al., ICML 2025, arXiv 2410.11842).

Attention heads are experts: per token, a router keeps ``num_shared_heads`` always-on shared heads and the
``top_k`` best of the remaining routed heads, and the heads' outputs are summed with the routing scores as
weights before the output projection (paper Eq. 4)::

    MoH(x) = sum_i g_i * H_i(x) @ W_O^i

``MoHAttention`` is a drop-in for ``timm.layers.Attention``: the attention weights carry timm's names and
shapes (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``), the routers live in ``router``, so a timm
state dict loads into it (routers freshly initialised) and ``dense=True`` computes exactly timm's output.
The block knows nothing of tasks: ViT, DiT and the decoder LM all use it. Its routers, head budgets and
KV cache live beside it in ``routers.py``, ``budgets.py`` and ``kv_cache.py``; this file holds the block and
the helpers that walk a model's blocks.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moh_lightning.layers.budgets import check_head_budget
from moh_lightning.layers.execution import ExecutionMode, execution_mode, runs_head_sparse
from moh_lightning.layers.execution import attend as attend_heads
from moh_lightning.layers.kv_cache import KVCache
from moh_lightning.layers.routers import MoHRouter, QueryNormRouter, RouterDtype, RouterType


class MoHHeads(nn.Module):
    """The routing half of a MoH layer: its router, the gates of the last forward, and the gated attention core.

    ``MoHAttention`` adds its projections; ``models.hf_causal`` attaches one, without projections, to each attention
    layer of a ``transformers`` model. The callbacks and ``moh_layers`` find MoH layers by this class. A subclass sets
    ``router`` (None: a dense layer), ``num_heads``, ``causal`` and ``execution``.
    """

    router: MoHRouter | QueryNormRouter | None
    num_heads: int
    causal: bool
    execution: ExecutionMode

    def __init__(self) -> None:
        super().__init__()
        self.last_gates: torch.Tensor | None = None
        self.load_balance_loss: torch.Tensor | None = None

    @property
    def is_moh(self) -> bool:
        return self.router is not None

    @property
    def num_shared_heads(self) -> int:
        return 0 if self.router is None else self.router.num_shared_heads

    @property
    def active_heads(self) -> int:
        """Heads each token uses: h_s + k, or h for the dense layer."""
        if self.router is None:
            return self.num_heads
        return self.router.num_shared_heads + (self.router.top_k if self.router.num_routed_heads else 0)

    def sequence_length(self, args: tuple) -> int:
        """The number of tokens of a forward called with ``args`` (the throughput monitor's hook reads it)."""
        return args[0].shape[1]

    def route(self, x: torch.Tensor | None, q: torch.Tensor, padding_mask: torch.Tensor | None = None
              ) -> torch.Tensor | None:
        """Gates (B, N, h) of tokens ``x`` (B, N, C) with queries ``q`` (B, h, N, d), zero where a head is not used
        and on padded tokens; None for the dense layer. Kept in ``last_gates`` and ``load_balance_loss``."""
        if self.router is None:
            return None
        routing = self.router(x, q=q, valid=None if padding_mask is None else padding_mask.reshape(-1))
        gates = routing.gates
        if padding_mask is not None:
            gates = gates * padding_mask[..., None].to(gates.dtype)
        # Under an FX trace the tensors are proxies of one static graph: no layer state may keep them.
        if not isinstance(q, torch.fx.Proxy):
            self.last_gates = gates.detach()
            self.load_balance_loss = routing.load_balance_loss
        return gates

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None, *,
               causal: bool = False, offset: int = 0, padding_mask: torch.Tensor | None = None,
               attn_mask: torch.Tensor | None = None, decoding: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
        """Gated head outputs (B, N, h, d) of ``q`` (B, h, N, d) over ``k, v`` (B, h_kv, M, d), on the execution
        path ``execution`` and the shapes pick; arguments as ``layers.execution.attend``'s, ``decoding`` when the
        keys come from a KV cache."""
        # A traced graph computes every head and masks: head-sparse packing follows the gates' values, which a trace
        # does not have.
        head_sparse = (gates is not None and not isinstance(q, torch.fx.Proxy)
                       and self._head_sparse(gates, q.shape[2], k.shape[2], decoding, causal))
        return attend_heads(q, k, v, gates, head_sparse=head_sparse, num_shared_heads=self.num_shared_heads,
                            active_heads=self.active_heads, causal=causal, offset=offset, padding_mask=padding_mask,
                            attn_mask=attn_mask, dropout_p=dropout_p)

    def _head_sparse(self, gates: torch.Tensor, num_queries: int, num_keys: int, decoding: bool,
                    causal: bool) -> bool:
        """Whether this forward computes only the selected (token, head) pairs (``execution``, else the shapes)."""
        # The straight-through router passes a gradient to unselected heads' gates, which needs their outputs.
        if isinstance(self.router, QueryNormRouter) and gates.requires_grad:
            if self.execution == "sparse":
                raise ValueError("execution='sparse' cannot train the query_norm router: its straight-through "
                                 "gradient needs every head's output. Use execution='auto' or 'masked'.")
            return False
        return runs_head_sparse(self.execution, gates.device.type, num_queries, num_keys,
                                self.active_heads / self.num_heads, decoding, causal)


class MoHAttention(MoHHeads):
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
        router_dtype: Precision of the query-norm router's scores: ``"float32"``, or ``"activation"`` (the
            queries' dtype, as the authors' MoH-LLaMA3 code; see ``QueryNormRouter``). The learned router is a
            linear layer and runs in the activations' dtype, as the authors' ViT and DiT code.
        num_kv_heads: Key/value heads for grouped-query attention; ``num_heads`` when None.
        causal: Each token attends only to itself and earlier tokens.
        execution: ``"masked"`` computes every head and weights it by its gate, ``"sparse"`` only the
            selected (token, head) pairs, ``"auto"`` picks from the shapes.

    ``forward`` runs three steps a subclass with another attention core reuses or overrides: ``route`` (the gates),
    ``attend`` (the gated head outputs, on the execution path) and ``merge`` (heads concatenated and projected).

    The other arguments are timm's ``Attention`` arguments with the same meaning. After a forward,
    ``last_gates`` holds that forward's gates (B, N, h), detached, zero where a head was not selected, and in
    training ``load_balance_loss`` the layer's Eq. 7 loss (read it with ``pop_load_balance_loss``). A graph traced with
    FX (timm's ``feature_cls='fx'``, ``create_feature_extractor``) runs the routers as leaves and computes every head
    and masks; it sets neither attribute, so training through it has no load-balance loss.
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
            router_dtype: RouterDtype = "float32",
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
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim ** -0.5
        self.fused_attn = True  # timm reads this flag; SDPA is always used here.
        self.causal = causal
        self.execution = execution_mode(execution)

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
                self.router = QueryNormRouter(num_heads, num_shared_heads, top_k, router_dtype)
            else:
                raise ValueError(f"router={router!r}: choose 'learned' or 'query_norm'.")

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
        gates = self.route(x, q, padding_mask)
        if position_embedding is not None:
            q, k = position_embedding(q, k)
        offset = 0
        if kv_cache is not None:
            offset = kv_cache.length
            k, v = kv_cache.update(k, v)
        out = self.attend(q, k, v, gates, causal=self.causal or is_causal, offset=offset, padding_mask=padding_mask,
                          attn_mask=attn_mask, decoding=kv_cache is not None)
        return self.merge(out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None, *,
               causal: bool = False, offset: int = 0, padding_mask: torch.Tensor | None = None,
               attn_mask: torch.Tensor | None = None, decoding: bool = False, dropout_p: float | None = None
               ) -> torch.Tensor:
        """``MoHHeads.attend`` with the layer's attention dropout in training."""
        dropout_p = (self.attn_drop.p if self.training else 0.0) if dropout_p is None else dropout_p
        return super().attend(q, k, v, gates, causal=causal, offset=offset, padding_mask=padding_mask,
                              attn_mask=attn_mask, decoding=decoding, dropout_p=dropout_p)

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """Gated head outputs (B, N, h, d) -> concatenated, normalised and projected tokens (B, N, C_out)."""
        batch, length = out.shape[:2]
        out = self.norm(out.reshape(batch, length, self.attn_dim))
        return self.proj_drop(self.proj(out))


def moh_layers(model: nn.Module) -> list[MoHAttention]:
    """Every routed ``MoHAttention`` in ``model``, in module order (dense layers excluded)."""
    return [m for m in model.modules() if isinstance(m, MoHHeads) and m.is_moh]


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


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing per block: every entry of each ``blocks`` list in ``model`` recomputes its activations
    in backward instead of keeping them (``torch.utils.checkpoint``, non-reentrant). Returns the number of blocks.

    ViT, DiT and the decoder LM keep their blocks in ``model.blocks``, TransNeXt in each ``stages[i].blocks``, a
    ``transformers`` model (``models.hf_causal``) its decoder layers in ``blocks``. The block's forward is replaced on
    the instance, so module names, the state dict and hooks stay as they were; calling it again changes nothing. The
    recomputation in backward leaves the MoH layers' ``last_gates`` and ``load_balance_loss`` as the forward set them
    (same values, but a popped loss stays popped).
    """
    blocks = model_blocks(model, "activation checkpointing")
    for block in blocks:
        if not isinstance(block.__dict__.get("forward"), _CheckpointedForward):
            block.forward = _CheckpointedForward(block)
    return len(blocks)


def compile_blocks(model: nn.Module, **compile_kwargs) -> int:
    """Regional compilation: each entry of each ``blocks`` list in ``model`` compiled in place (``nn.Module.compile``),
    so the repeated block is compiled once and reused, not the whole network traced; returns the number of blocks.

    A model's blocks share one code path, so the compiler's cache serves every block after the first (torch's
    "regional compilation" recipe): the first step waits seconds, not the minutes a whole large network takes. Blocks
    of one shape share one graph: what differs between them must be a tensor (a drop-path rate: ``DropPath``), not a
    Python number, which Dynamo would specialise on. Blocks of different shapes (head budgets, TransNeXt's stages)
    each compile a graph, and every graph of a block class, training's and evaluation's, counts against Dynamo's
    recompile limit (8 by default; ``compile_kwargs`` ``recompile_limit`` raises it).
    """
    blocks = model_blocks(model, "regional compilation")
    for block in blocks:
        block.compile(**compile_kwargs)
    return len(blocks)


def model_blocks(model: nn.Module, purpose: str) -> list[nn.Module]:
    """The entries of every ``blocks`` list in ``model`` (ViT, DiT and the LMs' ``blocks``, TransNeXt's per stage)."""
    blocks = [block for module in model.modules()
              if isinstance(getattr(module, "blocks", None), (nn.ModuleList, nn.Sequential))
              for block in module.blocks]
    if not blocks:
        raise ValueError(f"{purpose}: {type(model).__name__} has no `blocks` list.")
    return blocks


class _CheckpointedForward:
    """A module's own forward run through ``torch.utils.checkpoint`` whenever autograd records."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = type(module).forward
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        calls = []

        def run(*inner_args, **inner_kwargs):
            if not calls:
                calls.append(True)
                return forward(module, *inner_args, **inner_kwargs)
            layers = [m for m in module.modules() if isinstance(m, MoHHeads)]
            kept = [(m.last_gates, m.load_balance_loss) for m in layers]
            try:  # the recomputation may stop early, once it has every tensor backward needs
                return forward(module, *inner_args, **inner_kwargs)
            finally:
                for layer, (gates, loss) in zip(layers, kept, strict=True):
                    layer.last_gates, layer.load_balance_loss = gates, loss

        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def activated_head_fraction(model: nn.Module) -> float:
    """Share of all attention heads each token uses, over every ``MoHAttention`` layer (dense ones at 100%)."""
    layers = [m for m in model.modules() if isinstance(m, MoHHeads)]
    total = sum(m.num_heads for m in layers)
    return sum(m.active_heads for m in layers) / total if total else 1.0
