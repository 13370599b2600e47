"""The parameter-free query-norm gate (paper section 4.4, the authors' MoH-LLaMA3): which heads each token keeps.

``QueryNormRouter`` trains with it; the ``trust_remote_code`` files of exported folders (``hf_causal/hf_moh.py``,
``llama/hf_moh_llama.py``) gate with it, and the exports copy this file beside them. So it imports only torch.
"""
from __future__ import annotations

import torch


def query_norm_scores(query: torch.Tensor, num_shared_heads: int, top_k: int,
                      score_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """Routed heads' scores (B, T, E), softmax of their query norms over those norms' standard deviation, and the
    top-k selection (B, T, E) of the queries (B, h, T, d), scored in ``score_dtype`` (``"float32"`` or
    ``"activation"``, the queries' own dtype)."""
    batch, heads, length, _ = query.shape
    routed = query[:, num_shared_heads:]
    norms = (routed.float() if score_dtype == "float32" else routed).norm(dim=-1)            # (B, E, T)
    # Scored as (B*T, E) rows: the reduction order the suite's fp32 and bf16 references were recorded with.
    norms = norms.permute(0, 2, 1).reshape(batch * length, heads - num_shared_heads)
    probs = (norms / norms.std(-1, keepdim=True).clamp_min(1e-6)).softmax(-1)
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, probs.topk(top_k, dim=-1).indices, True)
    return probs.reshape(batch, length, -1), selected.reshape(batch, length, -1)


def query_norm_gates(query: torch.Tensor, num_shared_heads: int, top_k: int,
                     score_dtype: str = "float32") -> torch.Tensor:
    """{0, 1} gates (B, T, h) of the queries (B, h, T, d): shared heads 1, the top-k routed heads 1, the rest 0."""
    batch, heads, length, _ = query.shape
    gates = query.new_ones(batch, length, heads)
    if num_shared_heads < heads:
        gates[..., num_shared_heads:] = query_norm_scores(query, num_shared_heads, top_k, score_dtype)[1]
    return gates
