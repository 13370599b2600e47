"""The attention-core table: head-sparse attention against SDPA over every head, from q, k, v to the output
projection's input. Apart because it is the report's central measurement, with its own targets and plot data."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moh_lightning.layers.head_sparse_attention import head_sparse_attention
from moh_lightning.tools.bench.report import Report
from moh_lightning.tools.bench.shapes import BATCH, HEAD_DIM, HEADS, LONG, SHARED, gates
from moh_lightning.tools.bench.timing import Clock, paired_ratio, times_ms

# The speed targets for the attention core: (causal, N, fraction) -> minimum speedup over MHA.
CORE_TARGETS = {(True, 4096, "50%"): 1.8, (True, 1024, "50%"): 1.7, (True, 4096, "75%"): 1.25,
                (False, 1024, "50%"): 1.75}


def _core_fns(length: int, causal: bool, fractions: dict[str, int], backward: bool, device: torch.device,
              batch: int = BATCH, masked_column: bool = True) -> dict[str, Callable]:
    """The attention core, from q, k, v (and gates) to the (B, N, h * d) input of the output projection."""
    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM, device=device, requires_grad=backward) for _ in range(3))
    routed = {name: gates(length, top_k, device, batch).requires_grad_(backward) for name, top_k in fractions.items()}
    grad = torch.randn(batch, length, HEADS * HEAD_DIM, device=device)
    leaves = [q, k, v, *routed.values()]

    def run(out: torch.Tensor) -> None:
        if backward:
            out.backward(grad)
            for t in leaves:
                t.grad = None

    def dense() -> None:
        run(F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(grad.shape))

    def masked(g: torch.Tensor) -> Callable:
        return lambda: run((F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
                            * g[..., None]).reshape(grad.shape))

    def sparse(g: torch.Tensor) -> Callable:
        return lambda: run(head_sparse_attention(q, k, v, g, SHARED, causal=causal).reshape(grad.shape))

    fns = {"MHA": dense}
    if masked_column and length <= LONG:
        fns["dense-and-mask"] = masked(next(iter(routed.values())))
    fns.update({name: sparse(g) for name, g in routed.items()})
    return fns


def core_section(report: Report, clock: Clock, lengths, fractions, repeats, warmup, batch: int = BATCH,
                 masked_column: bool = True) -> None:
    """The core table; ``masked_column``: time the dense-and-mask formulation too (it costs what MHA costs)."""
    report.section("core", batch=batch)
    rows = []
    for causal in (False, True):
        for length in lengths:
            for backward in (False, True):
                runs = (repeats, warmup) if length <= LONG else (repeats, min(warmup, 1))
                fns = _core_fns(length, causal, fractions, backward, clock.device, batch, masked_column)
                times = times_ms(fns, *runs, clock)
                ms = {name: statistics.median(t) for name, t in times.items()}
                masked = f"{ms['dense-and-mask']:.1f}" if "dense-and-mask" in ms else "—"
                row = ["causal" if causal else "bidirectional", length,
                       "fwd+bwd" if backward else "fwd", f"{ms['MHA']:.1f}", masked]
                for name, top_k in fractions.items():
                    speedup, low, high = paired_ratio(times["MHA"], times[name])
                    ideal = HEADS / (SHARED + top_k)
                    row.append(f"{ms[name]:.1f} ({speedup:.2f}×, ideal {ideal:.2f}×)")
                    wanted = CORE_TARGETS.get((causal, length, name))
                    if wanted is not None:
                        report.target(f"{'causal' if causal else 'bidirectional'} core, N = {length}, "
                                      f"{'fwd+bwd' if backward else 'fwd'}, MoH {name}", f"≥ {wanted:.2f}×",
                                      speedup, speedup >= wanted, f" (rounds' quartiles {low:.2f}-{high:.2f})")
                    report.core.setdefault((causal, backward, name), []).append((length, speedup))
                    report.finding("attention core at", f"N = {length}", name, f"{row[0]} {row[2]}",
                                   (speedup, low, high))
                rows.append(row)
    report.table(["attention", "N", "pass", "MHA ms", "dense-and-mask ms"] + [f"MoH {n}" for n in fractions], rows)
