"""The learned router as one op each way: ``moh::route`` (gates and load-balance statistics) and its backward.

``MoHRouter``'s gates take softmaxes, a top-k, a renormalisation, the two-stage scales and the load-balance
statistics: two dozen small operations on (<= h, T) tensors, each one kernel launch on a GPU and one dispatch on the
CPU, which at ViT-S / DiT-S sizes cost more than their arithmetic. Registered with ``torch.library``, the router is one
node for autograd, ``torch.compile`` and CUDA graphs: the logits' product (cuBLAS / MKL), then one pass over the
logits for every gate and statistic; backward one pass and the two products.

The pass is ``route_rows`` / ``route_rows_backward``: here in PyTorch, on CUDA the Triton kernels of
``router_triton`` (one kernel each way, the same outputs and saved layout).

The logits are laid out heads along rows and tokens along columns, (R, T) = W @ tokens^T, rows ordered shared,
routed, type router: every softmax, the top-k and the statistics work on contiguous rows of T tokens (on CPU a
softmax over a last dim of 2-6 entries costs 20x one over the tokens), and the backward hands the tokens a contiguous
gradient. The renormalised top-k scores are the softmax of the selected logits alone (p_i / sum_selected p_j =
exp(l_i) / sum_selected exp(l_j)), and the top-k of the logits is the top-k of their softmax.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor


def _group_scales(alpha: Tensor | None, shared_heads: int, top_k: int):
    """Scale of the shared and of the routed group's gates: h_s and k, times 2 alpha_1 and 2 alpha_2 (two-stage)."""
    if alpha is None:
        return float(shared_heads), float(top_k)
    return alpha[:1] * (2.0 * shared_heads), alpha[1:] * (2.0 * top_k)


def selection_counts(selected: Tensor, valid: Tensor | None) -> Tensor:
    """(E + 1,) float32: tokens selecting each routed head of ``selected`` (T, E), then the token count.

    Float32 because in bf16 a sum over more than 256 tokens would round.
    """
    if valid is None:
        total = torch.full((1,), selected.shape[0], dtype=torch.float32, device=selected.device)
        return torch.cat([selected.sum(0, dtype=torch.float32), total])
    weight = valid.float()[:, None]
    return torch.cat([(selected.float() * weight).sum(0), weight.sum(0)])


def saved_rows(shared_heads: int, routed_heads: int, shared_rows: int, type_rows: int, stats: bool) -> int:
    """Rows of ``route_rows``' saved scores: the shared softmax, the routed gates' scores, alpha, the routed softmax."""
    return shared_rows + routed_heads + type_rows + (routed_heads if stats else 0)


def route_rows(rows: Tensor, valid: Tensor | None, shared_heads: int, routed_heads: int, top_k: int,
               shared_rows: int, type_rows: int, stats: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gates (T, h) from logits ``rows`` (R, T), the scores backward needs (S, T), and with ``stats`` the routed
    softmax summed over the valid tokens (E,) and ``selection_counts`` (E + 1,) (empty without)."""
    shared_logits, routed_logits, type_logits = rows.split([shared_rows, routed_heads, type_rows])
    shared = shared_logits.softmax(0) if shared_rows else None                        # (h_s, T)
    alpha = type_logits.softmax(0) if type_rows else None                             # (2, T)
    selected = routed = None
    if routed_heads:
        if top_k < routed_heads:
            indices = routed_logits.topk(top_k, dim=0).indices
            selected = torch.zeros_like(routed_logits, dtype=torch.bool).scatter_(0, indices, True)
            routed = torch.where(selected, routed_logits, float("-inf")).softmax(0)   # (E, T)
        else:
            routed = routed_logits.softmax(0)
    shared_scale, routed_scale = _group_scales(alpha, shared_heads, top_k)
    groups = []
    if shared_heads:
        groups.append(shared * shared_scale if shared is not None
                      else (shared_scale if alpha is not None else rows.new_ones(1, rows.shape[1])))
    if routed is not None:
        groups.append(routed * routed_scale)
    gates = (groups[0] if len(groups) == 1 else torch.cat(groups)).mT.contiguous()   # (T, h)
    saved = [s for s in (shared, routed, alpha) if s is not None]
    prob_sum, counts = rows.new_zeros(0), rows.new_zeros(0, dtype=torch.float32)
    if stats:
        probs = routed_logits.softmax(0)
        saved.append(probs)
        prob_sum = (probs if valid is None else probs * valid.to(probs.dtype)).sum(1)  # (E,)
        counts = selection_counts(selected.mT, valid)
    return gates, torch.cat(saved) if saved else rows.new_zeros(0, rows.shape[1]), prob_sum, counts


def route_rows_backward(grad_gates: Tensor, grad_prob_sum: Tensor | None, saved: Tensor, valid: Tensor | None,
                        shared_heads: int, routed_heads: int, top_k: int, shared_rows: int, type_rows: int) -> Tensor:
    """Gradient of the logits (R, T) from the gates' (T, h) and the summed routed scores' (E,) (None: unused).

    The formula's gradient written out: left to autograd, two dozen small operations cost more in per-operation
    overhead than in arithmetic. Softmax backward, d l = p * (d p - sum p d p), with d p = scale * d gate.
    """
    stats = saved.shape[0] > shared_rows + routed_heads + type_rows
    shared, routed, alpha, probs = saved.split([shared_rows, routed_heads, type_rows,
                                                routed_heads if stats else 0])
    shared = shared if shared_rows else None
    alpha = alpha if type_rows else None
    grad = grad_gates.mT.to(saved.dtype)                                              # (h, T)
    grad_shared, grad_routed = grad.split([shared_heads, routed_heads])
    shared_scale, routed_scale = _group_scales(alpha, shared_heads, top_k)
    rows = []
    if shared is not None:
        shared_dot = (shared * grad_shared).sum(0, keepdim=True)                      # (1, T)
        rows.append(shared * shared_scale * (grad_shared - shared_dot))
    if routed_heads:
        routed_dot = (routed * grad_routed).sum(0, keepdim=True)
        grad_logits = routed * routed_scale * (grad_routed - routed_dot)
        if stats and grad_prob_sum is not None:
            grad_probs = grad_prob_sum.to(saved.dtype)[:, None]
            if valid is not None:
                grad_probs = grad_probs * valid.to(saved.dtype)
            grad_logits = grad_logits + probs * (grad_probs - (probs * grad_probs).sum(0, keepdim=True))
        rows.append(grad_logits)
    if alpha is not None:
        # gates = group * 2 alpha_i * (h_s or k): d alpha_i = 2 (h_s or k) sum_group group * d gate.
        shared_dot = shared_dot if shared is not None else grad_shared
        grad_alpha = torch.cat([shared_dot * (2.0 * shared_heads), routed_dot * (2.0 * top_k)])   # (2, T)
        rows.append(alpha * (grad_alpha - (alpha * grad_alpha).sum(0, keepdim=True)))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _passes(device: torch.device):
    """The forward and backward pass for tensors on ``device``: the Triton kernels on CUDA, else PyTorch's."""
    return (_triton_passes() if device.type == "cuda" else None) or (route_rows, route_rows_backward)


@functools.cache
def _triton_passes():
    """``router_triton``'s pair where its kernels run, None where they do not or Triton is not installed (a CPU-only
    torch: hence the import here, on the first CUDA call)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from moh_lightning.layers import router_triton
    return (router_triton.route_rows, router_triton.route_rows_backward) if router_triton.available() else None


def _weights(shared: Tensor | None, routed: Tensor | None, kind: Tensor | None) -> Tensor:
    present = [w for w in (shared, routed, kind) if w is not None]
    return present[0] if len(present) == 1 else torch.cat(present)


@torch.library.custom_op("moh::route", mutates_args=())
def route(tokens: Tensor, shared_weight: Tensor | None, routed_weight: Tensor | None, type_weight: Tensor | None,
          valid: Tensor | None, shared_heads: int, routed_heads: int, top_k: int, stats: bool
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The learned router on ``tokens`` (T, C) with its three linear layers' weights (None where a layer is absent);
    ``valid`` (T,) marks real tokens.

    Returns the gates (T, h), the scores backward needs, and with ``stats`` (else empty): the routed softmax summed over
    the valid tokens (E,), ``selection_counts`` (E + 1,), the weights w (E,) that make this process's load-balance
    loss sum_i w_i * prob_sum_i (E * f_i / tokens), and that loss. Under several processes f_i must count every
    rank's tokens, so the caller recomputes the loss from the counts. Tokens and weights share one dtype (the caller
    casts them: autocast's job, for an op it does not know).
    """
    weight = _weights(shared_weight, routed_weight, type_weight)
    rows = torch.mm(weight, tokens.mT)                                                # (R, T)
    shared_rows = 0 if shared_weight is None else shared_weight.shape[0]
    type_rows = 0 if type_weight is None else type_weight.shape[0]
    forward, _ = _passes(rows.device)
    gates, saved, prob_sum, counts = forward(rows, valid, shared_heads, routed_heads, top_k, shared_rows, type_rows,
                                             stats)
    balance_weight, loss = rows.new_zeros(0), rows.new_zeros(0)
    if stats:
        tokens_here = counts[-1].clamp_min(1.0)
        balance_weight = (counts[:-1] * (routed_heads / tokens_here ** 2)).to(prob_sum.dtype)
        loss = (prob_sum * balance_weight).sum()
    return gates, saved, prob_sum, counts, balance_weight, loss


@route.register_fake
def _(tokens, shared_weight, routed_weight, type_weight, valid, shared_heads, routed_heads, top_k, stats):
    num_tokens = tokens.shape[0]
    shared_rows = 0 if shared_weight is None else shared_weight.shape[0]
    type_rows = 0 if type_weight is None else type_weight.shape[0]
    experts = routed_heads if stats else 0
    return (tokens.new_empty(num_tokens, shared_heads + routed_heads),
            tokens.new_empty(saved_rows(shared_heads, routed_heads, shared_rows, type_rows, stats), num_tokens),
            tokens.new_empty(experts), tokens.new_empty(experts + 1 if stats else 0, dtype=torch.float32),
            tokens.new_empty(experts), tokens.new_empty(() if stats else 0))


@torch.library.custom_op("moh::route_backward", mutates_args=())
def route_backward(grad_gates: Tensor, grad_prob_sum: Tensor | None, saved: Tensor, tokens: Tensor,
                   shared_weight: Tensor | None, routed_weight: Tensor | None, type_weight: Tensor | None,
                   valid: Tensor | None, shared_heads: int, routed_heads: int, top_k: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``route``'s tokens (T, C) and of each weight given (empty for an absent one)."""
    weight = _weights(shared_weight, routed_weight, type_weight)
    shared_rows = 0 if shared_weight is None else shared_weight.shape[0]
    type_rows = 0 if type_weight is None else type_weight.shape[0]
    _, backward = _passes(saved.device)
    grad_rows = backward(grad_gates, grad_prob_sum, saved, valid, shared_heads, routed_heads, top_k, shared_rows,
                         type_rows).to(weight.dtype)                                  # (R, T)
    grads, start = [grad_rows.mT @ weight], 0                                        # contiguous (T, C)
    for w in (shared_weight, routed_weight, type_weight):
        if w is None:
            grads.append(tokens.new_zeros(0))
            continue
        grads.append(grad_rows[start:start + w.shape[0]] @ tokens)                    # (rows of w, C)
        start += w.shape[0]
    return tuple(grads)


@route_backward.register_fake
def _(grad_gates, grad_prob_sum, saved, tokens, shared_weight, routed_weight, type_weight, valid, shared_heads,
      routed_heads, top_k):
    return (torch.empty_like(tokens), *(torch.empty_like(w) if w is not None else tokens.new_empty(0)
                                        for w in (shared_weight, routed_weight, type_weight)))


def _setup_context(ctx, inputs, output) -> None:
    tokens, shared_weight, routed_weight, type_weight, valid, *layout, _ = inputs
    ctx.layout = layout
    ctx.set_materialize_grads(False)  # unused outputs (the counts, often the summed scores) need no zero gradient
    ctx.mark_non_differentiable(output[1], output[3], output[4])  # the saved scores, counts and loss weights
    ctx.save_for_backward(tokens, shared_weight, routed_weight, type_weight, valid, output[1], output[4])


def _backward(ctx, grad_gates, grad_saved, grad_prob_sum, grad_counts, grad_balance_weight, grad_loss):
    tokens, shared_weight, routed_weight, type_weight, valid, saved, balance_weight = ctx.saved_tensors
    if grad_gates is None:
        grad_gates = tokens.new_zeros(tokens.shape[0], ctx.layout[0] + ctx.layout[1])
    if grad_loss is not None:  # loss = sum_i w_i prob_sum_i
        from_loss = grad_loss * balance_weight
        grad_prob_sum = from_loss if grad_prob_sum is None else grad_prob_sum + from_loss
    grads = route_backward(grad_gates, grad_prob_sum, saved, tokens, shared_weight, routed_weight, type_weight, valid,
                           *ctx.layout)
    weights = (shared_weight, routed_weight, type_weight)
    return grads[0], *(g if w is not None else None for g, w in zip(grads[1:], weights, strict=True)), \
        None, None, None, None, None


route.register_autograd(_backward, setup_context=_setup_context)


__all__ = ["route", "route_backward", "route_rows", "route_rows_backward", "saved_rows", "selection_counts"]
