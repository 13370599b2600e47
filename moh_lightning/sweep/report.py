"""The table and plot of ``moh sweep``: each grid cell's metrics over seeds, compared with the baseline cell.

Per cell and metric: mean, sample standard deviation (ddof 1) and n over the seeds whose trial finished and
logged a finite value. Each other cell is compared with the baseline by Welch's t-test (unequal variances,
``scipy.stats.ttest_ind(equal_var=False)``): the p-value and the 95% confidence interval of the difference of
means (cell - baseline), which need n >= 2 on both sides.
"""
from __future__ import annotations

import csv
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

STATUS_FINISHED, STATUS_FAILED, STATUS_UNFINISHED = "finished", "failed", "unfinished"


@dataclass
class TrialResult:
    """One seed of one grid cell, as the sweep found it."""

    name: str
    cell: int                     # index into the cell list
    seed: int
    status: str = STATUS_UNFINISHED
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    run_dir: str | None = None
    node: str | None = None       # IP address of the Ray node the trial finished on
    traceback: str | None = None  # the file holding a failed trial's traceback


@dataclass
class Stat:
    n: int = 0
    mean: float = math.nan
    std: float = math.nan
    diff: float = math.nan        # mean - baseline mean
    ci_low: float = math.nan      # 95% confidence interval of diff (Welch)
    ci_high: float = math.nan
    p: float = math.nan           # Welch's two-sided t-test against the baseline cell


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted override key by its shortest unambiguous tail (``model.init_args.lr`` -> ``lr``)."""
    short = {}
    for key in keys:
        parts = key.split(".")
        for depth in range(1, len(parts) + 1):
            tail = ".".join(parts[-depth:])
            if sum(1 for other in keys if other == tail or other.endswith("." + tail)) == 1:
                break
        short[key] = tail
    return short


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value
    return re.sub(r"\s+", "", repr(value)) if isinstance(value, (list, dict, tuple)) else str(value)


def cell_label(cell: dict[str, Any], short: dict[str, str]) -> str:
    return ", ".join(f"{short[k]}={format_value(v)}" for k, v in cell.items()) or "config as is"


def cell_stats(trials: list[TrialResult], n_cells: int, metric: str, baseline: int) -> list[Stat]:
    from scipy import stats  # here: the sweep's Ray workers import this module without needing scipy

    values = [[t.metrics[metric] for t in trials if t.cell == c and t.status == STATUS_FINISHED
               and metric in t.metrics and math.isfinite(t.metrics[metric])] for c in range(n_cells)]
    out = []
    for c, vals in enumerate(values):
        s = Stat(n=len(vals))
        if vals:
            s.mean = float(np.mean(vals))
            s.std = float(np.std(vals, ddof=1)) if len(vals) > 1 else math.nan
        base = values[baseline]
        if c != baseline and vals and base:
            s.diff = s.mean - float(np.mean(base))
            if len(vals) > 1 and len(base) > 1:
                with warnings.catch_warnings():  # identical values on both sides: p and CI are nan
                    warnings.simplefilter("ignore", RuntimeWarning)
                    test = stats.ttest_ind(vals, base, equal_var=False)
                    ci = test.confidence_interval(0.95)
                s.p, s.ci_low, s.ci_high = float(test.pvalue), float(ci.low), float(ci.high)
        out.append(s)
    return out


def _num(x: float, spec: str = ".4g") -> str:
    return "" if math.isnan(x) else format(x, spec)


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _pm(s: Stat) -> str:
    if not s.n:
        return "—"
    return f"{s.mean:.4g}" + (f" ± {s.std:.3g}" if s.n > 1 else "")


def _where(path: str | None, out: Path) -> str:
    """A file in the report: relative to the sweep folder when inside it."""
    if not path:
        return "—"
    return f"`{Path(path).relative_to(out) if Path(path).is_relative_to(out) else path}`"


def metric_file(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", metric).strip("_") + ".png"


def plot(path: Path, trials: list[TrialResult], labels: list[str], metric: str, mode: str, baseline: int) -> None:
    """The metric per cell: each seed a dot, the mean with a ±1 std error bar."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend

    fig = Figure(figsize=(max(4.0, 1.3 * len(labels) + 1.5), 4.2), layout="constrained")
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)
    summary = cell_stats(trials, len(labels), metric, baseline)
    labelled: set[str] = set()  # one legend entry per colour: the dots' colour tells the baseline cell apart
    for c, s in enumerate(summary):
        vals = [t.metrics[metric] for t in trials if t.cell == c and t.status == STATUS_FINISHED
                and metric in t.metrics and math.isfinite(t.metrics[metric])]
        kind = "one seed, baseline cell" if c == baseline else "one seed, other cells"
        if vals:
            ax.scatter(c + rng.uniform(-0.12, 0.12, len(vals)), vals, s=22, alpha=0.75, zorder=2,
                       color="tab:orange" if c == baseline else "tab:blue",
                       label=None if kind in labelled else kind)
            ax.errorbar(c + 0.25, s.mean, yerr=0 if math.isnan(s.std) else s.std, fmt="D", color="black",
                        capsize=5, markersize=5, zorder=3, label=None if labelled else "mean ± std")
            labelled.add(kind)
        else:
            ax.annotate("no result", (c, 0.5), xycoords=("data", "axes fraction"), ha="center", color="gray")
    ax.set_xticks(range(len(labels)), [lab + ("\n(baseline)" if c == baseline else "")
                                       for c, lab in enumerate(labels)],
                  rotation=20 if max(map(len, labels)) > 12 else 0, ha="right" if max(map(len, labels)) > 12
                  else "center", fontsize=8)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per cell over seeds ({'lower' if mode == 'min' else 'higher'} is better)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if labelled:  # not when no trial logged the metric: Matplotlib warns of an empty legend
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def verdict(stats: list[Stat], labels: list[str], baseline: int, metric: str, mode: str) -> list[str]:
    """Each cell against the baseline in words: better or worse by how much, or within the seeds' spread."""
    lines = ["**In words** (Welch's t-test at the 5% level):", ""]
    for c, s in enumerate(stats):
        if c == baseline:
            continue
        if math.isnan(s.p):
            lines.append(f"- {labels[c]}: not compared (fewer than 2 finished seeds on a side).")
        elif s.p >= 0.05:
            lines.append(f"- {labels[c]}: {metric} {s.diff:+.3g} against {labels[baseline]}, within the seeds' spread "
                         f"(p = {s.p:.2f}; the 95% interval [{s.ci_low:+.3g}, {s.ci_high:+.3g}] includes 0): no "
                         f"difference shown with these seeds.")
        else:
            better = (s.diff < 0) == (mode == "min")
            lines.append(f"- {labels[c]}: {'better' if better else 'worse'} than {labels[baseline]} by "
                         f"{abs(s.diff):.3g} {metric} (p = {s.p:.2g}; 95% interval [{s.ci_low:+.3g}, "
                         f"{s.ci_high:+.3g}]).")
    return lines


def write_report(out: Path, trials: list[TrialResult], cells: list[dict[str, Any]], seeds: list[int],
                 metric: str, mode: str, baseline: int, title: str) -> dict[str, Path]:
    """Writes ``results.csv`` / ``results.md`` (one row per cell), ``trials.csv`` and the metric's plot."""
    out.mkdir(parents=True, exist_ok=True)
    keys = list(cells[0]) if cells else []
    short = short_keys(keys)
    labels = [cell_label(cell, short) for cell in cells]
    logged = sorted({m for t in trials if t.status == STATUS_FINISHED for m in t.metrics})
    metrics = [metric] + [m for m in logged if m != metric]
    summary = {m: cell_stats(trials, len(cells), m, baseline) for m in metrics}
    paths = {"csv": out / "results.csv", "markdown": out / "results.md", "trials": out / "trials.csv",
             "plot": out / metric_file(metric)}

    with open(paths["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        fields = ("mean", "std", "n", "diff", "ci95_low", "ci95_high", "p")
        writer.writerow(["cell", *keys, "baseline"] + [f"{m} {x}" for m in metrics for x in fields])
        for c, cell in enumerate(cells):
            row = [labels[c], *[format_value(cell[k]) for k in keys], c == baseline]
            for m in metrics:
                s = summary[m][c]
                row += [_num(s.mean, ".8g"), _num(s.std, ".8g"), s.n, _num(s.diff, ".8g"), _num(s.ci_low, ".8g"),
                        _num(s.ci_high, ".8g"), _num(s.p, ".6g")]
            writer.writerow(row)

    with open(paths["trials"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", *keys, "seed", "status", metric, "node", "run_dir", "error", "traceback"])
        for t in trials:
            writer.writerow([t.name, *[format_value(cells[t.cell][k]) for k in keys], t.seed, t.status,
                             _num(t.metrics.get(metric, math.nan), ".8g"), t.node or "", t.run_dir or "",
                             t.error or "", t.traceback or ""])

    plot(paths["plot"], trials, labels, metric, mode, baseline)

    counts = {s: sum(t.status == s for t in trials) for s in (STATUS_FINISHED, STATUS_FAILED, STATUS_UNFINISHED)}
    main = summary[metric]
    finite = [(s.mean, c) for c, s in enumerate(main) if s.n]
    best = (min(finite) if mode == "min" else max(finite))[1] if finite else None
    head = [short[k] for k in keys] or ["cell"]
    lines = [f"# Sweep: {title}", "",
             f"Seeds {seeds}; {metric}, {'lower' if mode == 'min' else 'higher'} is better; baseline "
             f"{labels[baseline]}. Trials: {counts[STATUS_FINISHED]} finished, {counts[STATUS_FAILED]} failed, "
             f"{counts[STATUS_UNFINISHED]} unfinished.", "",
             "Mean ± sample standard deviation over the seeds that finished (n). Δ is the cell's mean minus the "
             "baseline's, with the 95% confidence interval and the p-value of Welch's t-test (n >= 2 on both "
             "sides).", ""]
    if keys:
        lines += ["Keys: " + ", ".join(f"`{short[k]}` = `{k}`" for k in keys) + ".", ""]
    if not any(metric in t.metrics for t in trials if t.status == STATUS_FINISHED) and logged:
        lines += [f"**No finished trial logged `{metric}`.** Logged metrics: " + ", ".join(f"`{m}`" for m in logged)
                  + ".", ""]
    lines += [f"## {metric}", "", "| " + " | ".join(head + ["n", f"{metric} mean ± std", "Δ vs baseline [95% CI]",
                                                            "p (Welch)"]) + " |",
              "|" + "---|" * (len(head) + 4)]
    for c, cell in enumerate(cells):
        s = main[c]
        values = [_md(format_value(cell[k])) for k in keys] or [_md(labels[c])]
        if c == baseline:
            values[0] += " (baseline)"
        mean = _pm(s)
        if c == best:
            mean = f"**{mean}**"
        if c == baseline:
            diff, p = "—", "—"
        elif math.isnan(s.diff):
            diff, p = "n/a", "n/a"
        else:
            ci = f" [{s.ci_low:+.3g}, {s.ci_high:+.3g}]" if not math.isnan(s.ci_low) else ""
            diff, p = f"{s.diff:+.3g}{ci}", (_num(s.p, ".3g") or "n/a")
        lines.append("| " + " | ".join(values + [str(s.n), mean, diff, p]) + " |")
    lines += ["", *verdict(main, labels, baseline, metric, mode), "", f"![{metric} per cell]({paths['plot'].name})", ""]
    others = [m for m in metrics if m != metric and any(summary[m][c].n for c in range(len(cells)))]
    if others:
        lines += ["## All logged metrics: mean ± std (n)", "",
                  "| " + " | ".join(head + [_md(m) for m in others]) + " |", "|" + "---|" * (len(head) + len(others))]
        for c, cell in enumerate(cells):
            values = [_md(format_value(cell[k])) for k in keys] or [_md(labels[c])]
            lines.append("| " + " | ".join(values + [f"{_pm(summary[m][c])} ({summary[m][c].n})" for m in others])
                         + " |")
        lines.append("")
    failed = [t for t in trials if t.status == STATUS_FAILED]
    if failed:
        lines += ["## Failed trials", "", "Each trial's error, its last line; its traceback is in the file named.", "",
                  "| trial | error | traceback |", "|---|---|---|"]
        lines += [f"| `{t.name}` | {_md(t.error or 'unknown error')[:500]} | {_where(t.traceback, out)} |"
                  for t in failed]
        lines.append("")
    unfinished = [t for t in trials if t.status == STATUS_UNFINISHED]
    if unfinished:
        lines += ["## Unfinished trials", "", ", ".join(f"`{t.name}`" for t in unfinished)
                  + ": run the same `moh sweep` command again to continue them.", ""]
    lines += ["Every trial is an ordinary `moh fit` run in `runs/<trial>/version_N/` (TensorBoard events, "
              "`config.yaml`, checkpoints): `tensorboard --logdir runs`. One row per trial, with its run folder "
              "and error: `trials.csv`.", ""]
    paths["markdown"].write_text("\n".join(lines))
    return paths
