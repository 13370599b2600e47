"""Attention computed only for the (token, head) pairs a MoH router selected.

The dense MoH formulation runs every head on every token and multiplies the unselected outputs by a zero
gate, so it costs a full multi-head layer. Here the shared heads (always on) go through SDPA unchanged, and
each routed head gathers its selected queries, attends with them against its full keys and values, and
scatters the gated outputs back. The gathered queries are padded to the largest count over (batch, head) so
one SDPA call serves every routed head. Measured on CPU (N = 1024, batch 4, 6 routed heads, 1/3 selected)
against this padded call's 38 ms: a call per head 131 ms, nested jagged tensors 1.8 s, flex_attention
256 ms eager and no faster than dense SDPA compiled (a per-query mask skips no key block).

Causal attention cannot use SDPA's ``is_causal`` on gathered queries (a query's slot is not its position).
Its slots are laid out in blocks of ``CAUSAL_BLOCK`` positions, each padded to its largest count over (batch, head)
(``_slot_layout``). On CPU (no dropout, no extra mask, as many key heads as query heads) the keys before a block's
first position are visible to every query of the block and go through one unmasked flash-attention call, and only
the staircase inside the block is cut into ``CAUSAL_CHUNK`` rows with a positional float mask; the parts are merged
through their log-sum-exp, and backward runs the flash kernel's own backward on each part with the merged output
(``_CausalStaircase``). Elsewhere the slots are cut into chunks that each attend to every key up to their last
position with the mask (``_causal_chunks``). The block widths and the chunk plan cost one host read per layer (the
sparse path's only data-dependent sizes).

A single decoding token (KV cache) reads only the cache rows of its selected heads. On CPU that is one pair of
matrix-vector products per selected (sequence, head) on views of the cache: gathering those rows first would copy
more memory than dense attention reads. On other devices, where a Python loop over pairs and its host read would
stall the device, the selected heads' queries and cache rows are gathered into one batched SDPA call
(``decode_batched``), with the number of active heads given by the layer so that nothing is read back.

Pairs whose gate is zero are skipped; their gate receives no gradient. That matches the dense formulation
exactly whenever the gate's own derivative is zero there, as for the learned router (its unselected gates
are products with a zero top-k indicator), but not for a straight-through router.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Where the head-sparse path wins, measured on CPU by `moh bench` (2 shared of 8 heads of 64, random routing): from
# ~512 queries at <= 75% active heads (at 256 it breaks even, at 7 of 8 heads gathering costs what the skipped head
# saves).
MIN_SPARSE_QUERIES = 512
MAX_SPARSE_FRACTION = 0.8
# A decoding token, by torch's thread count: (cache length from, active fraction up to) where the whole layer decoded
# head-sparse faster than dense-and-mask (batch 4, medians of 60 steps). One thread: 1.30x / 1.02x at 50% / 75% of
# heads from a 2048-key cache, 1.56x / 1.19x / 1.06x at 50% / 75% / 88% from 4096; at 1024 only 50% gains (1.09x).
# Two threads, where dense decoding splits its cache reads over the cores and the per-pair products barely do:
# 50% 1.09-1.28x from 4096 to 16384 keys (at 2048 0.95x in one run, 1.19x in another), 75% 0.79-0.90x. More
# threads are unmeasured: dense.
SPARSE_DECODE = {1: ((2048, 0.75), (4096, 0.9)), 2: ((4096, 0.5),)}
# Rows of gathered queries per causal chunk: smaller chunks waste less of each chunk's diagonal block,
# larger ones make fewer SDPA calls.
CAUSAL_CHUNK = 64
# Positions per block of causal slots, whose keys before the block take one unmasked call (CPU causal path):
# smaller blocks shrink the masked staircase, larger ones the padding to each block's largest count.
CAUSAL_BLOCK = 512
# Keys per backward call over a block's unmasked keys: bounds the key / value gradient temporaries.
STAIRCASE_KEYS = 1024

_aten = torch.ops.aten
_FLASH_CPU = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_SDPA_KERNELS = tuple(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
) if hasattr(_aten, name))


def use_head_sparse(execution: str, num_queries: int, num_keys: int, active_fraction: float,
                    decoding: bool, device_type: str = "cpu") -> bool:
    """Whether to run the head-sparse path: forced by ``execution``, else chosen from the shapes.

    ``auto`` decodes head-sparse on the CPU where ``SPARSE_DECODE`` measured it faster. Off the CPU it decodes
    dense-and-mask: the batched decode copies the selected heads' cache rows before reading them, 1.5x dense
    attention's memory traffic at half the heads, and decoding is memory-bound.
    """
    if execution != "auto":
        return execution == "sparse"
    if active_fraction >= 1.0:
        return False
    if decoding and num_queries == 1:
        return device_type == "cpu" and any(num_keys >= keys and active_fraction <= fraction
                                            for keys, fraction in SPARSE_DECODE.get(torch.get_num_threads(), ()))
    return num_queries >= MIN_SPARSE_QUERIES and active_fraction <= MAX_SPARSE_FRACTION


def head_sparse_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gates: torch.Tensor,
        num_shared_heads: int,
        *,
        causal: bool = False,
        offset: int = 0,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        active_heads: int | None = None,
) -> torch.Tensor:
    """Gated head outputs (B, N, h, d) = ``sdpa(q, k, v) * gates``, computed only where a gate is nonzero.

    ``q`` (B, h, N, d), ``k, v`` (B, h_kv, M, d) with h a multiple of h_kv (grouped-query attention), ``gates``
    (B, N, h) with heads ``0..num_shared_heads-1`` always on. Query i sits at position ``offset + i`` for
    ``causal`` masking (keys from a KV cache come first). ``key_padding_mask`` (B, >= M) is True for real keys;
    ``attn_mask`` is SDPA's mask, broadcastable to (B, h, N, M). ``active_heads``: at most this many gates per token
    are nonzero (the layer's h_s + k), which spares the batched decode a host read.
    """
    batch, num_heads, length, head_dim = q.shape
    kv_group = num_heads // k.shape[1]
    key_bias = None
    if key_padding_mask is not None:
        key_bias = _bias(key_padding_mask[:, None, None, :k.shape[2]].bool(), q.dtype)   # (B, 1, 1, M)
    head_mask = None
    if attn_mask is not None:
        head_mask = attn_mask if attn_mask.dtype != torch.bool else _bias(attn_mask, q.dtype)
        head_mask = head_mask.expand(batch, num_heads, length, k.shape[2])
    if length == 1 and head_mask is None and dropout_p == 0.0 and (not causal or offset + 1 >= k.shape[2]):
        if q.device.type == "cpu":
            return _decode_pairs(q, k, v, gates, kv_group, key_bias)           # sees every key
        return decode_batched(q, k, v, gates, kv_group, key_bias, active_heads)
    args = (causal, offset, key_bias, dropout_p)
    num_routed = num_heads - num_shared_heads
    # split, not slicing: backward then concatenates the groups' gradients instead of adding full-size ones.
    q_groups = q.split([num_shared_heads, num_routed], dim=1)
    kv_groups = split_kv(k, v, num_shared_heads, kv_group)
    mask_groups = (None, None) if head_mask is None else head_mask.split([num_shared_heads, num_routed], dim=1)
    # Rows b * N + i of one flat buffer, and a last row that collects the outputs of the routed heads' padding
    # slots: the (B, N, h, d) result is then a view of the buffer, not a copy of it.
    out = q.new_zeros(batch * length + 1, num_heads, head_dim)
    if num_shared_heads:
        shared = attend_all_queries(q_groups[0], *kv_groups[0], mask_groups[0], *args)           # (B, h_s, N, d)
        out[:batch * length].view(batch, length, num_heads, head_dim)[:, :, :num_shared_heads] = \
            shared.transpose(1, 2) * gates[..., :num_shared_heads, None]
    if num_routed:
        selected = _attend_routed(q_groups[1], *kv_groups[1], gates[..., num_shared_heads:], mask_groups[1],
                                  *args)
        if selected is not None:
            rows, values = selected                                                   # rows: N for padding
            sequence = torch.arange(batch, device=q.device)[:, None, None]
            rows = torch.where(rows < length, sequence * length + rows, batch * length)
            head = torch.arange(num_shared_heads, num_heads, device=q.device)[None, :, None]
            out[rows, head] = values                          # index_put: 4x faster than scatter here
    return out[:batch * length].view(batch, length, num_heads, head_dim)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask: SDPA converts a boolean mask on every call, which costs as much as building it."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, zero - float("inf"))


def split_kv(k: torch.Tensor, v: torch.Tensor, num_shared_heads: int, kv_group: int) -> list[tuple]:
    """Keys and values serving the shared and the routed query heads, for SDPA's ``enable_gqa``.

    Split views when the groups align with the kv heads, else each query head's kv head copied.
    """
    num_heads = k.shape[1] * kv_group
    if num_shared_heads % kv_group == 0:
        sizes = [num_shared_heads // kv_group, (num_heads - num_shared_heads) // kv_group]
        return list(zip(k.split(sizes, dim=1), v.split(sizes, dim=1), strict=True))
    index = torch.arange(num_heads, device=k.device) // kv_group
    return [(k.index_select(1, part), v.index_select(1, part))
            for part in index.split([num_shared_heads, num_heads - num_shared_heads])]


def attend_all_queries(q, k, v, head_mask, causal, offset, key_bias, dropout_p) -> torch.Tensor:
    """Every query of the given (shared) heads: plain SDPA, with SDPA's own causal block skipping when it can."""
    length, num_keys = q.shape[2], k.shape[2]
    if causal and key_bias is None and head_mask is None and offset == 0 and length == num_keys:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=True)
    mask = _combine(head_mask, key_bias)
    if causal:
        positions = torch.arange(length, device=q.device) + offset
        mask = _combine(mask, _causal_bias(positions, num_keys, q.dtype))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=True)


def _combine(mask: torch.Tensor | None, other: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None or other is None:
        return other if mask is None else mask
    return mask + other


def _causal_bias(positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """(..., L, num_keys) float mask letting the query at each position see the keys at or before it.

    Built arithmetically, min(max(key - position, 0), 1) * the dtype's lowest value, which is 4x faster on
    CPU than comparing and selecting; a finite lowest value masks exactly like -inf because every query sees
    at least itself. Positions are compared in fp32, exact up to 2^24.
    """
    keys = torch.arange(num_keys, device=positions.device, dtype=torch.float32)
    bias = (keys - positions[..., None].float()).clamp_(0, 1).mul_(torch.finfo(dtype).min)
    return bias.to(dtype)


def _attend_routed(q, k, v, gates, head_mask, causal, offset, key_bias, dropout_p):
    """Routed heads on their selected queries only: the token row of each slot (B, E, L) and its gated output
    (None when no token selected any routed head)."""
    num_routed, length = q.shape[1], q.shape[2]
    selected = (gates != 0).transpose(1, 2)                                        # (B, E, N)
    positions, real, widths, chunk_last = _slot_layout(selected, CAUSAL_BLOCK if causal else length, causal)
    values = torch.cat([widths, chunk_last]).tolist()                              # the one host read
    widths, chunk_last = values[:len(widths)], values[len(widths):]
    width = sum(widths)
    if width == 0:
        return None
    positions, real = positions[..., :width], real[..., :width]                     # (B, E, L)

    sequence, head = _slot_index(q)
    mask = None if head_mask is None else head_mask[sequence, head, positions]     # (B, E, L, M)
    mask = _combine(mask, key_bias)
    if causal:
        plan = _causal_plan(widths, chunk_last, offset, k.shape[2])
    if causal and (_FLASH_CPU is not None and q.device.type == "cpu" and mask is None and dropout_p == 0.0
                   and k.shape[1] == num_routed):
        out = _CausalStaircase.apply(q, k, v, positions, offset, plan)
    elif causal:
        chunks = [chunk for *_, block_chunks in plan for chunk in block_chunks]
        out = _causal_chunks(_gather_slots(q, positions), k, v, positions + offset, mask, dropout_p, chunks)
    else:
        out = F.scaled_dot_product_attention(_gather_slots(q, positions), k, v, attn_mask=mask, dropout_p=dropout_p,
                                             enable_gqa=True)
    out = out * gates[sequence, positions, head][..., None]
    return torch.where(real, positions, length), out                              # token rows (N = dump), outputs


def _slot_layout(selected: torch.Tensor, block: int, chunked: bool):
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


def _causal_plan(widths: list[int], chunk_last: list[int], offset: int, num_keys: int) -> list:
    """[(first slot, end slot, first position, [(chunk start, chunk end, key end), ...]), ...] per nonempty block of
    ``_slot_layout``: the chunks of ``CAUSAL_CHUNK`` slots and the keys their latest query sees."""
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


def _causal_chunks(q_sel, k, v, positions, mask, dropout_p, plan) -> torch.Tensor:
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


class _CausalStaircase(torch.autograd.Function):
    """Causal attention of gathered queries (CPU flash kernel): per block of ``_slot_layout``, the keys before the
    block's first position in one unmasked call, the staircase after it by ``CAUSAL_CHUNK`` rows with a positional
    mask, merged through their log-sum-exp.

    Against chunks that each attend to every key up to their last position (``_causal_chunks``), most of the work
    runs in large unmasked calls, where the CPU kernel is fastest, and the masks shrink to the staircase. The
    backward is the flash kernel's own, called for each part with the merged output and log-sum-exp (the
    decomposition ring attention uses), so nothing but the merged output and its log-sum-exp is kept; the masks are
    rebuilt. ``k`` and ``v`` have one head per query head; no dropout, no other mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, slots, offset, plan):
        q_sel = _gather_slots(q, slots)                                           # (B, E, L, d), not kept
        positions = slots + offset
        out = q_sel.new_empty(q_sel.shape)
        lse = q_sel.new_empty(q_sel.shape[:3], dtype=torch.float32)
        for s0, e0, first, chunks in plan:
            for s, e, end in chunks:
                out[:, :, s:e], lse[:, :, s:e] = _FLASH_CPU(
                    q_sel[:, :, s:e], k[:, :, first:end], v[:, :, first:end],
                    attn_mask=_causal_bias(positions[..., s:e] - first, end - first, q_sel.dtype))
            if first > 0:                                  # keys every query of the block sees
                bulk_out, bulk_lse = _FLASH_CPU(q_sel[:, :, s0:e0], k[:, :, :first], v[:, :, :first])
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
        q_sel, positions = _gather_slots(q, slots), slots + ctx.offset
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q_sel), torch.zeros_like(k), torch.zeros_like(v)
        for s0, e0, first, chunks in ctx.plan:
            calls = [(s, e, first, end, _causal_bias(positions[..., s:e] - first, end - first, q_sel.dtype))
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
        sequence, head = _slot_index(q)
        grad_q = torch.zeros_like(q).index_put_((sequence, head, slots), dq, accumulate=True)
        return grad_q, dk, dv, None, None, None


def _slot_index(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.arange(q.shape[0], device=q.device)[:, None, None],
            torch.arange(q.shape[1], device=q.device)[None, :, None])


def _gather_slots(q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(B, E, N, d) queries at the slots' token rows (B, E, L): (B, E, L, d).

    Advanced indexing, not gather: gather is 5x slower on the strided q/k/v views of the qkv output.
    """
    return q[(*_slot_index(q), slots)]


class _CausalChunks(torch.autograd.Function):
    """The chunks of ``_causal_chunks`` with their key / value gradients summed in place.

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
    bias = _combine(mask, _causal_bias(positions, k.shape[2], q.dtype))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, enable_gqa=True)


def _save_sdpa_only(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SDPA_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_but_sdpa():
    return create_selective_checkpoint_contexts(_save_sdpa_only)


def _decode_pairs(q, k, v, gates, kv_group, key_bias) -> torch.Tensor:
    """One query per sequence: each selected (sequence, head) pair attends over views of its own cache rows.

    Written as two matrix-vector products per pair: an SDPA call per pair costs more in kernel setup than
    the single query's attention itself (measured 1.4x slower at a 4096-token cache, and far slower when
    other processes share the cores), and gathering the pairs' cache rows into one batch copies more memory
    than dense attention reads. For the CPU: the pairs come back to the host (``.tolist()``).
    """
    batch, num_heads, _, head_dim = q.shape
    pairs = gates[:, 0].nonzero().tolist()                                          # [(b, head), ...]
    outs = []
    for b, head in pairs:
        scores = k[b, head // kv_group] @ (q[b, head, 0] * head_dim ** -0.5)        # (M,)
        if key_bias is not None:
            scores = scores + key_bias[b, 0, 0]
        outs.append(scores.softmax(-1) @ v[b, head // kv_group])                    # (d,)
    out = q.new_zeros(batch, num_heads, head_dim)
    if pairs:
        b, head = torch.tensor(pairs, device=q.device).unbind(1)
        out = out.index_put((b, head), torch.stack(outs) * gates[b, 0, head, None])
    return out[:, None]                                                            # (B, 1, h, d)


def decode_batched(q, k, v, gates, kv_group, key_bias, active_heads: int | None = None) -> torch.Tensor:
    """One query per sequence, for devices where a loop over pairs stalls: the ``active_heads`` selected heads of
    each sequence (their queries and their cache rows, gathered) in one batched SDPA call, nothing read back to the
    host when ``active_heads`` is given. Heads whose gate is zero may fill the batch; their output is gated away.
    """
    batch, num_heads, _, head_dim = q.shape
    on = gates[:, 0] != 0                                                           # (B, h)
    if active_heads is None:
        active_heads = int(on.sum(-1).max())
    active_heads = min(active_heads, num_heads)
    heads = on.to(q.dtype).topk(active_heads, dim=-1).indices                      # (B, A): selected ones first
    sequence = torch.arange(batch, device=q.device)[:, None]
    rows = heads // kv_group
    out = F.scaled_dot_product_attention(q[sequence, heads], k[sequence, rows], v[sequence, rows],
                                         attn_mask=key_bias)                       # (B, A, 1, d)
    values = out[:, :, 0] * gates[:, 0].gather(1, heads)[..., None]
    return q.new_zeros(batch, num_heads, head_dim).index_put((sequence, heads), values)[:, None]   # (B, 1, h, d)
