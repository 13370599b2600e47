"""Validation curves of a `moh sweep`'s cells, mean over seeds with the seeds' range, from the trials' TensorBoard
events: whether a budget stops while the models are still improving.

    python results/study_curves.py sweeps/lm_stdlib_heads val/bpb results/study_lm_stdlib_curves.png
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def curve(run_dir: str, tag: str) -> dict[int, float]:
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {p.step: p.value for p in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def main(sweep: str, tag: str, out: str) -> None:
    with open(Path(sweep) / "trials.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["status"] == "finished"]
    key = next(k for k in rows[0] if k not in ("trial", "seed", "status", "run_dir", "error", "node") and "/" not in k)
    cells: dict[str, list[dict[int, float]]] = defaultdict(list)
    for row in rows:
        cells[row[key]].append(curve(row["run_dir"], tag))
    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    axis = figure.add_subplot()
    for label, curves in cells.items():
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[s] for s in steps] for c in curves])
        axis.plot(steps, values.mean(0), marker="o", markersize=3, label=f"{label} (n={len(curves)})")
        axis.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
    axis.set(xlabel="optimizer step", ylabel=tag, title=f"{tag}: mean over seeds, band = min-max of the seeds")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
