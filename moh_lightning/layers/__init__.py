"""Layers shared by every task: the MoH attention block."""
from moh_lightning.layers.moh_attention import (
    KVCache,
    MoHAttention,
    MoHRouter,
    QueryNormRouter,
    RouterOutput,
    activated_head_fraction,
    check_head_budget,
    layerwise,
    load_balance_loss,
    moh_layers,
    pop_load_balance_loss,
)

__all__ = [
    "KVCache", "MoHAttention", "MoHRouter", "QueryNormRouter", "RouterOutput", "activated_head_fraction",
    "check_head_budget", "layerwise", "load_balance_loss", "moh_layers", "pop_load_balance_loss",
]
