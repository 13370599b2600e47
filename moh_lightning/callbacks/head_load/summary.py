"""The run's head budget in words: its hyper-parameters under one vocabulary, and the end-of-run summary.

Apart from the callback because they are the dashboards' words, not their timing: ``run_hparams`` names the budget
the same way for every task and logger (the HParams tab, W&B's config, MLflow's params, the summary's settings
table), and ``summary_markdown`` writes ``head_load/summary.md`` from a snapshot's plain numbers alone.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from lightning.pytorch import LightningModule

from moh_lightning.callbacks.head_load.loads import HeadLoadSnapshot, load_entropy
from moh_lightning.layers import MoHHeads, QueryNormRouter, activated_head_fraction

#: Shown beside the hyper-parameters of every run (the last value logged), after its task's and callbacks' own.
FINAL_ENTROPY = "head_load_balance/final_load_entropy"


def hparam_metrics(pl_module: LightningModule, callbacks: list) -> tuple[str, ...]:
    """The metrics a run is compared by: those its task logs (``hparam_metrics``: a ViT's accuracy, an LM's bits per
    byte), those of callbacks that log some (the sample grid's FID), and the final load entropy. TensorBoard's HParams
    tab shows a column for every metric named, logged or not: naming only these leaves no empty column."""
    named = [*getattr(pl_module, "hparam_metrics", ("val/loss",))]
    for callback in callbacks:
        named += getattr(callback, "hparam_metrics", ())
    return tuple(dict.fromkeys([*named, FINAL_ENTROPY]))


def _per_layer_value(values: list[float]) -> float | int:
    """One number for a per-layer setting: the value when every layer has it, else the mean over layers."""
    if len(set(values)) == 1:
        return values[0]
    return round(float(np.mean(values)), 3)


def run_hparams(pl_module: LightningModule, layers: list[MoHHeads]) -> dict[str, Any]:
    """The hyper-parameters compared across runs, with the same names in every task, read from the built model.

    TensorBoard's HParams tab lists them by name and shows the first five: the head budget is named so that they are
    ``moh/activated_fraction``, ``moh/load_balance_beta``, ``moh/router``, ``moh/shared_heads`` and ``moh/top_k``
    (per layer; the mean over layers when layers differ). The rest (``moh/two_stage_routing``, ``net/*``, ``task``)
    sort after them.
    """
    routed = [layer for layer in layers if layer.is_moh]
    shared = [layer.router.num_shared_heads if layer.is_moh else layer.num_heads for layer in layers]
    top_k = [layer.router.top_k if layer.is_moh and layer.router.num_routed_heads else 0 for layer in layers]
    if not routed:
        router = "dense"
    else:
        kinds = {"query_norm" if isinstance(layer.router, QueryNormRouter) else "learned" for layer in routed}
        router = kinds.pop() if len(kinds) == 1 else "mixed"
    two_stage = any(getattr(layer.router, "type_router", None) is not None for layer in routed)
    hparams: dict[str, Any] = {
        "moh/activated_fraction": round(activated_head_fraction(pl_module), 4),
        "moh/load_balance_beta": float(getattr(pl_module, "load_balance_beta", 0.0)),
        "moh/router": router,
        "moh/shared_heads": _per_layer_value(shared) if layers else 0,
        "moh/top_k": _per_layer_value(top_k) if layers else 0,
        "moh/two_stage_routing": str(two_stage).lower(),
        "net/heads_per_layer": _per_layer_value([layer.num_heads for layer in layers]) if layers else 0,
        "net/layers": len(layers),
        "net/routed_layers": sum(1 for layer in routed if layer.router.num_routed_heads),
        "task": type(pl_module).__name__,
    }
    lr = getattr(pl_module, "hparams", {}).get("lr")
    if isinstance(lr, (int, float)):
        hparams["task/lr"] = float(lr)
    return hparams


def _format_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(snapshot: HeadLoadSnapshot, collapse_events: list[dict] | None = None,
                     hparams: dict | None = None, metrics: dict | None = None, low_load: float = 0.01) -> str:
    """The end-of-run report: one row per layer (budget, most / least used routed head, entropy, collapses),
    warnings, the run's settings and metrics, and the load of every head of every layer."""
    collapse_events = collapse_events or []
    where = "validation" if snapshot.split == "validation" else "last training window"
    lines = [f"## Head load · {snapshot.run or 'run'} · {where}, step {snapshot.step}", "",
             "| layer | budget | most used routed head | least used routed head | load entropy | collapsed |",
             "|---|---|---|---|---:|---|"]
    collapsed_by_layer: dict[int, list[dict]] = {}
    for event in collapse_events:
        collapsed_by_layer.setdefault(event["layer"], []).append(event)
    for layer in snapshot.layers:
        if not layer.routed:
            lines.append(f"| {layer.index} | {layer.budget()} | – | – | – | – |")
            continue
        routed = layer.routed_load
        most, least = int(routed.argmax()), int(routed.argmin())
        events = collapsed_by_layer.get(layer.index, [])
        collapse = "; ".join(f"head {e['head']} at step {e['step']}" for e in events) or "none"
        lines.append(f"| {layer.index} | {layer.budget()} | {layer.shared + most} ({routed[most]:.1%}) | "
                     f"{layer.shared + least} ({routed[least]:.1%}) | {load_entropy(routed):.4f} | {collapse} |")
    lines += ["", "Load = share of tokens that use a head. Shared heads (S) serve every token; a layer's routed heads "
              "share top-k slots per token, so each one's even load is top-k / routed heads. Load entropy: of the "
              "routed loads, 1 = perfectly even.", ""]
    starved = [(layer.index, layer.shared + h, v) for layer in snapshot.layers
               for h, v in enumerate(layer.routed_load) if v < low_load]
    if collapse_events or starved:
        lines += ["**Warnings**", ""]
        for event in collapse_events:
            lines.append(f"- Layer {event['layer']}, routed head {event['head']}: under {low_load:.0%} of tokens "
                         f"for {event['windows']} logging windows in a row from step {event['step']} (collapsed).")
        for index, head, value in starved:
            lines.append(f"- Layer {index}, routed head {head}: {value:.2%} of tokens in the {where}.")
        lines.append("")
    else:
        lines += [f"No routed head fell under {low_load:.0%} of tokens.", ""]
    heads = max(layer.num_heads for layer in snapshot.layers)
    lines += ["**Load of every head** (S = shared, 1.000)", "",
              "| layer | " + " | ".join(str(h) for h in range(heads)) + " |", "|---|" + "---:|" * heads]
    for layer in snapshot.layers:
        cells = ["S" if layer.dense or h < layer.shared else f"{layer.load[h]:.3f}" for h in range(layer.num_heads)]
        lines.append(f"| {layer.index} | " + " | ".join(cells + [""] * (heads - len(cells))) + " |")
    if hparams or metrics:
        lines += ["", "**Settings and final metrics**", "", "| name | value |", "|---|---|"]
        items = {**(hparams or {}), **(metrics or {})}
        lines += [f"| {key} | {_format_value(value)} |" for key, value in items.items()]
    return "\n".join(lines) + "\n"


__all__ = ["FINAL_ENTROPY", "hparam_metrics", "run_hparams", "summary_markdown"]
