"""The learned router's pass (``router_op.route_rows`` / ``route_rows_backward``) as one Triton kernel each way.

The PyTorch pass is a dozen small operations on (<= h, T) tensors, each one kernel launch on a GPU; here one program
takes a block of tokens (columns of the (R, T) logits) with every head of it in registers (R, E and h are a few, padded
to powers of two and masked), and writes the gates (T, h), the saved scores and the statistics in one kernel. The
arithmetic is float32 whatever the logits' dtype, stored in the PyTorch pass's output dtypes and layout, so a forward of
one implementation and a backward of the other interoperate.

The top-k is k passes of a maximum over the routed rows, each taking the lowest index among equal logits.
``torch.topk`` on the CPU breaks ties in no fixed index order (it partitions, e.g. of four equal logits k = 3 keeps
indices 0, 1, 2 but of eight it keeps 1, 4, 5), so on tied logits the two passes may select different, equally
ranked, heads; on distinct logits they agree. In bf16 ties are not rare: the logits have 8 significant bits.

The statistics are summed across programs with atomic adds, in float32: the counts are exact below 2^24 tokens, the
summed scores' order of addition (their last bits) varies from run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

# Tokens (columns) a program takes: one a thread at Triton's default 4 warps.
BLOCK = 128


@triton.jit
def _load_rows(ptr, row_stride, col_stride, first, count: tl.constexpr, PAD: tl.constexpr, cols, col_ok):
    """Rows ``first`` .. ``first + count`` of a (rows, tokens) tensor at ``cols`` in float32 (PAD, BLOCK), zero
    outside."""
    row = tl.arange(0, PAD)
    ok = (row < count)[:, None] & col_ok[None, :]
    return tl.load(ptr + (first + row)[:, None] * row_stride + cols[None, :] * col_stride, mask=ok,
                   other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, row_stride, col_stride, first, count: tl.constexpr, PAD: tl.constexpr, cols, col_ok, values):
    row = tl.arange(0, PAD)
    ok = (row < count)[:, None] & col_ok[None, :]
    tl.store(ptr + (first + row)[:, None] * row_stride + cols[None, :] * col_stride,
             values.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _softmax(logits, count: tl.constexpr, PAD: tl.constexpr):
    """Softmax over the first ``count`` rows of each column, zero in the padding rows."""
    real = (tl.arange(0, PAD) < count)[:, None]
    logits = tl.where(real, logits, float("-inf"))
    exp = tl.exp(logits - tl.max(logits, axis=0)[None, :])
    return exp / tl.sum(exp, axis=0)[None, :]


@triton.jit
def _group_scales(alpha_ptr, row_stride, col_stride, cols, col_ok,
                  SHARED_HEADS: tl.constexpr, TOP_K: tl.constexpr, TYPE_ROWS: tl.constexpr, FROM_LOGITS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """alpha_1, alpha_2 (the softmax of the type logits, or the saved one) and the groups' gate scales 2 alpha_1 h_s
    and 2 alpha_2 k (BLOCK,). Without a type router alpha is 1/2, so the scales are h_s and k."""
    if TYPE_ROWS:
        first = tl.load(alpha_ptr + cols * col_stride, mask=col_ok, other=0.0).to(tl.float32)
        second = tl.load(alpha_ptr + row_stride + cols * col_stride, mask=col_ok, other=0.0).to(tl.float32)
        if FROM_LOGITS:
            top = tl.maximum(first, second)
            first, second = tl.exp(first - top), tl.exp(second - top)
            first, second = first / (first + second), second / (first + second)
    else:
        first = tl.full((BLOCK,), 0.5, tl.float32)
        second = first
    return first, second, first * (2.0 * SHARED_HEADS), second * (2.0 * TOP_K)


@triton.jit
def _route_kernel(rows, rows_stride_r, rows_stride_t, valid, gates, saved, saved_stride_r, saved_stride_t, sums,
                  num_tokens, SHARED_HEADS: tl.constexpr, ROUTED_HEADS: tl.constexpr, TOP_K: tl.constexpr,
                  SHARED_ROWS: tl.constexpr, TYPE_ROWS: tl.constexpr, STATS: tl.constexpr, HAS_VALID: tl.constexpr,
                  SHARED_PAD: tl.constexpr, ROUTED_PAD: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < num_tokens
    heads: tl.constexpr = SHARED_HEADS + ROUTED_HEADS
    alpha_row: tl.constexpr = SHARED_ROWS + ROUTED_HEADS
    alpha_shared, alpha_routed, shared_scale, routed_scale = _group_scales(
        rows + alpha_row * rows_stride_r, rows_stride_r, rows_stride_t, cols, col_ok, SHARED_HEADS, TOP_K, TYPE_ROWS,
        True, BLOCK)
    if TYPE_ROWS:
        tl.store(saved + alpha_row * saved_stride_r + cols * saved_stride_t,
                 alpha_shared.to(saved.dtype.element_ty), mask=col_ok)
        tl.store(saved + (alpha_row + 1) * saved_stride_r + cols * saved_stride_t,
                 alpha_routed.to(saved.dtype.element_ty), mask=col_ok)
    if SHARED_ROWS:
        shared = _softmax(_load_rows(rows, rows_stride_r, rows_stride_t, 0, SHARED_ROWS, SHARED_PAD, cols, col_ok),
                          SHARED_ROWS, SHARED_PAD)
        _store_rows(saved, saved_stride_r, saved_stride_t, 0, SHARED_ROWS, SHARED_PAD, cols, col_ok, shared)
        _store_rows(gates, 1, heads, 0, SHARED_ROWS, SHARED_PAD, cols, col_ok, shared * shared_scale[None, :])
    elif SHARED_HEADS:  # no shared router: one shared head, whose softmax is 1
        _store_rows(gates, 1, heads, 0, SHARED_HEADS, SHARED_PAD, cols, col_ok,
                    tl.zeros((SHARED_PAD, BLOCK), tl.float32) + shared_scale[None, :])
    if ROUTED_HEADS:
        logits = _load_rows(rows, rows_stride_r, rows_stride_t, SHARED_ROWS, ROUTED_HEADS, ROUTED_PAD, cols, col_ok)
        probs = _softmax(logits, ROUTED_HEADS, ROUTED_PAD)
        row = tl.arange(0, ROUTED_PAD)[:, None]
        chosen = tl.where(row < ROUTED_HEADS, 1.0, 0.0) + tl.zeros((ROUTED_PAD, BLOCK), tl.float32)
        routed = probs
        if TOP_K < ROUTED_HEADS:
            left = tl.where(row < ROUTED_HEADS, logits, float("-inf"))
            chosen = tl.zeros((ROUTED_PAD, BLOCK), tl.float32)
            for _ in tl.static_range(TOP_K):
                best = row == tl.argmax(left, axis=0, tie_break_left=True)[None, :]
                chosen = tl.where(best, 1.0, chosen)
                left = tl.where(best, float("-inf"), left)
            # The softmax of the selected logits alone: the top-1 is among them, so the sum is at least 1 / E.
            routed = probs * chosen
            routed = routed / tl.sum(routed, axis=0)[None, :]
        _store_rows(saved, saved_stride_r, saved_stride_t, SHARED_ROWS, ROUTED_HEADS, ROUTED_PAD, cols, col_ok,
                    routed)
        _store_rows(gates, 1, heads, SHARED_HEADS, ROUTED_HEADS, ROUTED_PAD, cols, col_ok,
                    routed * routed_scale[None, :])
        if STATS:
            _store_rows(saved, saved_stride_r, saved_stride_t, alpha_row + TYPE_ROWS, ROUTED_HEADS, ROUTED_PAD,
                        cols, col_ok, probs)
            if HAS_VALID:
                weight = tl.load(valid + cols, mask=col_ok, other=0).to(tl.float32)
            else:
                weight = col_ok.to(tl.float32)
            expert = tl.arange(0, ROUTED_PAD)
            real = expert < ROUTED_HEADS
            tl.atomic_add(sums + expert, tl.sum(chosen * weight[None, :], axis=1), mask=real)
            tl.atomic_add(sums + ROUTED_HEADS, tl.sum(weight, axis=0))
            tl.atomic_add(sums + ROUTED_HEADS + 1 + expert, tl.sum(probs * weight[None, :], axis=1), mask=real)


@triton.jit
def _route_backward_kernel(grad_gates, gates_stride_t, gates_stride_h, grad_prob_sum, prob_stride, saved,
                           saved_stride_r, saved_stride_t, valid, grad_rows, grad_stride_r, num_tokens,
                           SHARED_HEADS: tl.constexpr, ROUTED_HEADS: tl.constexpr, TOP_K: tl.constexpr,
                           SHARED_ROWS: tl.constexpr, TYPE_ROWS: tl.constexpr, HAS_PROB_GRAD: tl.constexpr,
                           HAS_VALID: tl.constexpr, SHARED_PAD: tl.constexpr, ROUTED_PAD: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Softmax backward, d l = p * (d p - sum p d p), with d p = scale * d gate (and the summed scores' gradient)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < num_tokens
    alpha_row: tl.constexpr = SHARED_ROWS + ROUTED_HEADS
    alpha_shared, alpha_routed, shared_scale, routed_scale = _group_scales(
        saved + alpha_row * saved_stride_r, saved_stride_r, saved_stride_t, cols, col_ok, SHARED_HEADS, TOP_K,
        TYPE_ROWS, False, BLOCK)
    # sum over each group of score * d gate: alpha's gradient over 2 (h_s or k).
    shared_dot = tl.zeros((BLOCK,), tl.float32)
    routed_dot = tl.zeros((BLOCK,), tl.float32)
    if SHARED_HEADS:
        grad = _load_rows(grad_gates, gates_stride_h, gates_stride_t, 0, SHARED_HEADS, SHARED_PAD, cols, col_ok)
        if SHARED_ROWS:
            shared = _load_rows(saved, saved_stride_r, saved_stride_t, 0, SHARED_ROWS, SHARED_PAD, cols, col_ok)
            shared_dot = tl.sum(shared * grad, axis=0)
            _store_rows(grad_rows, grad_stride_r, 1, 0, SHARED_ROWS, SHARED_PAD, cols, col_ok,
                        shared * shared_scale[None, :] * (grad - shared_dot[None, :]))
        else:
            shared_dot = tl.sum(grad, axis=0)
    if ROUTED_HEADS:
        routed = _load_rows(saved, saved_stride_r, saved_stride_t, SHARED_ROWS, ROUTED_HEADS, ROUTED_PAD, cols,
                            col_ok)
        grad = _load_rows(grad_gates, gates_stride_h, gates_stride_t, SHARED_HEADS, ROUTED_HEADS, ROUTED_PAD, cols,
                          col_ok)
        routed_dot = tl.sum(routed * grad, axis=0)
        grad_logits = routed * routed_scale[None, :] * (grad - routed_dot[None, :])
        if HAS_PROB_GRAD:
            probs = _load_rows(saved, saved_stride_r, saved_stride_t, alpha_row + TYPE_ROWS, ROUTED_HEADS, ROUTED_PAD,
                               cols, col_ok)
            expert = tl.arange(0, ROUTED_PAD)
            grad_probs = tl.load(grad_prob_sum + expert * prob_stride, mask=expert < ROUTED_HEADS,
                                 other=0.0).to(tl.float32)[:, None] + tl.zeros((ROUTED_PAD, BLOCK), tl.float32)
            if HAS_VALID:
                grad_probs = grad_probs * tl.load(valid + cols, mask=col_ok, other=0).to(tl.float32)[None, :]
            grad_logits += probs * (grad_probs - tl.sum(probs * grad_probs, axis=0)[None, :])
        _store_rows(grad_rows, grad_stride_r, 1, SHARED_ROWS, ROUTED_HEADS, ROUTED_PAD, cols, col_ok, grad_logits)
    if TYPE_ROWS:
        grad_shared = shared_dot * (2.0 * SHARED_HEADS)
        grad_routed = routed_dot * (2.0 * TOP_K)
        dot = alpha_shared * grad_shared + alpha_routed * grad_routed
        tl.store(grad_rows + alpha_row * grad_stride_r + cols,
                 (alpha_shared * (grad_shared - dot)).to(grad_rows.dtype.element_ty), mask=col_ok)
        tl.store(grad_rows + (alpha_row + 1) * grad_stride_r + cols,
                 (alpha_routed * (grad_routed - dot)).to(grad_rows.dtype.element_ty), mask=col_ok)


def available() -> bool:
    """Whether the kernels can run here: on a CUDA device, or on CPU tensors through Triton's interpreter.

    ``triton.jit`` builds interpreted kernels when ``TRITON_INTERPRET=1`` as it decorates them (this module's import),
    and they run only while it stays set.
    """
    return torch.cuda.is_available() or isinstance(_route_kernel, InterpretedFunction)


def _pad(count: int) -> int:
    return triton.next_power_of_2(max(count, 1))


def route_rows(rows: Tensor, valid: Tensor | None, shared_heads: int, routed_heads: int, top_k: int,
               shared_rows: int, type_rows: int, stats: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``router_op.route_rows`` in one kernel: gates (T, h), the saved scores (S, T), and with ``stats`` the summed
    routed softmax (E,) and ``selection_counts`` (E + 1,) (empty without). ``shared_rows`` 0 means at most one shared
    head, as there."""
    num_tokens = rows.shape[1]
    gates = rows.new_empty(num_tokens, shared_heads + routed_heads)
    # router_op.saved_rows, not imported: router_op imports this module.
    saved = rows.new_empty(shared_rows + routed_heads + type_rows + (routed_heads if stats else 0), num_tokens)
    # The counts, the token count and the summed scores: float32, as an atomic add in bf16 would round each block.
    sums = torch.zeros(2 * routed_heads + 1 if stats else 0, dtype=torch.float32, device=rows.device)
    _route_kernel[(triton.cdiv(num_tokens, BLOCK),)](
        rows, *rows.stride(), valid, gates, saved, *saved.stride(), sums if stats else None, num_tokens,
        SHARED_HEADS=shared_heads, ROUTED_HEADS=routed_heads, TOP_K=top_k, SHARED_ROWS=shared_rows,
        TYPE_ROWS=type_rows, STATS=stats, HAS_VALID=valid is not None, SHARED_PAD=_pad(shared_heads),
        ROUTED_PAD=_pad(routed_heads), BLOCK=BLOCK)
    if not stats:
        return gates, saved, rows.new_zeros(0), sums
    # A custom op's outputs may share no storage: the summed scores leave the buffer as a copy in every dtype (a plain
    # .to in float32 would return a view of it), the counts stay at its start, storage offset 0 as the fake's.
    counts, prob_sum = sums.split([routed_heads + 1, routed_heads])
    return gates, saved, prob_sum.to(rows.dtype, copy=True), counts


def route_rows_backward(grad_gates: Tensor, grad_prob_sum: Tensor | None, saved: Tensor, valid: Tensor | None,
                        shared_heads: int, routed_heads: int, top_k: int, shared_rows: int, type_rows: int) -> Tensor:
    """``router_op.route_rows_backward`` in one kernel: the logits' gradient (R, T) in the saved scores' dtype."""
    num_tokens = saved.shape[1]
    stats = saved.shape[0] > shared_rows + routed_heads + type_rows
    grad_prob_sum = grad_prob_sum if stats else None
    grad_rows = saved.new_empty(shared_rows + routed_heads + type_rows, num_tokens)
    _route_backward_kernel[(triton.cdiv(num_tokens, BLOCK),)](
        grad_gates, *grad_gates.stride(), grad_prob_sum, 0 if grad_prob_sum is None else grad_prob_sum.stride(0),
        saved, *saved.stride(), valid, grad_rows, grad_rows.stride(0), num_tokens,
        SHARED_HEADS=shared_heads, ROUTED_HEADS=routed_heads, TOP_K=top_k, SHARED_ROWS=shared_rows,
        TYPE_ROWS=type_rows, HAS_PROB_GRAD=grad_prob_sum is not None, HAS_VALID=valid is not None,
        SHARED_PAD=_pad(shared_heads), ROUTED_PAD=_pad(routed_heads), BLOCK=BLOCK)
    return grad_rows


__all__ = ["available", "route_rows", "route_rows_backward"]
