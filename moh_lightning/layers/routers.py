"""MoH routers: which heads each token uses, with which gate, and the load-balance loss (paper Eq. 5-10).

Apart from the attention block so the routing maths can be read, tested and swapped on its own; the block
only asks a router for per-token gates.
"""
from __future__ import annotations

from typing import Literal

import torch
from timm.layers import register_notrace_module
from torch import nn

from moh_lightning.layers.query_norm import query_norm_scores
from moh_lightning.layers.router_op import route, selection_counts

RouterType = Literal["learned", "query_norm"]
#: Precision of the query-norm router's scores: float32, or the activations' dtype (the authors' MoH-LLaMA3 code).
RouterDtype = Literal["float32", "activation"]


class RouterOutput:
    """Per-token head gates (B, N, h), zero where a head is off, and the layer's load-balance loss."""

    __slots__ = ("gates", "load_balance_loss")

    def __init__(self, gates: torch.Tensor, load_balance_loss: torch.Tensor | None) -> None:
        self.gates = gates
        self.load_balance_loss = load_balance_loss


def load_balance_loss(probs: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The routed heads' load-balance loss at the authors' scale: E * sum_i f_i P_i, so a balanced router gives k.

    ``probs`` (T, E) are the routed-head softmax scores, ``selected`` (T, E) the top-k indicator and ``valid`` (T,)
    marks real (non-padding) tokens. f_i is the fraction of tokens selecting head i (it sums to k over heads), P_i the
    mean score; balanced routing has f_i = k / E and P_i = 1 / E, hence the loss k. The paper's Eq. 7 writes
    sum_i f_i P_i with no factor E; the authors' MoH-ViT and MoH-DiT code computes ``mean(P * f) * E * E``, which is
    E times Eq. 7, and their beta = 0.01 weights that: so does this suite. Under torch.distributed with several
    processes, f_i counts the tokens of every rank while P_i stays local (the authors' code counts each GPU's own).
    """
    weight = None if valid is None else valid.to(probs.dtype)[:, None]
    prob_sum = (probs if weight is None else probs * weight).sum(0)                   # (E,)
    return _balance_loss(prob_sum, selection_counts(selected, valid))


def _balance_loss(prob_sum: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i P_i from the routed scores summed over this process's tokens and ``selection_counts``."""
    local_tokens = counts[-1].clamp_min(1.0).to(prob_sum.dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        # f_i from global counts (no gradient flows through them) and P_i local: DDP averages the ranks'
        # gradients, and the mean over ranks of the per-rank losses is the 1-process loss over all ranks'
        # tokens when every rank holds the same number of tokens (the mean of the local P_i is then the
        # global P_i). Every rank reaches this call in the same order, as DDP's own all-reduces do.
        counts = counts.detach().clone()
        torch.distributed.all_reduce(counts)
    fraction = (counts[:-1] / counts[-1].clamp_min(1.0)).to(prob_sum.dtype)
    return (fraction * (prob_sum / local_tokens)).sum() * prob_sum.shape[0]


def _select_top_k(probs: torch.Tensor, top_k: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask of each token's ``top_k`` highest-scoring routed heads, the heads along ``dim``."""
    indices = probs.topk(top_k, dim=dim).indices
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(dim, indices, True)


# Both routers are leaves of an FX trace (timm's feature extraction): their gates come out of custom autograd functions
# (the fused router's hand-written backward, the straight-through one), which a symbolic trace cannot record.
@register_notrace_module
class MoHRouter(nn.Module):
    """Two-stage MoH router (paper Eq. 5-6) with the authors' gate scaling.

    Shared gates are softmax(W_s x) * h_s, routed gates are softmax(W_r x) kept on the top-k, renormalised
    over them and multiplied by k; the two groups are weighted by 2 * alpha_1 and 2 * alpha_2 with
    [alpha_1, alpha_2] = softmax(W_h x). A uniform router therefore gives every active head gate 1, which is
    multi-head attention's plain sum. ``two_stage=False`` fixes alpha_1 = alpha_2 = 1/2 (the Tab. 6 ablation).

    The three routers are one projection and one op at run time (``router_op.route``): their weights are
    concatenated per call and stay three parameters under their own names. The load-balance statistics are
    gathered only in training and only when some routed head can be skipped (k < E).
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
        if self.shared_router is None and self.routed_router is None:          # one shared head and nothing else
            return RouterOutput(x.new_ones(*x.shape[:-1], self.num_heads), None)
        stats = self.training and self.top_k < self.num_routed_heads
        tokens = x.reshape(-1, x.shape[-1])
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        weights = [None if lin is None else lin.weight.to(dtype)
                   for lin in (self.shared_router, self.routed_router, self.type_router)]
        gates, _, prob_sum, counts, _, loss = route(tokens.to(dtype), *weights, valid, self.num_shared_heads,
                                                    self.num_routed_heads, self.top_k, stats)
        if not stats:
            loss = None
        elif torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            loss = _balance_loss(prob_sum, counts)  # f_i over every rank's tokens
        return RouterOutput(gates.reshape(*x.shape[:-1], self.num_heads), loss)


class _StraightThrough(torch.autograd.Function):
    """Forward: the {0, 1} selection; backward: the gradient of the real-valued score (paper Eq. 9-10)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        return selected.to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@register_notrace_module
class QueryNormRouter(nn.Module):
    """Parameter-free router for continue-tuning a pretrained model into MoH (paper section 4.4).

    Each routed head is scored by the l2 norm of its query, divided by the standard deviation of those norms
    across the routed heads (as the authors' MoH-LLaMA3 code does); the top-k get gate 1, the others 0, and
    shared heads always 1, so with every head active the layer is exactly the pretrained one. The quantised
    gates pass the scores' gradient straight through.

    ``score_dtype`` is the precision of the norms, their standard deviation, the softmax and the top-k:
    ``"float32"`` ranks the norms as computed exactly; ``"activation"`` scores in the queries' own dtype, as the
    authors' code does, where in bf16 close scores round to ties and some tokens keep other heads (2-3% of the
    tokens of tests/data/golden_moh_llama's tiny model, 12-22% measured on LLaMA3-8B-shaped layers). The two are
    the same function in fp32. ``"activation"`` reproduces the authors' bf16 numbers.

    The authors' released model computes no load-balance loss (their layers return none); this router computes the
    suite's E * sum_i f_i P_i in training, which tasks weight by beta (0 by default for this router).
    """

    def __init__(self, num_heads: int, num_shared_heads: int, top_k: int,
                 score_dtype: RouterDtype = "float32") -> None:
        super().__init__()
        if score_dtype not in ("float32", "activation"):
            raise ValueError(f"router_dtype={score_dtype!r}: choose 'float32' or 'activation'.")
        self.num_heads = num_heads
        self.num_shared_heads = num_shared_heads
        self.num_routed_heads = num_heads - num_shared_heads
        self.top_k = top_k
        self.score_dtype = score_dtype

    def forward(self, x: torch.Tensor, q: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> RouterOutput:
        if q is None:
            raise ValueError("QueryNormRouter scores heads by their queries: pass q (B, h, N, d).")
        batch, _, length, _ = q.shape
        shared = q.new_ones(batch * length, self.num_shared_heads)
        if not self.num_routed_heads:
            return RouterOutput(shared.reshape(batch, length, self.num_heads), None)
        probs, selected = (t.reshape(batch * length, self.num_routed_heads)
                           for t in query_norm_scores(q, self.num_shared_heads, self.top_k, self.score_dtype))
        routed = _StraightThrough.apply(probs, selected).to(q.dtype)
        loss = None
        if self.training and self.top_k < self.num_routed_heads:
            loss = load_balance_loss(probs, selected, valid)
        gates = torch.cat([shared, routed], dim=-1).reshape(batch, length, self.num_heads)
        return RouterOutput(gates, loss)
