"""Causal attention of gathered queries, for the head-sparse path (``head_sparse_attention``).

A gathered query's slot is not its position, so SDPA's ``is_causal`` cannot serve it. The slots are laid out in blocks
of ``CAUSAL_BLOCK`` positions (``slot_layout``); on CPU the keys before a block go through one unmasked flash call and
only the staircase inside it through masked chunks, merged by their log-sum-exp (``CausalStaircase``); elsewhere the
slots are cut into chunks that each attend to every key up to their last position (``causal_chunks``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Rows of gathered queries per causal chunk: smaller chunks waste less of each chunk's diagonal block,
# larger ones make fewer SDPA calls.
CAUSAL_CHUNK = 64
# Positions per block of causal slots, whose keys before the block take one unmasked call (CPU causal path):
# smaller blocks shrink the masked staircase, larger ones the padding to each block's largest count.
CAUSAL_BLOCK = 512
# Keys per backward call over a block's unmasked keys: bounds the key / value gradient temporaries.
STAIRCASE_KEYS = 1024

_aten = torch.ops.aten
FLASH_CPU = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_SDPA_KERNELS = tuple(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
) if hasattr(_aten, name))


def combine_masks(mask: torch.Tensor | None, other: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None or other is None:
        return other if mask is None else mask
    return mask + other

def causal_bias(positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """(..., L, num_keys) float mask letting the query at each position see the keys at or before it.

    Built arithmetically, min(max(key - position, 0), 1) * the dtype's lowest value, which is 4x faster on
    CPU than comparing and selecting; a finite lowest value masks exactly like -inf because every query sees
    at least itself. Positions are compared in fp32, exact up to 2^24.
    """
    keys = torch.arange(num_keys, device=positions.device, dtype=torch.float32)
    bias = (keys - positions[..., None].float()).clamp_(0, 1).mul_(torch.finfo(dtype).min)
    return bias.to(dtype)


def slot_layout(selected: torch.Tensor, block: int, chunked: bool):
    """Where each (sequence, routed head) puts its selected queries: slots in blocks of ``block`` positions.

    Block j holds the queries at positions [j * block, (j + 1) * block) in order, in as many slots as the largest
    count there over (sequence, head); the other sequences and heads pad it with the block's last position (never
    fully masked), whose outputs go to the dump row N. Aligned on positions, every query of a causal block sees the
    keys before the block, one range for all. Laid out over all N slots (the blocks' widths sum to at most N), so
    that the widths and the causal chunk plan come back in one host read.

    Returns the token row of each slot (B, E, N), whether the slot is a selected query (B, E, N), the blocks' widths
    (num_blocks,) and, when ``chunked``, per chunk of ``CAUSAL_CHUNK`` slots of each block the last selected position
    (-1 if none).
    """
    batch, heads, length = selected.shape
    num_blocks, chunks_per_block = -(-length // block), -(-block // CAUSAL_CHUNK)
    device = selected.device
    rank = F.pad(selected, (0, num_blocks * block - length)).view(batch, heads, num_blocks, block).cumsum(-1) - 1
    widths = rank[..., -1].amax(dim=(0, 1)) + 1                                   # (num_blocks,)
    block_ends = widths.cumsum(0)
    slot = ((block_ends - widths)[:, None] + rank).flatten(-2)[..., :length]     # (B, E, N) where selected
    target = torch.where(selected, slot, length)                                  # N: the dump column
    tokens = torch.arange(length, device=device).expand_as(target)
    block_of_slot = torch.searchsorted(block_ends, torch.arange(length + 1, device=device), right=True)
    padding = ((block_of_slot + 1) * block).clamp(max=length) - 1                 # (N + 1,)
    positions = padding.expand(batch, heads, length + 1).scatter(-1, target, tokens)[..., :length]
    real = selected.new_zeros(batch, heads, length + 1).scatter(-1, target, selected)[..., :length]
    chunk = (torch.arange(num_blocks, device=device)[:, None] * chunks_per_block
             + rank.clamp(min=0) // CAUSAL_CHUNK).flatten(-2)[..., :length]
    chunk_last = torch.full((num_blocks * chunks_per_block,), -1, device=device).scatter_reduce(
        0, chunk.flatten(), torch.where(selected, tokens, -1).flatten(), "amax") if chunked else widths[:0]
    return positions, real, widths, chunk_last


def causal_plan(widths: list[int], chunk_last: list[int], offset: int, num_keys: int) -> list:
    """[(first slot, end slot, first position, [(chunk start, chunk end, key end), ...]), ...] per nonempty block of
    ``slot_layout``: the chunks of ``CAUSAL_CHUNK`` slots and the keys their latest query sees."""
    plan, start = [], 0
    chunks_per_block = -(-CAUSAL_BLOCK // CAUSAL_CHUNK)
    for block, width in enumerate(widths):
        chunks = [(start + s, start + min(s + CAUSAL_CHUNK, width),
                   min(chunk_last[block * chunks_per_block + s // CAUSAL_CHUNK] + offset + 1, num_keys))
                  for s in range(0, width, CAUSAL_CHUNK)]
        if chunks:
            plan.append((start, start + width, block * CAUSAL_BLOCK + offset, chunks))
        start += width
    return plan


def causal_chunks(q_sel, k, v, positions, mask, dropout_p, plan) -> torch.Tensor:
    """Causal SDPA of gathered queries by the chunks of slots of ``plan``, each over the keys its latest query sees."""
    chunks = []
    for s, e, num_keys in plan:
        chunk_mask = None if mask is None else mask[..., s:e, :num_keys] if mask.shape[-2] > 1 \
            else mask[..., :num_keys]
        chunks.append((s, e, num_keys, positions[..., s:e], chunk_mask))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_sel, k, v)):
        return _CausalChunks.apply(q_sel, k, v, chunks, dropout_p)
    return torch.cat([_causal_chunk(q_sel[:, :, s:e], k[:, :, :n], v[:, :, :n], pos, m, dropout_p)
                      for s, e, n, pos, m in chunks], dim=2)


class CausalStaircase(torch.autograd.Function):
    """Causal attention of gathered queries (CPU flash kernel): per block of ``slot_layout``, the keys before the
    block's first position in one unmasked call, the staircase after it by ``CAUSAL_CHUNK`` rows with a positional
    mask, merged through their log-sum-exp.

    Against chunks that each attend to every key up to their last position (``causal_chunks``), most of the work
    runs in large unmasked calls, where the CPU kernel is fastest, and the masks shrink to the staircase. The
    backward is the flash kernel's own, called for each part with the merged output and log-sum-exp (the
    decomposition ring attention uses), so nothing but the merged output and its log-sum-exp is kept; the masks are
    rebuilt. ``k`` and ``v`` have one head per query head; no dropout, no other mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, slots, offset, plan):
        q_sel = gather_slots(q, slots)                                           # (B, E, L, d), not kept
        positions = slots + offset
        out = q_sel.new_empty(q_sel.shape)
        lse = q_sel.new_empty(q_sel.shape[:3], dtype=torch.float32)
        for s0, e0, first, chunks in plan:
            for s, e, end in chunks:
                out[:, :, s:e], lse[:, :, s:e] = FLASH_CPU(
                    q_sel[:, :, s:e], k[:, :, first:end], v[:, :, first:end],
                    attn_mask=causal_bias(positions[..., s:e] - first, end - first, q_sel.dtype))
            if first > 0:                                  # keys every query of the block sees
                bulk_out, bulk_lse = FLASH_CPU(q_sel[:, :, s0:e0], k[:, :, :first], v[:, :, :first])
                stair_out, stair_lse = out[:, :, s0:e0], lse[:, :, s0:e0]
                merged = torch.logaddexp(bulk_lse, stair_lse)
                out[:, :, s0:e0] = (bulk_out * (bulk_lse - merged).exp()[..., None].to(out.dtype)
                                    + stair_out * (stair_lse - merged).exp()[..., None].to(out.dtype))
                lse[:, :, s0:e0] = merged
        ctx.plan = plan
        ctx.offset = offset
        ctx.save_for_backward(q, k, v, slots, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, slots, out, lse = ctx.saved_tensors
        q_sel, positions = gather_slots(q, slots), slots + ctx.offset
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q_sel), torch.zeros_like(k), torch.zeros_like(v)
        for s0, e0, first, chunks in ctx.plan:
            calls = [(s, e, first, end, causal_bias(positions[..., s:e] - first, end - first, q_sel.dtype))
                     for s, e, end in chunks]
            # The unmasked keys in pieces: any split of the keys gives the same gradients with the merged
            # log-sum-exp, and a piece's key / value gradients are the only full-width temporaries of backward.
            calls += [(s0, e0, a, min(a + STAIRCASE_KEYS, first), None) for a in range(0, first, STAIRCASE_KEYS)]
            for s, e, key_start, key_end, mask in calls:
                gq, gk, gv = _FLASH_CPU_BACKWARD(
                    grad[:, :, s:e], q_sel[:, :, s:e], k[:, :, key_start:key_end], v[:, :, key_start:key_end],
                    out[:, :, s:e], lse[:, :, s:e], 0.0, False, attn_mask=mask)
                dq[:, :, s:e] += gq
                dk[:, :, key_start:key_end] += gk
                dv[:, :, key_start:key_end] += gv
        ctx.plan = None
        sequence, head = slot_index(q)
        grad_q = torch.zeros_like(q).index_put_((sequence, head, slots), dq, accumulate=True)
        return grad_q, dk, dv, None, None, None


def slot_index(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.arange(q.shape[0], device=q.device)[:, None, None],
            torch.arange(q.shape[1], device=q.device)[None, :, None])


def gather_slots(q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(B, E, N, d) queries at the slots' token rows (B, E, L): (B, E, L, d).

    Advanced indexing, not gather: gather is 5x slower on the strided q/k/v views of the qkv output.
    """
    return q[(*slot_index(q), slots)]


class _CausalChunks(torch.autograd.Function):
    """The chunks of ``causal_chunks`` with their key / value gradients summed in place.

    Left to autograd, every chunk's slice of the keys and values would get a full-size zero gradient to
    add up (40% of the backward at N = 1024). Here each chunk runs its own graph on detached inputs and
    backward adds the chunk gradients into one buffer. Within a chunk only SDPA's outputs are kept: its
    (B, E, rows, keys) mask is rebuilt in backward instead of living until then.
    """

    @staticmethod
    def forward(ctx, q_sel, k, v, chunks, dropout_p):
        graphs, outs = [], []
        with torch.enable_grad():
            for s, e, num_keys, positions, mask in chunks:
                inputs = tuple(t.detach().requires_grad_() for t in
                               (q_sel[:, :, s:e], k[:, :, :num_keys], v[:, :, :num_keys]))
                out = checkpoint(_causal_chunk, *inputs, positions, mask, dropout_p, use_reentrant=False,
                                 context_fn=_recompute_all_but_sdpa)
                graphs.append((s, e, num_keys, inputs, out))
                outs.append(out.detach())
        ctx.graphs = graphs
        ctx.shapes = (q_sel.shape, k.shape, v.shape)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad):
        dq, dk, dv = (grad.new_zeros(shape) for shape in ctx.shapes)
        for s, e, num_keys, inputs, out in ctx.graphs:
            gq, gk, gv = torch.autograd.grad(out, inputs, grad[:, :, s:e])
            dq[:, :, s:e] = gq
            dk[:, :, :num_keys] += gk
            dv[:, :, :num_keys] += gv
        ctx.graphs = None
        return dq, dk, dv, None, None


def _causal_chunk(q, k, v, positions, mask, dropout_p) -> torch.Tensor:
    bias = combine_masks(mask, causal_bias(positions, k.shape[2], q.dtype))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, enable_gqa=True)


def _save_sdpa_only(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SDPA_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_but_sdpa():
    return create_selective_checkpoint_contexts(_save_sdpa_only)
