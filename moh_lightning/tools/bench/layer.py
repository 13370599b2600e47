"""The whole-layer table: whether ``auto`` picks the faster execution in training. Apart, with the builder of the
per-execution layers and the scorer of ``auto``'s pick, which the decoding table reuses for a decoding token."""
from __future__ import annotations

import statistics

import torch

from moh_lightning.layers import MoHAttention
from moh_lightning.tools.bench.report import Report
from moh_lightning.tools.bench.shapes import BATCH, HEAD_DIM, HEADS, layer
from moh_lightning.tools.bench.timing import Clock, paired_ratio, times_ms


def execution_layers(causal: bool, fractions: dict[str, int], device: torch.device) -> dict[str, MoHAttention]:
    """MHA, and for each fraction the MoH layer under each execution, named ``"<fraction> auto|sparse|masked"``."""
    layers = {"MHA": layer(causal, True, device=device)}
    for name, top_k in fractions.items():
        for execution in ("auto", "sparse", "masked"):
            layers[f"{name} {execution}"] = layer(causal, False, execution, top_k, device)
    return layers


def execution_cells(ms: dict[str, float], name: str, auto: MoHAttention, num_queries: int, num_keys: int,
                    decoding: bool, digits: int) -> tuple[float, list[str]]:
    """One fraction of ``execution_layers``' timings: auto's pick scored against dense-and-mask (the forced time of
    the path it picks / dense-and-mask's, 1.00 when it picks dense-and-mask, since timing one path twice differs
    by up to 9% here), and the dense-and-mask, sparse and auto cells with their speedups over MHA."""
    gates = torch.ones(1, device=next(auto.parameters()).device)
    picked = "sparse" if auto._head_sparse(gates, num_queries, num_keys, decoding, auto.causal) else "masked"
    cells = [f"{ms[f'{name} {e}']:.{digits}f} ({ms['MHA'] / ms[f'{name} {e}']:.2f}×{f', {picked}' * (e == 'auto')})"
             for e in ("masked", "sparse", "auto")]
    return ms[f"{name} {picked}"] / ms[f"{name} masked"], cells


def layer_section(report: Report, clock: Clock, lengths, fractions, repeats, warmup, batch: int = BATCH) -> None:
    report.section("layer", batch=batch)
    rows, worst = [], (0.0, "")
    for causal in (False, True):
        for length in lengths:
            x = torch.randn(batch, length, HEADS * HEAD_DIM, device=clock.device, requires_grad=True)
            layers = execution_layers(causal, fractions, clock.device)
            fns = {name: (lambda layer=layer, x=x: layer(x).sum().backward()) for name, layer in layers.items()}
            times = times_ms(fns, repeats, warmup, clock)
            ms = {name: statistics.median(t) for name, t in times.items()}
            for name in fractions:
                ratio, cells = execution_cells(ms, name, layers[f"{name} auto"], length, length, False, 1)
                report.finding("whole attention layer (auto, fwd+bwd) at", f"N = {length}", name,
                               "causal" if causal else "bidirectional",
                               paired_ratio(times["MHA"], times[f"{name} auto"]))
                label = f"{'causal' if causal else 'bidirectional'}, N = {length}, MoH {name}"
                worst = max(worst, (ratio, label))
                rows.append(["causal" if causal else "bidirectional", length, name, f"{ms['MHA']:.1f}", *cells])
    report.target(f"auto's pick / dense-and-mask layer time, worst cell ({worst[1]})", "≤ 1.05×", worst[0],
                  worst[0] <= 1.05)
    report.table(["attention", "N", "heads", "MHA ms", "dense-and-mask", "sparse", "auto"], rows)
