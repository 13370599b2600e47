"""Layers shared by every task: the MoH attention block, its routers, head budgets and KV cache, and stochastic depth.

Import from here rather than from the files: one concept per file, and which file a name lives in may change.
"""
from moh_lightning.layers.budgets import check_head_budget
from moh_lightning.layers.drop_path import DropPath
from moh_lightning.layers.execution import ExecutionMode
from moh_lightning.layers.kv_cache import KVCache
from moh_lightning.layers.moh_attention import (
    MoHAttention,
    MoHHeads,
    activated_head_fraction,
    moh_layers,
    pop_load_balance_loss,
)
from moh_lightning.layers.routers import MoHRouter, QueryNormRouter, RouterOutput, RouterType, load_balance_loss

__all__ = [
    "DropPath", "ExecutionMode", "KVCache", "MoHAttention", "MoHHeads", "MoHRouter", "QueryNormRouter", "RouterOutput",
    "RouterType", "activated_head_fraction", "check_head_budget", "load_balance_loss", "moh_layers",
    "pop_load_balance_loss",
]
