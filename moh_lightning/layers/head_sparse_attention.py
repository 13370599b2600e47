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
(``slot_layout``). On CPU (no dropout, no extra mask, as many key heads as query heads) the keys before a block's
first position are visible to every query of the block and go through one unmasked flash-attention call, and only
the staircase inside the block is cut into ``CAUSAL_CHUNK`` rows with a positional float mask; the parts are merged
through their log-sum-exp, and backward runs the flash kernel's own backward on each part with the merged output
(``CausalStaircase``). Elsewhere the slots are cut into chunks that each attend to every key up to their last
position with the mask (``causal_chunks``). The block widths and the chunk plan cost one host read per layer (the
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

from moh_lightning.layers import head_sparse_causal
from moh_lightning.layers.head_sparse_causal import (
    FLASH_CPU,
    CausalStaircase,
    causal_bias,
    causal_chunks,
    combine_masks,
    gather_slots,
    slot_index,
    slot_layout,
)

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
    mask = combine_masks(head_mask, key_bias)
    if causal:
        positions = torch.arange(length, device=q.device) + offset
        mask = combine_masks(mask, causal_bias(positions, num_keys, q.dtype))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=True)






def _attend_routed(q, k, v, gates, head_mask, causal, offset, key_bias, dropout_p):
    """Routed heads on their selected queries only: the token row of each slot (B, E, L) and its gated output
    (None when no token selected any routed head)."""
    num_routed, length = q.shape[1], q.shape[2]
    selected = (gates != 0).transpose(1, 2)                                        # (B, E, N)
    block = head_sparse_causal.CAUSAL_BLOCK if causal else length
    positions, real, widths, chunk_last = slot_layout(selected, block, causal)
    values = torch.cat([widths, chunk_last]).tolist()                              # the one host read
    widths, chunk_last = values[:len(widths)], values[len(widths):]
    width = sum(widths)
    if width == 0:
        return None
    positions, real = positions[..., :width], real[..., :width]                     # (B, E, L)

    sequence, head = slot_index(q)
    mask = None if head_mask is None else head_mask[sequence, head, positions]     # (B, E, L, M)
    mask = combine_masks(mask, key_bias)
    if causal:
        plan = head_sparse_causal.causal_plan(widths, chunk_last, offset, k.shape[2])
    if causal and (FLASH_CPU is not None and q.device.type == "cpu" and mask is None and dropout_p == 0.0
                   and k.shape[1] == num_routed):
        out = CausalStaircase.apply(q, k, v, positions, offset, plan)
    elif causal:
        chunks = [chunk for *_, block_chunks in plan for chunk in block_chunks]
        out = causal_chunks(gather_slots(q, positions), k, v, positions + offset, mask, dropout_p, chunks)
    else:
        out = F.scaled_dot_product_attention(gather_slots(q, positions), k, v, attn_mask=mask, dropout_p=dropout_p,
                                             enable_gqa=True)
    out = out * gates[sequence, positions, head][..., None]
    return torch.where(real, positions, length), out                              # token rows (N = dump), outputs


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
