"""The CPU report's attention shapes and the layers built from them: apart because the sections and the fresh
process of a peak-memory measurement must build the same ones."""
from __future__ import annotations

import torch

from moh_lightning.layers import MoHAttention, MoHRouter

HEADS, HEAD_DIM, BATCH, SHARED = 8, 64, 4, 2
# Activated fraction -> routed top-k with 2 shared of 8 heads; 90% is not a whole number of 8 heads, so the
# nearest, 7 of 8, stands for it.
FRACTIONS = {"50%": 2, "75%": 4, "88%": 5}
LONG = 1024  # longer sequences get one warm-up run and no dense-and-mask column


def gates(length: int, top_k: int, device: torch.device, batch: int = BATCH, seed: int = 0) -> torch.Tensor:
    """Gates of a freshly initialised MoH router on random tokens: roughly balanced routing."""
    torch.manual_seed(seed)
    router = MoHRouter(HEADS * HEAD_DIM, HEADS, SHARED, top_k)
    with torch.no_grad():
        return router(torch.randn(batch, length, HEADS * HEAD_DIM)).gates.to(device)


def layer(causal: bool, dense: bool, execution: str = "auto", top_k: int = 2,
          device: torch.device | str = "cpu") -> MoHAttention:
    """The benchmarked layer: MHA (``dense``) or MoH with 2 shared heads and ``top_k`` routed ones."""
    torch.manual_seed(0)
    return MoHAttention(HEADS * HEAD_DIM, HEADS, num_shared_heads=0 if dense else SHARED,
                        top_k=None if dense else top_k, dense=dense, causal=causal, execution=execution,
                        device=device)
