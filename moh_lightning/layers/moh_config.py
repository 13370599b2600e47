"""The MoH sub-config: one head budget and routing vocabulary for every model (ViT, DiT, the decoder LM).

Each model config holds a ``moh: MoHConfig | None``, so a YAML sets ``arch.moh.top_k`` the same way in all three tasks,
and every option of the attention block (router, two-stage routing, execution path, per-layer budgets) is reachable
in each of them. ``moh: null`` is plain multi-head attention with the same weights and no router: the dense baseline.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from moh_lightning.layers.budgets import check_head_budget
from moh_lightning.layers.execution import ExecutionMode, execution_mode
from moh_lightning.layers.routers import RouterDtype, RouterType
from moh_lightning.serialization import checkpoint_type


@checkpoint_type
@dataclass
class MoHConfig:
    """Which heads each token uses, and how they are picked.

    Args:
        num_shared_heads: Always-active heads (the first ones of each layer): one int for every layer, or a list
            with one entry per layer.
        top_k: Routed heads picked per token, out of the layer's ``num_heads - num_shared_heads``; one int or one
            per layer; None picks every routed head.
        router: ``"learned"`` (paper Eq. 5-6) or ``"query_norm"`` (parameter-free, for continue-tuning).
        router_dtype: Precision of the query-norm router's scores: ``"float32"`` (exact ranking), or
            ``"activation"``, the activations' dtype as the authors' MoH-LLaMA3 code (their bf16 head choices).
        two_stage_routing: Learn the shared / routed balance (Eq. 6); False fixes it at 1/2 each (Tab. 5 ablation).
        execution: ``"masked"`` computes every head and masks, ``"sparse"`` only the selected (token, head) pairs,
            ``"auto"`` picks from the shapes.
    """

    num_shared_heads: int | list[int] = 0
    top_k: int | list[int] | None = None
    router: RouterType = "learned"
    router_dtype: RouterDtype = "float32"
    two_stage_routing: bool = True
    execution: ExecutionMode = "auto"

    def __post_init__(self) -> None:
        """The whole budget checked once, before any layer is built: each value, and the combinations no layer
        could run (per-layer values are checked against the model's heads in ``layers``)."""
        for key, value, allowed in (("router", self.router, get_args(RouterType)),
                                    ("router_dtype", self.router_dtype, get_args(RouterDtype))):
            if value not in allowed:
                raise ValueError(f"moh.{key}={value!r}: choose one of {', '.join(map(repr, allowed))}.")
        self.execution = execution_mode(self.execution, "moh.execution")
        _check_budget_values(self.num_shared_heads, self.top_k)
        if self.router == "query_norm" and self.execution == "sparse":
            raise ValueError("moh.execution=sparse cannot train the query_norm router: its straight-through gradient "
                             "needs every head's output. Use auto (head-sparse at inference where it pays) or masked.")

    def layers(self, num_heads: int | Sequence[int], depth: int, count: str = "depth") -> list[dict]:
        """``MoHAttention`` keyword arguments for each of ``depth`` layers, every budget checked; ``count`` names
        where the model's config gives their number."""
        heads = _per_layer(num_heads, depth, "num_heads", count)
        shared = _per_layer(self.num_shared_heads, depth, "moh.num_shared_heads", count)
        top_k = _per_layer(self.top_k, depth, "moh.top_k", count)
        common = {"router": self.router, "router_dtype": self.router_dtype, "two_stage_routing": self.two_stage_routing,
                  "execution": self.execution}
        return [{**common, "num_shared_heads": s, "top_k": check_head_budget(h, s, k, where=f"layer {i}")}
                for i, (h, s, k) in enumerate(zip(heads, shared, top_k, strict=True))]


def attention_layers(moh: MoHConfig | None, num_heads: int | Sequence[int], depth: int,
                     count: str = "depth") -> list[dict]:
    """``MoHAttention`` keyword arguments for each layer of a model: routed per ``moh``, or dense when it is None."""
    if moh is None:
        return [{"dense": True} for _ in range(depth)]
    return moh.layers(num_heads, depth, count)


def activated_fraction(moh: MoHConfig | None, num_heads: int | Sequence[int], depth: int) -> float:
    """Share of all the model's heads a token uses."""
    heads = _per_layer(num_heads, depth, "num_heads")
    if moh is None:
        return 1.0
    active = sum(layer["num_shared_heads"] + (layer["top_k"] if h > layer["num_shared_heads"] else 0)
                 for h, layer in zip(heads, moh.layers(heads, depth), strict=True))
    return active / sum(heads)


def as_moh_config(value: MoHConfig | dict | None) -> MoHConfig | None:
    """A ``MoHConfig`` from itself or from the dict a checkpoint's hyper-parameters hold."""
    return MoHConfig(**value) if isinstance(value, dict) else value


def _check_budget_values(num_shared_heads: int | Sequence[int], top_k: int | Sequence[int] | None) -> None:
    """Each budget a non-negative int (or None for top_k), and per-layer lists of one length: the two lists
    describe the same layers, whose number only the model knows."""
    lengths = {}
    for key, value in (("num_shared_heads", num_shared_heads), ("top_k", top_k)):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if isinstance(value, (list, tuple)):
            lengths[key] = len(values)
        if not values or not all(_budget_value(v, allow_none=key == "top_k") for v in values):
            raise ValueError(f"moh.{key}={value!r}: give a non-negative int, or one per layer.")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"moh.num_shared_heads has {lengths['num_shared_heads']} entries but moh.top_k has "
                         f"{lengths['top_k']}: give both one entry per layer (or either a single int).")


def _budget_value(value, allow_none: bool) -> bool:
    if value is None:
        return allow_none
    # bool is an int to Python, but `top_k: true` in a YAML is a mistake, not one head.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _per_layer(value: int | Sequence[int] | None, depth: int, key: str, count: str = "depth") -> list:
    """A scalar for every layer, or a list checked to have one entry per layer (``count`` of them)."""
    if value is None or isinstance(value, int):
        return [value] * depth
    value = list(value)
    if len(value) != depth:
        raise ValueError(f"{key} has {len(value)} entries but {count}={depth}: give one per layer or a single int.")
    return value


__all__ = ["MoHConfig", "activated_fraction", "as_moh_config", "attention_layers"]
