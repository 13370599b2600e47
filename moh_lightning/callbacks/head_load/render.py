"""The one renderer of head-load heatmaps and load-over-time cards: matplotlib, for the dashboards and the papers.

Separate from the callback so that ``moh head-figures`` draws a finished run's ``loads.json`` with exactly the code the
dashboards used, without a model or a logger. A ``Grid`` says what a heatmap shows; ``heatmap`` draws it in one of
two layouts: a *card* sized in pixels for a dashboard (wide, large type, the legend as a line under the title) or a
*paper* figure sized in inches (small type, a colour bar). Every heatmap colours a cell by load / balanced load
(white = balanced, red = busier, blue = idler, on a fixed 0-2 scale) and writes the exact load in it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath
from matplotlib.ticker import MaxNLocator
from PIL import Image

from moh_lightning.callbacks.head_load.loads import GroupLoad, HeadLoadSnapshot, LayerLoad

_CMAP = "RdBu_r"
_SHARED_COLOUR = "#d9d9d9"
_NOTE_COLOUR = "#464646"
_NORM = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=2.0)


@dataclass
class Grid:
    """What a heatmap shows, independent of how it is drawn (a dashboard card or a paper figure)."""

    ratio: np.ndarray                # (rows, cols) load / balanced load, the colour
    text: list[list[str]]            # what each cell says
    grey: np.ndarray                 # (rows, cols) cells drawn flat grey (shared heads, dense layers, no data)
    row_labels: list[str]
    col_labels: list[str]
    title: str
    legend: str                      # one line under the title: units and colours
    xlabel: str                      # what the columns are
    ylabel: str                      # what the rows are (paper figures; cards label rows L0 / h2 instead)


def _format_load(value: float) -> str:
    """A load as a whole percentage of tokens: two characters nearly always, readable in a small cell."""
    return f"{100 * value:.0f}"


def layer_grid(snapshot: HeadLoadSnapshot, title: str | None = None) -> Grid:
    """Layers x heads: the share of tokens each head serves (in %), shared heads ``S`` on grey."""
    layers = snapshot.layers
    heads = max(layer.num_heads for layer in layers)
    ratio = np.ones((len(layers), heads))
    grey = np.zeros((len(layers), heads), dtype=bool)
    text = [["" for _ in range(heads)] for _ in layers]
    for row, layer in enumerate(layers):
        for head in range(heads):
            if head >= layer.num_heads:
                grey[row, head] = True
            elif layer.dense or head < layer.shared:
                grey[row, head] = True
                text[row][head] = "all" if layer.dense else "S"
            else:
                ratio[row, head] = layer.load[head] / layer.balanced
                text[row][head] = _format_load(layer.load[head])
    return Grid(ratio=ratio, text=text, grey=grey, row_labels=[f"L{layer.index}" for layer in layers],
                col_labels=[str(h) for h in range(heads)],
                title=title or f"Head load · {snapshot.split} · step {snapshot.step}",
                legend="% of tokens · S = shared · red busier, blue idler than even",
                xlabel="head", ylabel="layer")


def _short_label(label: str) -> str:
    """A group label for a column: a class or source name without its id, timestep ranges without the ``t``."""
    label = label.removeprefix("t ")
    return label.split(": ", 1)[1] if ": " in label else label


def group_grid(layer: LayerLoad, group: GroupLoad, max_groups: int | None = None, title: str | None = None) -> Grid:
    """Routed heads x groups of one layer: which heads each class / source / noise level uses (in %).

    Groups are the columns, so a card stays wide rather than tall (TensorBoard's time series caps image height).
    """
    load = np.asarray(group.load, dtype=float)
    labels = list(group.labels)
    hidden = 0
    if max_groups is not None and len(labels) > max_groups:
        hidden = len(labels) - max_groups
        load, labels = load[:max_groups], labels[:max_groups]
    groups, heads = load.shape
    empty = np.asarray(group.tokens[:groups]) <= 0
    grey = np.repeat(empty[None, :], heads, axis=0)
    text = [["" if grey[h, g] else _format_load(load[g, h]) for g in range(groups)] for h in range(heads)]
    more = f" (first {groups} of {groups + hidden})" if hidden else ""
    kind = "timestep t (high = noisier)" if group.kind == "timestep" else group.kind
    return Grid(ratio=load.T / layer.balanced, text=text, grey=grey,
                row_labels=[f"h{layer.shared + h}" for h in range(heads)],
                col_labels=[_short_label(label) for label in labels],
                title=title or f"L{layer.index} · load per {group.kind}{more}",
                legend=f"% of tokens · top-{layer.top_k} of {layer.routed}: even = {_format_load(layer.balanced)} · "
                       "red busier, blue idler",
                xlabel=kind, ylabel="routed head")


# ------------------------------------------------------------------------------------------------------- layouts
# Sizes are in points; a card is drawn at 72 dpi, so there a point is a pixel. TensorBoard's Images tab scales an
# image to a card about 330 px wide, its Time Series tab to at most ~210 px high and ~400 px wide: cards are therefore
# wide (cells 80 x 50 px) with cell text ~40% of a cell's width, which stays >= 10 px on a card up to about 12 columns.

@dataclass
class _Layout:
    card: bool
    size: tuple[float, float]                  # figure width, height
    dpi: float
    axes: tuple[float, float, float, float]    # the cells' box: left, bottom, width, height
    cell_font: float                           # 0: the cells are too small to write in
    row_font: float
    col_font: float
    col_every: int                             # label every this many columns
    gap: float                                 # white line between cells
    title: str
    legend: list[str]                          # lines under the title (cards)


_MEASURE = TextToPath()


def _width(text: str, size: float, bold: bool = False) -> float:
    """The width of ``text`` in points at font ``size``, as matplotlib will draw it."""
    font = FontProperties(family="DejaVu Sans", size=size, weight="bold" if bold else "normal")
    return _MEASURE.get_text_width_height_descent(text, font, ismath=False)[0]


def _fitting_size(texts: list[str], width: float, size: int, smallest: int = 12) -> int:
    """The largest font size up to ``size`` at which every text fits in ``width``."""
    while size > smallest and max((_width(text, size) for text in texts), default=0) > width:
        size -= 1
    return size


def _fit(text: str, size: float, width: float, bold: bool = False) -> str:
    """``text`` cut with an ellipsis to ``width``."""
    if _width(text, size, bold) <= width:
        return text
    while text and _width(text + "…", size, bold) > width:
        text = text[:-1]
    return text + "…"


def _wrap(text: str, size: float, width: float) -> list[str]:
    """``text`` broken at its `` · `` separators into lines of at most ``width``."""
    lines: list[str] = []
    for part in text.split(" · "):
        candidate = f"{lines[-1]} · {part}" if lines else part
        if lines and _width(candidate, size) <= width:
            lines[-1] = candidate
        else:
            lines.append(_fit(part, size, width))
    return lines


def _card_layout(grid: Grid) -> _Layout:
    rows, cols = grid.ratio.shape
    # Columns widen for a few long labels (text sources), and narrow when there are many.
    cell_w = 80 if cols <= 12 else max(30, 960 // cols)
    if cols <= 6:
        cell_w = max(cell_w, min(200, 12 + max(int(_width(text, 24)) for text in grid.col_labels)))
    cell_h = 50 if rows <= 16 else max(22, 800 // rows)
    col_font = _fitting_size(grid.col_labels, cell_w - 6, 24)
    row_font = _fitting_size(grid.row_labels, 200, min(24, cell_h - 4))
    left = 14 + max(int(_width(text, row_font)) for text in grid.row_labels) + 12
    grid_width, grid_height = cols * cell_w, rows * cell_h
    width = max(left + grid_width + 16, 560)
    legend = _wrap(grid.legend, 22, width - 28)
    top = 56 + 29 * len(legend) + 10
    height = top + grid_height + 40 + 32
    return _Layout(card=True, size=(width, height), dpi=72, axes=(left, height - top - grid_height, grid_width,
                                                                  grid_height),
                   cell_font=min(30, round(cell_w * 0.38), round(cell_h * 0.62)) if cols <= 40 and rows <= 48 else 0,
                   row_font=row_font, col_font=col_font,
                   col_every=max(1, math.ceil(cols * col_font * 2.2 / max(grid_width, 1))),
                   gap=3 if cell_w >= 40 else 1, title=_fit(grid.title, 30, width - 28, bold=True), legend=legend)


def _paper_layout(grid: Grid, cell_inches: float = 0.36, fontsize: float = 8.0) -> _Layout:
    rows, cols = grid.ratio.shape
    longest = max(len(text) for text in grid.col_labels)
    cell_w = max(cell_inches, min(1.2, longest * fontsize * 0.0085 + 0.08))
    label_inches = max(len(text) for text in grid.row_labels) * fontsize * 0.0085 + 0.35
    width = label_inches + 0.15 + cols * cell_w + 0.9
    height = 0.75 + rows * cell_inches * 0.75 + 0.3
    return _Layout(card=False, size=(72 * width, 72 * height), dpi=100,
                   axes=(72 * label_inches, 72 * 0.6, 72 * cols * cell_w, 72 * rows * cell_inches * 0.75),
                   cell_font=fontsize if cols <= 40 and rows <= 48 else 0, row_font=fontsize, col_font=fontsize,
                   col_every=1, gap=1.0, title=f"{grid.title}  (% of tokens)", legend=[])


# -------------------------------------------------------------------------------------------------------- drawing

def _cell_colours(grid: Grid) -> np.ndarray:
    """(rows, cols, 3) colours in 0-1: load / balanced on RdBu (white = balanced), grey cells flat."""
    rgba = colormaps[_CMAP](_NORM(np.clip(grid.ratio, 0.0, 2.0)))
    colours = rgba[..., :3]
    colours[grid.grey] = [int(_SHARED_COLOUR[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return colours


def _ink(rgb: np.ndarray) -> str:
    """Black on light cells, white on dark ones."""
    red, green, blue = rgb[:3]
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else "white"


def heatmap(grid: Grid, paper: bool = False) -> Figure:
    """The heatmap as a matplotlib figure: a dashboard card, or with ``paper`` a figure for a paper."""
    layout = _paper_layout(grid) if paper else _card_layout(grid)
    rows, cols = grid.ratio.shape
    width, height = layout.size
    figure = Figure(figsize=(width / 72, height / 72), dpi=layout.dpi)
    FigureCanvasAgg(figure)
    left, bottom, box_w, box_h = layout.axes
    axis = figure.add_axes((left / width, bottom / height, box_w / width, box_h / height))
    cmap = colormaps[_CMAP].with_extremes(bad=_SHARED_COLOUR)
    image = axis.imshow(np.ma.masked_array(np.clip(grid.ratio, 0, 2), mask=grid.grey), cmap=cmap, norm=_NORM,
                        aspect="auto", interpolation="nearest")
    colours = _cell_colours(grid)
    for r in range(rows):
        for c in range(cols):
            if layout.cell_font and grid.text[r][c]:
                ink = _NOTE_COLOUR if grid.grey[r, c] else _ink(colours[r, c])
                # Cards' large numbers without anti-aliasing: a card is logged every window, and this halves its PNG.
                axis.text(c, r, grid.text[r][c], ha="center", va="center_baseline", fontsize=layout.cell_font,
                          color=ink, antialiased=not layout.card)
    shown = range(0, cols, layout.col_every)
    axis.set_xticks(shown, [grid.col_labels[c] for c in shown], fontsize=layout.col_font)
    axis.set_yticks(range(rows), grid.row_labels, fontsize=layout.row_font)
    # The white lines between cells as two collections: minor ticks' grid lines (a Tick object each) were a fifth of
    # drawing a card.
    axis.vlines(np.arange(cols + 1) - 0.5, -0.5, rows - 0.5, color="white", linewidth=layout.gap)
    axis.hlines(np.arange(rows + 1) - 0.5, -0.5, cols - 0.5, color="white", linewidth=layout.gap)
    axis.set_xlim(-0.5, cols - 0.5)
    axis.set_ylim(rows - 0.5, -0.5)
    axis.tick_params(length=0, pad=8 if layout.card else 3.5)
    for spine in axis.spines.values():
        spine.set_visible(False)
    if layout.card:
        figure.text(14 / width, 1 - 10 / height, layout.title, fontsize=30, weight="bold", va="top")
        for i, line in enumerate(layout.legend):
            figure.text(14 / width, 1 - (54 + 29 * i) / height, line, fontsize=22, color=_NOTE_COLOUR, va="top")
        figure.text(left / width, 10 / height, grid.xlabel, fontsize=22, color=_NOTE_COLOUR, va="bottom")
        return figure
    fontsize = layout.col_font
    axis.set_xlabel(grid.xlabel, fontsize=fontsize)
    axis.set_ylabel(grid.ylabel, fontsize=fontsize)
    axis.set_title(layout.title, fontsize=fontsize + 1, loc="left")
    position = axis.get_position()
    bar_axis = figure.add_axes((position.x1 + 0.12 * 72 / width, position.y0, 0.1 * 72 / width, position.height))
    bar = figure.colorbar(image, cax=bar_axis, ticks=[0, 1, 2])
    bar.ax.set_yticklabels(["0", "even", "≥2×"], fontsize=fontsize - 1)
    bar.set_label("load ÷ even load", fontsize=fontsize - 1)
    return figure


def figure_rgb(figure: Figure) -> np.ndarray:
    """A matplotlib figure rendered at its own size and dpi, as an (H, W, 3) uint8 array."""
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_png(rgb: np.ndarray, path: Path) -> None:
    """Replaces ``path`` atomically, so a dashboard or a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.png")
    Image.fromarray(rgb).save(partial)
    partial.replace(path)


def layer_card(snapshot: HeadLoadSnapshot, title: str | None = None) -> np.ndarray:
    """Dashboard card, (H, W, 3) uint8: layers x heads."""
    return figure_rgb(heatmap(layer_grid(snapshot, title)))


def group_card(layer: LayerLoad, group: GroupLoad, max_groups: int | None = None) -> np.ndarray:
    """Dashboard card, (H, W, 3) uint8: routed heads x groups of one layer."""
    return figure_rgb(heatmap(group_grid(layer, group, max_groups)))


def over_time_card(history: list[tuple[int, dict[int, list[float]]]], layer: LayerLoad) -> np.ndarray | None:
    """Dashboard card, (H, W, 3) uint8: one routed layer's load per head over the training windows so far, a colour
    and a legend entry per head and the even load dashed; None before the layer's first window.

    Drawn here rather than left to a custom-scalars chart, which colours every line of a run alike, has no legend
    and no reference line. Sized in pixels as the heatmap cards are, to stay readable at TensorBoard's card size.
    """
    points = [(step, loads[layer.index]) for step, loads in history if layer.index in loads]
    if not points:
        return None
    steps = [step for step, _ in points]
    values = 100 * np.asarray([loads for _, loads in points], dtype=float)
    heads = values.shape[1]
    rows = min(heads + 1, 7)                        # legend entries per column: the heads, then the even line
    columns = math.ceil((heads + 1) / rows)
    legend_w = 120 * columns
    width = 600 + legend_w                          # as wide as a heatmap card, so its type reads alike
    legend = _wrap(f"% of tokens · top-{layer.top_k} of {layer.routed}: even = {_format_load(layer.balanced)} "
                   f"(dashed) · step {steps[-1]}", 22, width - 28)
    left, top, bottom = 76, 56 + 29 * len(legend) + 14, 60
    height = top + 270 + bottom
    figure = Figure(figsize=(width / 72, height / 72), dpi=72)
    FigureCanvasAgg(figure)
    axis = figure.add_axes((left / width, bottom / height, (width - left - legend_w - 16) / width,
                            (height - top - bottom) / height))
    palette = colormaps["tab10" if heads <= 10 else "tab20"]
    marker = "o" if len(steps) < 3 else None       # a line needs two windows; a first window shows as points
    for head in range(heads):
        axis.plot(steps, values[:, head], color=palette(head % palette.N), linewidth=3.5, marker=marker,
                  markersize=9, label=f"h{layer.shared + head}")
    axis.axhline(100 * layer.balanced, color="black", linestyle=(0, (4, 2)), linewidth=3,
                 label="even")
    axis.set_ylim(0, 102)
    axis.set_yticks([0, 50, 100])
    axis.tick_params(labelsize=24, length=4)
    axis.xaxis.set_major_locator(MaxNLocator(4, integer=True))
    axis.grid(alpha=0.3)
    for side in ("top", "right"):
        axis.spines[side].set_visible(False)
    axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1.04), ncol=columns, fontsize=24, frameon=False,
                handlelength=1.0, handletextpad=0.4, borderaxespad=0, columnspacing=0.6, labelspacing=0.25)
    figure.text(14 / width, 1 - 10 / height, _fit(f"L{layer.index} · head load over training", 30, width - 28,
                                                   bold=True), fontsize=30, weight="bold", va="top")
    for i, line in enumerate(legend):
        figure.text(14 / width, 1 - (54 + 29 * i) / height, line, fontsize=22, color=_NOTE_COLOUR, va="top")
    figure.text(14 / width, 8 / height, "step", fontsize=22, color=_NOTE_COLOUR, va="bottom")
    return figure_rgb(figure)


def snapshot_figures(snapshot: HeadLoadSnapshot, max_groups: int | None = None) -> dict[str, Figure]:
    """Every paper figure of a snapshot by file stem: ``layers`` and ``<kind>_layer_XX`` for each routed layer (the
    paper's Fig. 3 as a heatmap)."""
    figures = {"layers": heatmap(layer_grid(snapshot), paper=True)}
    for layer, group in snapshot.group_views():
        figures[f"{group.kind}_layer_{group.layer:02d}"] = heatmap(group_grid(layer, group, max_groups), paper=True)
    return figures


def loads_over_time(history: list[tuple[int, dict[int, list[float]]]], layers: list[LayerLoad]) -> Figure | None:
    """One panel per routed layer, one line per routed head: the custom-scalars view as a figure.

    ``history`` holds (step, layer -> routed loads) per logging window; ``layers`` the budgets the panels mark.
    """
    indices = sorted({index for _, loads in history for index in loads})
    if not indices:
        return None
    cols = min(len(indices), 3)
    rows = -(-len(indices) // cols)
    figure = Figure(figsize=(5.2 * cols, 3.4 * rows), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False)
    budget = {layer.index: layer for layer in layers}
    for axis, index in zip(axes.flat, indices, strict=False):
        points = [(step, loads[index]) for step, loads in history if index in loads]
        steps = [step for step, _ in points]
        values = np.asarray([loads for _, loads in points])
        layer = budget.get(index)
        first = layer.shared if layer is not None else 0
        for head in range(values.shape[1]):
            axis.plot(steps, values[:, head], label=f"head {first + head}", linewidth=1.5)
        if layer is not None:
            axis.axhline(layer.balanced, color="grey", linestyle="--", linewidth=1, label="even")
        axis.set_title(f"layer {index}", fontsize=12)
        axis.set_ylim(0, 1.02)
        axis.set_xlabel("step", fontsize=10)
        axis.set_ylabel("share of tokens", fontsize=10)
        axis.legend(fontsize=8, ncol=2, loc="best")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(indices):]:
        axis.axis("off")
    figure.suptitle("Routed-head load over training (one line per head)", fontsize=13)
    figure.tight_layout()
    return figure
