"""Validation curves of the stdlib LM comparison (``results/lm_stdlib.md``) from the runs' TensorBoard logs.

Usage: ``python results/lm_stdlib_plot.py RUNS_DIR`` where RUNS_DIR holds ``llm_stdlib_{75,50,100}/version_*``
(the ``trainer.logger.init_args.save_dir`` of the three ``moh fit`` runs). Writes ``results/lm_stdlib.png`` and
prints the final validation numbers as a markdown table.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RUNS = {"llm_stdlib_100": "dense (100% heads)", "llm_stdlib_75": "MoH 75% heads", "llm_stdlib_50": "MoH 50% heads"}


def scalars(run: Path, tag: str) -> tuple[list[int], list[float]]:
    events = EventAccumulator(str(run))
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return [], []
    points = events.Scalars(tag)
    return [p.step for p in points], [p.value for p in points]


def main(runs_dir: str) -> None:
    figure = Figure(figsize=(10, 4))
    val_axis, train_axis = figure.subplots(1, 2)
    print("| model | val loss (nats/byte) | val bits/byte | val perplexity | training tokens |")
    print("|---|---|---|---|---|")
    for name, label in RUNS.items():
        run = max(Path(runs_dir, name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
        _, loss = scalars(run, "val/bpb")
        _, tokens = scalars(run, "val/tokens")
        val_axis.plot([t / 1e6 for t in tokens], loss, marker="o", label=label)
        train_steps, train_loss = scalars(run, "train/loss")
        train_axis.plot(train_steps, train_loss, label=label)
        _, val_loss = scalars(run, "val/loss")
        print(f"| {label} | {val_loss[-1]:.4f} | {loss[-1]:.4f} | {math.exp(val_loss[-1]):.3f} "
              f"| {tokens[-1]:,.0f} |")
    val_axis.set(xlabel="training tokens (M)", ylabel="validation bits per byte", title="stdlib validation")
    train_axis.set(xlabel="optimizer step", ylabel="training loss (nats/byte)", title="training loss")
    for axis in (val_axis, train_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    out = Path(__file__).resolve().parent / "lm_stdlib.png"
    figure.savefig(out, dpi=120)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs_llm")
