"""The CPU proxy of a GPU's launch cost: ATen operations one layer step dispatches, against timm's ``Attention``.

At ViT-S / DiT-S sizes a GPU runs about one kernel per operation and the host cannot keep up, so the count of
operations a training step dispatches, forward and backward, predicts its launch-bound time on any device. Counted
with ``TorchDispatchMode`` on the CPU: an op registered with ``torch.library`` (the fused router) counts once, as it
launches once.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from timm.layers import Attention
from torch.utils._python_dispatch import TorchDispatchMode

from moh_lightning.layers import MoHAttention
from moh_lightning.tools.bench.report import Report

# Operations that read a tensor's values back to the host (a GPU then waits) or give shapes that depend on them.
DATA_DEPENDENT = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                  "unique_consecutive", "unique_dim")
WIDTH, HEADS, SHARED, TOP_K, TOKENS = 384, 6, 2, 2, 64


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(step: Callable[[], object]) -> Counter[str]:
    """ATen operations ``step`` dispatches, by name."""
    with _Counter() as counter:
        step()
    return counter.ops


def layer_step_ops(layer: torch.nn.Module, tokens: int = TOKENS) -> Counter[str]:
    """One training step of ``layer`` on (2, tokens, width): forward, its load-balance loss, backward."""
    x = torch.randn(2, tokens, WIDTH, requires_grad=True)

    def step() -> None:
        loss = layer(x).sum()
        balance = getattr(layer, "load_balance_loss", None)
        (loss if balance is None else loss + balance).backward()

    step()  # the first call builds what later calls reuse (e.g. lazily registered kernels)
    return count_ops(step)


def op_count_layers() -> dict[str, torch.nn.Module]:
    """timm's ``Attention`` and MoH (2 shared + top-2 of 4 routed heads, learned router) on each execution path."""
    torch.manual_seed(0)
    layers: dict[str, torch.nn.Module] = {"timm Attention": Attention(WIDTH, HEADS, qkv_bias=True)}
    for execution in ("masked", "sparse"):
        for causal in (False, True):
            layers[f"MoH {execution}, {'causal' if causal else 'bidirectional'}"] = MoHAttention(
                WIDTH, HEADS, qkv_bias=True, num_shared_heads=SHARED, top_k=TOP_K, execution=execution,
                causal=causal)
    return layers


def op_count_section(report: Report) -> None:
    report.section("op_count")
    counts = {name: sum(layer_step_ops(layer.train()).values()) for name, layer in op_count_layers().items()}
    base = counts["timm Attention"]
    rows = [[name, count, f"{count / base:.2f}"] for name, count in counts.items()]
    masked = max(counts[f"MoH masked, {kind}"] for kind in ("bidirectional", "causal")) / base
    report.target("masked layer step ATen ops / timm Attention's", "≤ 1.6×", masked, masked <= 1.6)
    report.table(["layer step", "ATen ops", "× timm Attention"], rows)


__all__ = ["DATA_DEPENDENT", "count_ops", "layer_step_ops", "op_count_layers", "op_count_section"]
