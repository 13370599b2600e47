"""Head budgets: how many shared and routed heads a layer keeps, checked once and given per layer.

Apart from the attention block because the models check their configured budgets before building any layer,
so the errors name the offending key rather than failing deep inside a constructor.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moh_lightning.layers.moh_attention import MoHAttention


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


def layerwise(num_shared_heads: Sequence[int], top_k: Sequence[int], **kwargs) -> type[MoHAttention]:
    """A ``MoHAttention`` class whose successive instances take successive per-layer head budgets.

    timm builds its blocks in depth order through the ``attn_layer`` hook and requires a class there, so the
    per-layer budgets of the paper's configurations (e.g. fewer active heads in shallow layers) ride on the
    class. ``kwargs`` are shared by every layer. Building more layers than budgets is an error.
    """
    # Imported here, not at the top: MoHAttention checks its budget with check_head_budget from this module.
    from moh_lightning.layers.moh_attention import MoHAttention

    if len(num_shared_heads) != len(top_k):
        raise ValueError(f"num_shared_heads has {len(num_shared_heads)} entries but top_k has {len(top_k)}: "
                         f"give one budget per layer in both.")
    budgets = list(zip(num_shared_heads, top_k))
    counter = {"built": 0}

    class LayerwiseMoHAttention(MoHAttention):
        def __init__(self, dim: int, num_heads: int = 8, **layer_kwargs) -> None:
            index = counter["built"]
            if index >= len(budgets):
                raise ValueError(f"{len(budgets)} per-layer head budgets given but layer {index} was built: "
                                 f"give one entry per layer in num_shared_heads and top_k.")
            shared, k = budgets[index]
            if not kwargs.get("dense", False):
                check_head_budget(num_heads, shared, k, where=f"layer {index}")
            counter["built"] += 1
            super().__init__(dim, num_heads, **{**kwargs, **layer_kwargs, "num_shared_heads": shared, "top_k": k})

    LayerwiseMoHAttention.num_budgets = len(budgets)
    LayerwiseMoHAttention.built = staticmethod(lambda: counter["built"])
    return LayerwiseMoHAttention
