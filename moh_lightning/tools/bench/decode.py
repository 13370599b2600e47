"""The KV-cache decoding table: one new token against a cache, the attention core alone and the whole layer.
Apart because decoding reads the cache where training computes, and ``auto`` decides it by its own rule."""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from moh_lightning.layers import KVCache
from moh_lightning.layers.head_sparse_attention import decode_batched, head_sparse_attention
from moh_lightning.tools.bench.layer import execution_cells, execution_layers
from moh_lightning.tools.bench.report import Report
from moh_lightning.tools.bench.shapes import BATCH, HEAD_DIM, HEADS, SHARED, gates
from moh_lightning.tools.bench.timing import Clock, paired_ratio, times_ms


def _core_fns(length: int, fractions: dict[str, int], device: torch.device, batch: int = BATCH) -> dict:
    """One decoding step's attention under each variant: MHA, every head through the sparse decoding, each
    fraction, and the first fraction on the batched path of devices other than the CPU."""
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=device)
    routed = {"MHA": None, "all heads": torch.ones(batch, 1, HEADS, device=device)}
    routed.update({name: gates(1, top_k, device, batch, seed=length) for name, top_k in fractions.items()})
    first = next(iter(fractions))
    routed[f"{first} batched"] = routed[first]
    fns = {}
    for name, g in routed.items():
        # Each variant reads its own cache, as a decoder's layers do: one variant's reads must not leave
        # the next one's cache rows in the CPU's last-level cache.
        k, v = (torch.randn(batch, HEADS, length + 1, HEAD_DIM, device=device)[:, :, :length] for _ in range(2))
        if g is None:
            fns[name] = lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v)
        elif name.endswith("batched"):
            fns[name] = lambda k=k, v=v, g=g: decode_batched(q, k, v, g, 1, None, SHARED + fractions[first])
        else:
            # "all heads": every head through the sparse decoding, which separates its kernel from the
            # skipped heads.
            shared = HEADS if name == "all heads" else SHARED
            active = HEADS if name == "all heads" else SHARED + fractions[name]
            fns[name] = lambda k=k, v=v, g=g, shared=shared, active=active: head_sparse_attention(
                q, k, v, g, shared, causal=True, offset=length - 1, active_heads=active)
    return fns


def decode_section(report: Report, clock: Clock, caches, fractions, repeats, warmup, batch: int = BATCH) -> None:
    device = clock.device
    report.section("decode", batch=batch)
    rows, worst = [], (0.0, "")
    steps = repeats * 10  # a decoding step is short: time more of them
    for length in caches:
        with torch.no_grad():
            core_times = times_ms(_core_fns(length, fractions, device, batch), steps, warmup, clock)
        core = {name: statistics.median(t) for name, t in core_times.items()}
        x = torch.randn(batch, 1, HEADS * HEAD_DIM, device=device)
        layers = execution_layers(True, fractions, device)
        layer_fns = {}
        for name, layer in layers.items():
            cache = KVCache(batch, HEADS, length + 1, HEAD_DIM, device=device)
            cache.k.normal_(), cache.v.normal_()
            layer.eval()

            def step(layer=layer, cache=cache, length=length, x=x):
                cache.length = length - 1
                layer(x, kv_cache=cache)
            layer_fns[name] = step
        with torch.no_grad():
            whole_times = times_ms(layer_fns, steps, warmup, clock)
        whole = {name: statistics.median(t) for name, t in whole_times.items()}
        for name in core:
            label = {"MHA": "MHA", "all heads": "MHA, sparse decoding of every head"}.get(name, f"MoH {name}")
            layer_cells = ["—"] * 4
            if name == "MHA":
                layer_cells = [f"{whole['MHA']:.3f}", "—", "—", f"{batch / whole['MHA'] * 1e3:.0f}"]
            elif name in fractions:
                ratio, layer_cells = execution_cells(whole, name, layers[f"{name} auto"], 1, length, True, 3)
                worst = max(worst, (ratio, f"cache {length}, MoH {name}"))
                layer_cells.append(f"{batch / whole[f'{name} auto'] * 1e3:.0f}")
            rows.append([length, label, f"{core[name]:.3f} ({core['MHA'] / core[name]:.2f}×)",
                         f"{batch / core[name] * 1e3:.0f}", *layer_cells])
            if name in fractions:
                report.decode.setdefault(name, []).append((length, core["MHA"] / core[name]))
                report.finding("KV-cache decoding, attention core, with a cache of", f"{length} tokens", name, "",
                               paired_ratio(core_times["MHA"], core_times[name]))
                report.finding("KV-cache decoding, whole layer (auto), with a cache of", f"{length} tokens", name, "",
                               paired_ratio(whole_times["MHA"], whole_times[f"{name} auto"]))
        if length == 4096 and "50%" in core:
            speedup = core["MHA"] / core["50%"]
            report.target("KV-cache decode core, cache 4096, MoH 50%", "≥ 1.50×", speedup, speedup >= 1.5)
    report.target(f"auto's pick / dense-and-mask decoding layer time, worst cell ({worst[1]})", "≤ 1.05×", worst[0],
                  worst[0] <= 1.05)
    report.table(["cache", "attention", "core ms/step (speedup)", "core tokens/s", "layer ms/step: MHA, dense-and-mask",
                  "layer, sparse", "layer, auto", "layer tokens/s (auto)"], rows)
