"""Head budgets: how many shared and routed heads a layer keeps, checked with errors that name the key.

Apart from the attention block because the models check their configured budgets before building any layer,
so the errors name the offending key rather than failing deep inside a constructor.
"""
from __future__ import annotations


def check_head_budget(num_heads: int, num_shared_heads: int, top_k: int | None, where: str = "") -> int:
    """Validates one layer's head budget and returns its top-k; errors name the offending key."""
    at = f" ({where})" if where else ""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads}{at} must be at least 1.")
    if not 0 <= num_shared_heads <= num_heads:
        raise ValueError(f"num_shared_heads={num_shared_heads}{at} must be between 0 and num_heads={num_heads}.")
    num_routed = num_heads - num_shared_heads
    if top_k is None:
        top_k = num_routed
    if num_routed and not 1 <= top_k <= num_routed:
        raise ValueError(f"top_k={top_k}{at} must be between 1 and the {num_routed} routed heads "
                         f"(num_heads={num_heads} - num_shared_heads={num_shared_heads}).")
    if not num_routed and top_k:
        raise ValueError(f"top_k={top_k}{at}: every head is shared (num_shared_heads={num_shared_heads}), "
                         f"so set top_k: 0 or fewer shared heads.")
    return top_k

