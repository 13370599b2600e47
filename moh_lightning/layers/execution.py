"""How a MoH layer computes its heads: the one dispatch between dense-and-mask and the head-sparse backends.

Apart from the block so that ``MoHAttention`` knows nothing of devices: ``execution`` (``auto`` / ``masked`` /
``sparse``) and the device pick the path here, and each head-sparse backend (``head_sparse_attention`` for the CPU
and any device, ``head_sparse_cuda`` for CUDA kernels) keeps its own measured table of where it wins.
"""
from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from moh_lightning.layers.head_sparse_attention import head_sparse_attention, use_head_sparse
from moh_lightning.layers.head_sparse_cuda import head_sparse_attention_cuda, use_head_sparse_cuda

# "masked" computes every head and zeroes the unselected ones (dense-and-mask); "dense" was its name before, when the
# word also meant the baseline without a router: accepted for one release.
ExecutionMode = Literal["auto", "masked", "sparse", "dense"]
EXECUTION_MODES = ("auto", "masked", "sparse", "dense")


def execution_mode(execution: str, key: str = "execution") -> ExecutionMode:
    """``execution`` checked, with the old name ``dense`` mapped to ``masked`` (and a warning)."""
    if execution not in EXECUTION_MODES:
        raise ValueError(f"{key}={execution!r}: choose 'auto', 'masked' or 'sparse'.")
    if execution == "dense":
        warnings.warn(f"{key}='dense' is now called 'masked' (every head computed, the unselected ones zeroed); "
                      "'dense' is accepted until the next release.", FutureWarning, stacklevel=3)
        return "masked"
    return execution


def runs_head_sparse(execution: ExecutionMode, device_type: str, num_queries: int, num_keys: int,
                     active_fraction: float, decoding: bool, causal: bool) -> bool:
    """Whether a forward computes only the selected (token, head) pairs: forced by ``execution``, else ``auto``
    asks the backend of the device where it measured a gain."""
    if execution != "auto" or device_type != "cuda":
        return use_head_sparse(execution, num_queries, num_keys, active_fraction, decoding, device_type)
    return active_fraction < 1.0 and use_head_sparse_cuda(num_queries, num_keys, active_fraction, decoding, causal)


# A leaf of an FX trace: its branches follow the masks and the causal flag, which a trace holds as proxies (timm's ViT
# passes its attn_mask and is_causal arguments to every block), so the graph calls it and it branches at run time.
@register_notrace_function
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None, *, head_sparse: bool,
           num_shared_heads: int = 0, active_heads: int | None = None, causal: bool = False, offset: int = 0,
           padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Gated head outputs (B, N, h, d) of ``q`` (B, h, N, d) over ``k, v`` (B, h_kv, M, d).

    ``gates`` (B, N, h) weight the heads (None: plain multi-head attention). With ``head_sparse`` only the pairs
    whose gate is nonzero are computed, on the backend of the tensors' device; otherwise every head is computed and
    multiplied by its gate (dense-and-mask). ``padding_mask`` (B, M) is True for real keys; query i sits at
    position ``offset + i`` for ``causal`` masking; ``attn_mask`` is SDPA's.
    """
    if gates is not None and head_sparse:
        backend = head_sparse_attention_cuda if q.device.type == "cuda" else head_sparse_attention
        return backend(q, k, v, gates.to(q.dtype), num_shared_heads, causal=causal, offset=offset,
                       key_padding_mask=padding_mask, attn_mask=attn_mask, dropout_p=dropout_p,
                       active_heads=active_heads)
    length, num_keys = q.shape[2], k.shape[2]
    mask = attention_mask(attn_mask, padding_mask, causal, length, num_keys, offset, q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None and offset == 0,
        enable_gqa=k.shape[1] != q.shape[1],
    ).transpose(1, 2)                                                                 # (B, N, h, d)
    return out if gates is None else out * gates[..., None].to(out.dtype)


def attention_mask(attn_mask: torch.Tensor | None, padding_mask: torch.Tensor | None, causal: bool,
                   num_queries: int, num_keys: int, offset: int, device) -> torch.Tensor | None:
    """One boolean / additive mask for SDPA from timm's mask, key padding and causality.

    Returns None when SDPA's own ``is_causal`` (queries and keys aligned) or no mask at all is enough.
    """
    needs_explicit_causal = causal and (padding_mask is not None or attn_mask is not None or offset > 0
                                        or num_queries != num_keys)
    if padding_mask is None and not needs_explicit_causal:
        return attn_mask
    allowed = torch.ones(1, 1, num_queries, num_keys, dtype=torch.bool, device=device)
    if padding_mask is not None:
        allowed = allowed & padding_mask[:, None, None, :num_keys].bool()
    if needs_explicit_causal:
        query_pos = torch.arange(num_queries, device=device)[:, None] + offset
        allowed = allowed & (torch.arange(num_keys, device=device)[None, :] <= query_pos)
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return allowed & attn_mask
    return attn_mask.masked_fill(~allowed, float("-inf"))
