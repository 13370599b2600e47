"""Head-sparse attention on CUDA: only the (token, head) pairs a MoH router selected, with GPU kernels.

The CPU path (``head_sparse_attention.py``) pads the gathered queries to the largest count over (sequence, head)
and reads that count back to the host, and its causal path cuts the staircase into chunks with float masks: on a
GPU the padding, the host read and the many small calls would eat the saving. Here the layouts have static sizes
and every kernel call is one call:

- Bidirectional (ViT, TransNeXt, DiT): the selected queries of each (sequence, kv head) are packed without padding
  (the query heads of a kv head share its keys, so their queries can share one varlen sequence) and attend against
  that sequence's full keys with variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``). The
  number of packed rows is the layer's budget, B * N * top_k, so nothing is read back to the host.
- Causal (LMs): FlashAttention's causal flag aligns queries and keys at the bottom right, which is wrong for
  gathered queries (a slot is not a position). FlexAttention takes the slots with a position buffer
  (``q_pos[b, h, slot] >= key``) and a ``BlockMask`` built from each query block's smallest and largest position:
  key blocks after the largest are skipped, those before the smallest need no mask, and query blocks that hold only
  padding cost nothing, so the slots can be laid out over all N positions with no host read.
- Decoding: one FlexAttention call over all heads whose ``BlockMask`` gives the unselected heads no key block, so
  only the selected heads read the KV cache, with no gather, no copy and no host read.

Shared heads go through SDPA as on the CPU. Anything these kernels cannot take (an arbitrary ``attn_mask``,
attention dropout, fp32 or key padding in the bidirectional varlen call) goes through the device-agnostic padded
path of ``head_sparse_attention``. As there, a pair whose gate is zero is skipped and its gate gets no gradient.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from moh_lightning.layers.head_sparse_attention import attend_all_queries, head_sparse_attention, split_kv

# Where ``auto`` runs head-sparse on CUDA, as ``benchmarks/attention_cuda.py`` measures it: (kind, minimum queries or
# cache length, largest active fraction). Empty: on an H200 the kernels won nowhere (results/bench_attention_cuda.md),
# so ``auto`` computes dense-and-mask on CUDA; ``execution: sparse`` forces this path.
CUDA_SPARSE: dict[str, tuple[int, float]] = {}
# FlexAttention's query and key block (its default): the unit in which key blocks are skipped.
FLEX_BLOCK = 128
# FlashAttention's varlen kernel takes half precision only.
VARLEN_DTYPES = (torch.float16, torch.bfloat16)

VarlenKernel = Callable[..., torch.Tensor]
FlexKernel = Callable[..., torch.Tensor]


def use_head_sparse_cuda(num_queries: int, num_keys: int, active_fraction: float, decoding: bool,
                         causal: bool) -> bool:
    """``auto`` on CUDA: head-sparse where ``CUDA_SPARSE`` measured it faster than dense-and-mask."""
    kind = "decode" if decoding and num_queries == 1 else "causal" if causal else "bidirectional"
    if kind not in CUDA_SPARSE:
        return False
    from_length, up_to_fraction = CUDA_SPARSE[kind]
    length = num_keys if kind == "decode" else num_queries
    return length >= from_length and active_fraction <= up_to_fraction


def head_sparse_attention_cuda(
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
        varlen: VarlenKernel | None = None,
        flex: FlexKernel | None = None,
) -> torch.Tensor:
    """Gated head outputs (B, N, h, d), as ``head_sparse_attention`` (same arguments and shapes), with CUDA kernels.

    ``varlen`` and ``flex`` replace torch's ``varlen_attn`` and (compiled) ``flex_attention``: the tests run the
    layouts on the CPU through reference kernels.
    """
    batch, num_heads, length, head_dim = q.shape
    num_keys, kv_group = k.shape[2], num_heads // k.shape[1]
    if attn_mask is not None or dropout_p > 0.0:
        return head_sparse_attention(q, k, v, gates, num_shared_heads, causal=causal, offset=offset,
                                     key_padding_mask=key_padding_mask, attn_mask=attn_mask, dropout_p=dropout_p,
                                     active_heads=active_heads)
    key_valid = None if key_padding_mask is None else key_padding_mask[:, :num_keys].bool()
    if length == 1 and (not causal or offset + 1 >= num_keys):
        mask = decode_block_mask(gates[:, 0] != 0, num_keys, key_valid)
        out = (flex or _compiled_flex())(q, k, v, block_mask=mask, enable_gqa=kv_group > 1)   # (B, h, 1, d)
        return (out * gates[:, 0, :, None, None].to(out.dtype)).transpose(1, 2)      # (B, 1, h, d)
    if not causal and (key_valid is not None or q.dtype not in VARLEN_DTYPES):
        return head_sparse_attention(q, k, v, gates, num_shared_heads, key_padding_mask=key_padding_mask,
                                     active_heads=active_heads)
    num_routed = num_heads - num_shared_heads
    q_groups = q.split([num_shared_heads, num_routed], dim=1)
    kv_groups = split_kv(k, v, num_shared_heads, kv_group)
    # Row b * N + i of one flat buffer per token, and a last row for the packed rows that hold no selected pair.
    out = q.new_zeros(batch * length + 1, num_heads, head_dim)
    if num_shared_heads:
        key_bias = None if key_valid is None else _bias(key_valid[:, None, None], q.dtype)
        shared = attend_all_queries(q_groups[0], *kv_groups[0], None, causal, offset, key_bias, 0.0)
        out[:batch * length].view(batch, length, num_heads, head_dim)[:, :, :num_shared_heads] = \
            shared.transpose(1, 2) * gates[..., :num_shared_heads, None]
    if num_routed:
        routed_gates = gates[..., num_shared_heads:]
        if causal:
            rows, heads, values = _causal_routed(q_groups[1], *kv_groups[1], routed_gates, offset, key_valid,
                                                 flex or _compiled_flex())
        else:
            budget = None if active_heads is None else active_heads - num_shared_heads
            rows, heads, values = _varlen_routed(q_groups[1], *kv_groups[1], routed_gates, budget,
                                                 varlen or _varlen_kernel())
        out[rows, num_shared_heads + heads] = values
    return out[:batch * length].view(batch, length, num_heads, head_dim)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, zero - float("inf"))


@functools.cache
def _compiled_flex() -> FlexKernel:
    """FlexAttention compiled (its fused kernels; eager FlexAttention materialises every score), with dynamic shapes
    from the first call: a decoding cache grows by one key per token, and every sequence length, batch and block
    count would otherwise cost a compilation of its own. Past torch's recompile limit (8 per function) FlexAttention
    falls back to its eager, materialising form: on an H200 that made the causal core 10-50x slower than SDPA."""
    return torch.compile(flex_attention, dynamic=True)


def _varlen_kernel() -> VarlenKernel:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def pack_selected(selected: torch.Tensor, kv_group: int, total: int):
    """Selected (sequence, routed head, token) pairs packed into varlen sequences, one per (sequence, kv head).

    ``selected`` (B, E, N) with the E routed heads in kv-head order (E = E_kv * ``kv_group``); ``total`` is the
    number of packed rows, at least the number of selected pairs (the layer's B * N * top_k: a static size, no host
    read). Returns ``source`` (total,): the flat (b, e, n) index of each packed row's pair (0 past the last selected
    one), ``cu_seq_q`` (B * E_kv + 1,) int32 and ``filled`` (total,): whether the row holds a selected pair.
    """
    batch, heads, length = selected.shape
    flat = selected.reshape(-1)
    rank = flat.cumsum(0) - 1                                                       # packed row of each pair
    dump = torch.full_like(rank, total)
    source = torch.zeros(total + 1, dtype=torch.long, device=selected.device)
    source.scatter_(0, torch.where(flat, rank, dump), torch.arange(flat.numel(), device=selected.device))
    counts = selected.reshape(batch * heads // kv_group, kv_group * length).sum(-1)
    cu_seq_q = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    filled = torch.arange(total, device=selected.device) < cu_seq_q[-1]
    return source[:total], cu_seq_q, filled


def _varlen_routed(q, k, v, gates, budget: int | None, varlen: VarlenKernel):
    """The routed heads' selected queries in one varlen call. Returns the token rows, routed heads and gated values of
    the packed rows (rows past the selected pairs go to the dump row B * N)."""
    batch, num_routed, length, head_dim = q.shape
    num_kv, num_keys = k.shape[1], k.shape[2]
    selected = (gates != 0).transpose(1, 2)                                         # (B, E, N)
    total = batch * length * budget if budget is not None else int(selected.sum())
    source, cu_seq_q, filled = pack_selected(selected, num_routed // num_kv, total)
    b, e, n = source // (num_routed * length), source // length % num_routed, source % length
    cu_seq_k = torch.arange(batch * num_kv + 1, device=q.device, dtype=torch.int32) * num_keys
    packed = varlen(q[b, e, n][:, None], k.reshape(-1, 1, head_dim), v.reshape(-1, 1, head_dim), cu_seq_q,
                    cu_seq_k, num_routed // num_kv * length, num_keys)[:, 0]          # (total, d)
    # Rows past the selected pairs are never written by the kernel: zeroed, so that nothing (not even a NaN times a
    # zero gradient) reaches the gate they borrow.
    values = torch.where(filled[:, None], packed, 0.0) * gates[b, n, e][:, None]
    return torch.where(filled, b * length + n, batch * length), e, values


def causal_slots(selected: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of each (sequence, routed head)'s selected queries, in position order over all N slots.

    Returns the token of each slot (B, E, N) and its position ``offset + token``, -1 for padding slots, which see no
    key (the position buffer of the FlexAttention mask). A padding slot gathers the token of its own index, so no
    token is gathered more than twice: the gathers' backward on CUDA serialises repeated indices, and with every
    padding slot on token 0 it took 2 ms of a 4096-token layer step on an H200 (profiled).
    """
    length = selected.shape[-1]
    rank = torch.where(selected, selected.cumsum(-1) - 1, length)                  # slot of each selected token
    tokens = torch.arange(length, device=selected.device).expand_as(rank)
    token = selected.new_zeros(*selected.shape[:-1], length + 1, dtype=torch.long).scatter(-1, rank, tokens)
    real = selected.new_zeros(*selected.shape[:-1], length + 1).scatter(-1, rank, selected)
    token, real = token[..., :length], real[..., :length]
    token = torch.where(real, token, tokens)
    return token, torch.where(real, token + offset, -1)


def causal_block_mask(q_pos: torch.Tensor, num_keys: int, key_valid: torch.Tensor | None = None,
                      block: int = FLEX_BLOCK) -> BlockMask:
    """FlexAttention's mask for gathered causal queries: slot i of (b, h) sees key j when ``q_pos[b, h, i] >= j``
    (and ``key_valid[b, j]``).

    Per query block, the key blocks up to the one holding its largest position are visited; those wholly at or
    before its smallest position need no mask (with no key padding); a block of padding slots visits none.
    """
    batch, heads, length = q_pos.shape
    q_blocks, k_blocks = -(-length // block), -(-num_keys // block)
    pos = F.pad(q_pos, (0, q_blocks * block - length), value=-1).view(batch, heads, q_blocks, block)
    largest = pos.amax(-1)
    smallest = torch.where(pos >= 0, pos, num_keys).amin(-1)
    visited = torch.where(largest >= 0, largest.clamp(max=num_keys - 1) // block + 1, 0)
    full = torch.zeros_like(visited) if key_valid is not None else \
        torch.where(largest >= 0, (smallest.clamp(max=num_keys - 1) + 1) // block, 0).minimum(visited)
    index = torch.arange(k_blocks, device=q_pos.device)
    partial_index = (full[..., None] + index).clamp(max=k_blocks - 1)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_pos[b, h, q_idx] >= kv_idx
        return allowed if key_valid is None else allowed & key_valid[b, kv_idx]

    return BlockMask.from_kv_blocks(
        (visited - full).to(torch.int32), partial_index.to(torch.int32), full.to(torch.int32),
        index.expand(batch, heads, q_blocks, k_blocks).to(torch.int32), BLOCK_SIZE=block, mask_mod=mask_mod,
        seq_lengths=(length, num_keys))


def decode_block_mask(on: torch.Tensor, num_keys: int, key_valid: torch.Tensor | None = None,
                      block: int = FLEX_BLOCK) -> BlockMask:
    """FlexAttention's mask for one decoding query per sequence: head h of sequence b reads its cache only when
    ``on[b, h]`` (its gate is nonzero); the others visit no key block and come out zero."""
    batch, heads = on.shape
    k_blocks = -(-num_keys // block)
    visited = torch.where(on, k_blocks, 0)[..., None].to(torch.int32)              # (B, h, 1)
    index = torch.arange(k_blocks, device=on.device, dtype=torch.int32).expand(batch, heads, 1, k_blocks)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = on[b, h] & (q_idx >= 0)
        return allowed if key_valid is None else allowed & key_valid[b, kv_idx]

    return BlockMask.from_kv_blocks(visited, index, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(1, num_keys))


def _causal_routed(q, k, v, gates, offset: int, key_valid: torch.Tensor | None, flex: FlexKernel):
    """The routed heads' selected queries, causal, in one FlexAttention call over their slots."""
    batch, num_routed, length, _ = q.shape
    selected = (gates != 0).transpose(1, 2)                                         # (B, E, N)
    token, q_pos = causal_slots(selected, offset)
    sequence = torch.arange(batch, device=q.device)[:, None, None]
    head = torch.arange(num_routed, device=q.device)[None, :, None]
    mask = causal_block_mask(q_pos, k.shape[2], key_valid)
    out = flex(q[sequence, head, token], k, v, block_mask=mask, enable_gqa=k.shape[1] != num_routed)  # (B, E, N, d)
    values = out * gates[sequence, token, head][..., None]
    rows = torch.where(q_pos >= 0, sequence * length + token, batch * length)
    return rows, head.expand_as(rows), values
