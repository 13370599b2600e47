"""Attention computed only for the (token, head) pairs a MoH router selected.

The dense MoH formulation runs every head on every token and multiplies the unselected outputs by a zero
gate, so it costs a full multi-head layer. Here the shared heads (always on) go through SDPA unchanged, and
each routed head gathers its selected queries, attends with them against its full keys and values, and
scatters the gated outputs back. The gathered queries are padded to the largest count over (batch, head) so
one SDPA call serves every routed head. Measured on CPU (N = 1024, batch 4, 6 routed heads, 1/3 selected)
against this padded call's 38 ms: a call per head 131 ms, nested jagged tensors 1.8 s, flex_attention
256 ms eager and no faster than dense SDPA compiled (a per-query mask skips no key block).

Causal attention cannot use SDPA's ``is_causal`` on gathered queries (a query's slot is not its position),
so the slots are cut into chunks, each attending only to the keys up to its last query's position with a
float mask built from the positions; the chunks' masks are recomputed in backward instead of being kept.
A single decoding token (KV cache) reads only the cache rows of its selected heads, one pair of
matrix-vector products per selected (sequence, head) on views of the cache: gathering those rows first would
copy more memory than dense attention reads.

Pairs whose gate is zero are skipped; their gate receives no gradient. That matches the dense formulation
exactly whenever the gate's own derivative is zero there, as for the learned router (its unselected gates
are products with a zero top-k indicator), but not for a straight-through router.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Where the head-sparse path wins, measured on CPU by `moh bench` (2 shared of 8 heads, random routing):
# from ~512 queries at <= 75% active heads (at 256 it breaks even, at 7 of 8 heads gathering costs what the
# skipped head saves), and for a decoding token from ~1024 cached keys.
MIN_SPARSE_QUERIES = 512
MAX_SPARSE_FRACTION = 0.8
MIN_SPARSE_DECODE_KEYS = 1024
# Rows of gathered queries per causal chunk: smaller chunks waste less of each chunk's diagonal block,
# larger ones make fewer SDPA calls.
CAUSAL_CHUNK = 64

_aten = torch.ops.aten
_SDPA_KERNELS = tuple(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
) if hasattr(_aten, name))


def use_head_sparse(execution: str, num_queries: int, num_keys: int, active_fraction: float,
                    decoding: bool) -> bool:
    """Whether to run the head-sparse path: forced by ``execution``, else chosen from the shapes."""
    if execution != "auto":
        return execution == "sparse"
    if active_fraction >= 1.0:
        return False
    if decoding and num_queries == 1:
        return num_keys >= MIN_SPARSE_DECODE_KEYS
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
) -> torch.Tensor:
    """Gated head outputs (B, N, h, d) = ``sdpa(q, k, v) * gates``, computed only where a gate is nonzero.

    ``q`` (B, h, N, d), ``k, v`` (B, h_kv, M, d) with h a multiple of h_kv (grouped-query attention), ``gates``
    (B, N, h) with heads ``0..num_shared_heads-1`` always on. Query i sits at position ``offset + i`` for
    ``causal`` masking (keys from a KV cache come first). ``key_padding_mask`` (B, >= M) is True for real keys;
    ``attn_mask`` is SDPA's mask, broadcastable to (B, h, N, M).
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
        return _decode(q, k, v, gates, kv_group, key_bias)                     # sees every key
    args = (causal, offset, key_bias, dropout_p)
    num_routed = num_heads - num_shared_heads
    # split, not slicing: backward then concatenates the groups' gradients instead of adding full-size ones.
    q_groups = q.split([num_shared_heads, num_routed], dim=1)
    kv_groups = _split_kv(k, v, num_shared_heads, kv_group)
    mask_groups = (None, None) if head_mask is None else head_mask.split([num_shared_heads, num_routed], dim=1)
    # Row N collects the outputs of the routed heads' padding slots and is cut off at the end.
    out = q.new_zeros(batch, length + 1, num_heads, head_dim)
    if num_shared_heads:
        shared = _attend_all(q_groups[0], *kv_groups[0], mask_groups[0], *args)           # (B, h_s, N, d)
        out[:, :length, :num_shared_heads] = shared.transpose(1, 2) * gates[..., :num_shared_heads, None]
    if num_routed:
        selected = _attend_routed(q_groups[1], *kv_groups[1], gates[..., num_shared_heads:], mask_groups[1],
                                  *args)
        if selected is not None:
            rows, values = selected
            sequence = torch.arange(batch, device=q.device)[:, None, None]
            head = torch.arange(num_shared_heads, num_heads, device=q.device)[None, :, None]
            out[sequence, rows, head] = values                # index_put: 4x faster than scatter here
    return out[:, :length]


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask: SDPA converts a boolean mask on every call, which costs as much as building it."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, zero - float("inf"))


def _split_kv(k: torch.Tensor, v: torch.Tensor, num_shared_heads: int, kv_group: int) -> list[tuple]:
    """Keys and values serving the shared and the routed query heads, for SDPA's ``enable_gqa``.

    Split views when the groups align with the kv heads, else each query head's kv head copied.
    """
    num_heads = k.shape[1] * kv_group
    if num_shared_heads % kv_group == 0:
        sizes = [num_shared_heads // kv_group, (num_heads - num_shared_heads) // kv_group]
        return list(zip(k.split(sizes, dim=1), v.split(sizes, dim=1)))
    index = torch.arange(num_heads, device=k.device) // kv_group
    return [(k.index_select(1, part), v.index_select(1, part))
            for part in index.split([num_shared_heads, num_heads - num_shared_heads])]


def _attend_all(q, k, v, head_mask, causal, offset, key_bias, dropout_p) -> torch.Tensor:
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
    batch, num_routed, length, head_dim = q.shape
    selected = (gates != 0).transpose(1, 2)                                        # (B, E, N)
    slot = selected.cumsum(-1) - 1                                                 # slot of each selected token
    count = slot[..., -1] + 1                                                      # (B, E)
    width = int(count.max())
    if width == 0:
        return None
    # Queries sorted by position into slots 0..count-1; padding slots take the last position, which is
    # never fully masked, and their outputs go to the dump row N.
    tokens = torch.arange(length, device=q.device).expand_as(slot)
    positions = torch.full((batch, num_routed, width + 1), length - 1, dtype=torch.long, device=q.device)
    positions = positions.scatter(-1, torch.where(selected, slot, width), tokens)[..., :width]   # (B, E, L)
    real = torch.arange(width, device=q.device) < count[..., None]                 # (B, E, L)

    # Advanced indexing, not gather: gather is 5x slower on the strided q/k/v views of the qkv output.
    sequence = torch.arange(batch, device=q.device)[:, None, None]
    head = torch.arange(num_routed, device=q.device)[None, :, None]
    q_sel = q[sequence, head, positions]                                           # (B, E, L, d)
    mask = None if head_mask is None else head_mask[sequence, head, positions]     # (B, E, L, M)
    mask = _combine(mask, key_bias)
    if causal:
        out = _causal_chunks(q_sel, k, v, positions + offset, real, mask, dropout_p)
    else:
        out = F.scaled_dot_product_attention(q_sel, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=True)
    out = out * gates[sequence, positions, head][..., None]
    return torch.where(real, positions, length), out                              # token rows (N = dump), outputs


def _causal_chunks(q_sel, k, v, positions, real, mask, dropout_p) -> torch.Tensor:
    """Causal SDPA of gathered queries by chunks of slots, each over the keys its latest query can see."""
    width = q_sel.shape[2]
    last = torch.where(real, positions, 0)
    bounds = [(s, min(s + CAUSAL_CHUNK, width)) for s in range(0, width, CAUSAL_CHUNK)]
    key_ends = torch.stack([last[..., s:e].amax() for s, e in bounds]).add(1).clamp_max(k.shape[2]).tolist()
    chunks = []
    for (s, e), num_keys in zip(bounds, key_ends):
        chunk_mask = None if mask is None else mask[..., s:e, :num_keys] if mask.shape[-2] > 1 \
            else mask[..., :num_keys]
        chunks.append((s, e, num_keys, positions[..., s:e], chunk_mask))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_sel, k, v)):
        return _CausalChunks.apply(q_sel, k, v, chunks, dropout_p)
    return torch.cat([_causal_chunk(q_sel[:, :, s:e], k[:, :, :n], v[:, :, :n], pos, m, dropout_p)
                      for s, e, n, pos, m in chunks], dim=2)


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


def _decode(q, k, v, gates, kv_group, key_bias) -> torch.Tensor:
    """One query per sequence: each selected (sequence, head) pair attends over views of its own cache rows.

    Written as two matrix-vector products per pair: an SDPA call per pair costs more in kernel setup than
    the single query's attention itself (measured 1.4x slower at a 4096-token cache, and far slower when
    other processes share the cores), and gathering the pairs' cache rows into one batch copies more memory
    than dense attention reads.
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
