"""MoH routers: which heads each token uses, with which gate, and the load-balance loss (paper Eq. 5-10).

Apart from the attention block so the routing maths can be read, tested and swapped on its own; the block
only asks a router for per-token gates.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn

RouterType = Literal["learned", "query_norm"]


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
    processes, f_i counts the tokens of every rank while P_i stays local.
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
    return (fraction * mean_prob).sum() * num_routed


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
                loss = load_balance_loss(probs, selected, valid)
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
            loss = load_balance_loss(probs, selected, valid)
        gates = torch.cat([shared, routed], dim=-1).reshape(batch, length, self.num_heads)
        return RouterOutput(gates, loss)
