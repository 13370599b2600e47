"""Head-load numbers, figures and the run summary, shared by ``HeadLoadCallback`` and ``moh head-figures``.

Everything here works on plain numbers, so a finished run's ``head_load/loads.json`` renders without a model or a
checkpoint. A head's *load* is the share of tokens that use it (a non-zero gate): shared heads serve every token
(load 1), and a layer's routed heads share ``top_k`` slots per token, so each routed head's *balanced* load is
``top_k / routed heads``. Every heatmap colours a cell by load / balanced load (white = balanced, red = busier,
blue = idler, on a fixed 0-2 scale) and writes the exact load in it.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from matplotlib import colormaps, font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from PIL import Image, ImageDraw, ImageFont

LOADS_FILE = "loads.json"
HISTORY_FILE = "loads_history.jsonl"
SUMMARY_FILE = "summary.md"
_CMAP = "RdBu_r"
_SHARED_COLOUR = "#d9d9d9"


@dataclass
class LayerLoad:
    """One attention layer's head budget and measured load per head."""

    index: int                 # position among the model's attention layers (block number)
    num_heads: int
    shared: int                # always-on heads: the first ``shared`` heads; all of them in a dense layer
    top_k: int                 # routed heads per token (0 when the layer has none)
    load: list[float]          # (num_heads,) share of tokens that used each head
    mean_gate: list[float] | None = None  # (num_heads,) mean gate per token, 0 where unselected
    dense: bool = False        # plain multi-head attention, no router

    @property
    def routed(self) -> int:
        return 0 if self.dense else self.num_heads - self.shared

    @property
    def balanced(self) -> float:
        """The load every routed head would have if the router spread tokens evenly."""
        return self.top_k / self.routed if self.routed else 1.0

    @property
    def routed_load(self) -> np.ndarray:
        return np.asarray(self.load[self.shared:], dtype=float) if self.routed else np.zeros(0)

    def budget(self) -> str:
        if self.dense:
            return f"dense: all {self.num_heads} heads"
        if not self.routed:
            return f"{self.shared} shared heads (no routed heads)"
        return f"{self.shared} shared + top-{self.top_k} of {self.routed} routed"


@dataclass
class GroupLoad:
    """Routed-head load of one layer per group of samples (class, text source or diffusion timestep bucket)."""

    layer: int
    kind: str                  # "class", "source", "timestep", ...
    labels: list[str]
    load: list[list[float]]    # (groups, routed heads)
    tokens: list[float]        # (groups,) tokens counted per group


@dataclass
class HeadLoadSnapshot:
    """Everything one heatmap set is drawn from, as saved in ``head_load/loads.json``."""

    step: int
    epoch: int
    split: str                 # "validation" or "train"
    layers: list[LayerLoad]
    groups: list[GroupLoad] = field(default_factory=list)
    run: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=None, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> HeadLoadSnapshot:
        return cls(step=data["step"], epoch=data["epoch"], split=data["split"], run=data.get("run", ""),
                   layers=[LayerLoad(**layer) for layer in data["layers"]],
                   groups=[GroupLoad(**group) for group in data.get("groups", [])])

    @classmethod
    def load(cls, path: str | Path) -> HeadLoadSnapshot:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, folder: Path) -> Path:
        """Writes ``loads.json`` (replaced atomically) and appends the per-layer loads to ``loads_history.jsonl``."""
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / LOADS_FILE
        partial = target.with_suffix(".json.partial")
        partial.write_text(self.to_json())
        partial.replace(target)
        with open(folder / HISTORY_FILE, "a") as history:
            history.write(json.dumps({"step": self.step, "epoch": self.epoch, "split": self.split,
                                      "load": [[round(v, 6) for v in layer.load] for layer in self.layers]}) + "\n")
        return target

    @property
    def routed_layers(self) -> list[LayerLoad]:
        return [layer for layer in self.layers if layer.routed]


def load_entropy(load: np.ndarray) -> float:
    """Entropy of the routed loads normalised to a distribution, divided by log(#heads): 1 = perfectly even."""
    load = np.asarray(load, dtype=float)
    if len(load) < 2 or load.sum() <= 0:
        return 1.0
    share = load / load.sum()
    nonzero = share[share > 0]
    return float(-(nonzero * np.log(nonzero)).sum() / math.log(len(load)))


def mean_load_entropy(layers: list[LayerLoad]) -> float | None:
    """Mean of ``load_entropy`` over the layers that route; None when none does."""
    values = [load_entropy(layer.routed_load) for layer in layers if layer.routed > 1]
    return float(np.mean(values)) if values else None


# ----------------------------------------------------------------------------------------------------------- figures

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
    where = "validation" if snapshot.split == "validation" else "train"
    return Grid(ratio=ratio, text=text, grey=grey, row_labels=[f"L{layer.index}" for layer in layers],
                col_labels=[str(h) for h in range(heads)],
                title=title or f"Head load · {where} · step {snapshot.step}",
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


_NORM = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=2.0)


def _cell_colours(grid: Grid) -> np.ndarray:
    """(rows, cols, 3) uint8 colours: load / balanced on RdBu (white = balanced), grey cells flat."""
    rgba = colormaps[_CMAP](_NORM(np.clip(grid.ratio, 0.0, 2.0)))
    colours = (rgba[..., :3] * 255).round().astype(np.uint8)
    colours[grid.grey] = _hex_rgb(_SHARED_COLOUR)
    return colours


def _hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def _ink(rgb) -> tuple[int, int, int]:
    red, green, blue = (c / 255 for c in rgb[:3])
    return (0, 0, 0) if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else (255, 255, 255)


# ------------------------------------------------------------------------------------------- dashboard cards (PIL)
# TensorBoard's Images tab scales an image to a card about 330 px wide; its Time Series tab to at most ~210 px high
# and ~400 px wide. Cards are therefore wide (cells 80 x 50 px) with cell text ~40% of a cell's width, which stays
# >= 10 px on a card up to about 12 columns. They are drawn with PIL: a few milliseconds, so one per logging window.
_CELL_W, _CELL_H = 80, 50


@lru_cache(maxsize=32)
def _font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    path = font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans", weight="bold" if bold else "normal"))
    return ImageFont.truetype(path, size)


def _fitting_font(texts: list[str], width: int, size: int, smallest: int = 12) -> ImageFont.FreeTypeFont:
    """The largest font up to ``size`` at which every text fits in ``width`` pixels."""
    while size > smallest and max((_font(size).getlength(text) for text in texts), default=0) > width:
        size -= 1
    return _font(size)


def card_image(grid: Grid) -> np.ndarray:
    """The heatmap as an (H, W, 3) uint8 image sized for a dashboard card."""
    rows, cols = grid.ratio.shape
    tick = _font(24)
    # Columns widen for a few long labels (text sources), and narrow when there are many.
    cell_w = _CELL_W if cols <= 12 else max(30, 960 // cols)
    if cols <= 6:
        cell_w = max(cell_w, min(200, 12 + max(int(tick.getlength(text)) for text in grid.col_labels)))
    cell_h = _CELL_H if rows <= 16 else max(22, 800 // rows)
    text_size = min(30, round(cell_w * 0.38), round(cell_h * 0.62)) if cols <= 40 and rows <= 48 else 0
    col_font = _fitting_font(grid.col_labels, cell_w - 6, 24)
    row_font = _fitting_font(grid.row_labels, 200, min(24, cell_h - 4))
    title_font, note_font, label_font = _font(30, bold=True), _font(22), _font(22)
    left = 14 + max(int(row_font.getlength(text)) for text in grid.row_labels) + 12
    grid_width = cols * cell_w
    width = max(left + grid_width + 16, 560)
    legend_lines = _wrap(grid.legend, note_font, width - 28)
    top = 56 + 29 * len(legend_lines) + 10
    height = top + rows * cell_h + 40 + 32
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    # The large cell numbers are drawn without anti-aliasing (a card is logged every window: this halves its PNG);
    # the smaller labels keep it, or a browser's downscaling makes "h2" look like "F2".
    draw.fontmode = "1"
    colours = _cell_colours(grid)
    cell_font = _font(text_size) if text_size >= 9 else None
    gap = 3 if cell_w >= 40 else 1
    for r in range(rows):
        for c in range(cols):
            x0, y0 = left + c * cell_w, top + r * cell_h
            fill = tuple(int(v) for v in colours[r, c])
            draw.rectangle([x0, y0, x0 + cell_w - gap, y0 + cell_h - gap], fill=fill)
            if cell_font is not None and grid.text[r][c]:
                ink = (70, 70, 70) if grid.grey[r, c] else _ink(fill)
                draw.text((x0 + (cell_w - gap) / 2, y0 + (cell_h - gap) / 2), grid.text[r][c], fill=ink,
                          font=cell_font, anchor="mm")
    draw.fontmode = "L"
    for r, text in enumerate(grid.row_labels):
        draw.text((left - 10, top + r * cell_h + (cell_h - gap) / 2), text, fill="black", font=row_font, anchor="rm")
    every = max(1, math.ceil(cols * col_font.size * 2.2 / max(grid_width, 1)))
    for c in range(0, cols, every):
        draw.text((left + c * cell_w + (cell_w - gap) / 2, top + rows * cell_h + 6), grid.col_labels[c],
                  fill="black", font=col_font, anchor="ma")
    draw.text((left, height - 10), grid.xlabel, fill=(70, 70, 70), font=label_font, anchor="ld")
    draw.text((14, 10), _fit(grid.title, title_font, width - 28), fill="black", font=title_font)
    for i, line in enumerate(legend_lines):
        draw.text((14, 54 + 29 * i), line, fill=(70, 70, 70), font=note_font)
    return np.asarray(image)


def _wrap(text: str, font: ImageFont.FreeTypeFont, width: int) -> list[str]:
    """``text`` broken at its `` · `` separators into lines of at most ``width`` pixels."""
    lines: list[str] = []
    for part in text.split(" · "):
        candidate = f"{lines[-1]} · {part}" if lines else part
        if lines and font.getlength(candidate) <= width:
            lines[-1] = candidate
        else:
            lines.append(_fit(part, font, width))
    return lines


def _fit(text: str, font: ImageFont.FreeTypeFont, width: int) -> str:
    """``text`` cut with an ellipsis to ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def layer_card(snapshot: HeadLoadSnapshot, title: str | None = None) -> np.ndarray:
    return card_image(layer_grid(snapshot, title))


def group_card(layer: LayerLoad, group: GroupLoad, max_groups: int | None = None) -> np.ndarray:
    return card_image(group_grid(layer, group, max_groups))


# ------------------------------------------------------------------------------------------ paper figures (matplotlib)

def paper_figure(grid: Grid, cell_inches: float = 0.36, fontsize: float = 8.0) -> Figure:
    """The heatmap as a vector matplotlib figure for a paper: cells of ``cell_inches``, a colour bar."""
    rows, cols = grid.ratio.shape
    longest = max(len(text) for text in grid.col_labels)
    cell_w = max(cell_inches, min(1.2, longest * fontsize * 0.0085 + 0.08))
    label_inches = max(len(text) for text in grid.row_labels) * fontsize * 0.0085 + 0.35
    width = label_inches + 0.15 + cols * cell_w + 0.9
    height = 0.75 + rows * cell_inches * 0.75 + 0.3
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    axis = figure.add_axes((label_inches / width, 0.6 / height, cols * cell_w / width,
                            rows * cell_inches * 0.75 / height))
    cmap = colormaps[_CMAP].with_extremes(bad=_SHARED_COLOUR)
    image = axis.imshow(np.ma.masked_array(np.clip(grid.ratio, 0, 2), mask=grid.grey), cmap=cmap, norm=_NORM,
                        aspect="auto", interpolation="nearest")
    cell_font = fontsize if cols <= 40 and rows <= 48 else 0
    colours = _cell_colours(grid)
    for r in range(rows):
        for c in range(cols):
            if cell_font and grid.text[r][c]:
                ink = "#444444" if grid.grey[r, c] else np.asarray(_ink(colours[r, c])) / 255
                axis.text(c, r, grid.text[r][c], ha="center", va="center", fontsize=cell_font, color=ink)
    axis.set_xticks(range(cols), grid.col_labels, fontsize=fontsize)
    axis.set_yticks(range(rows), grid.row_labels, fontsize=fontsize)
    axis.set_xticks(np.arange(cols + 1) - 0.5, minor=True)
    axis.set_yticks(np.arange(rows + 1) - 0.5, minor=True)
    axis.grid(which="minor", color="white", linewidth=1.0)
    axis.tick_params(which="both", length=0)
    for spine in axis.spines.values():
        spine.set_visible(False)
    axis.set_xlabel(grid.xlabel, fontsize=fontsize)
    axis.set_ylabel(grid.ylabel, fontsize=fontsize)
    axis.set_title(f"{grid.title}  (% of tokens)", fontsize=fontsize + 1, loc="left")
    position = axis.get_position()
    bar_axis = figure.add_axes((position.x1 + 0.12 / width, position.y0, 0.1 / width, position.height))
    bar = figure.colorbar(image, cax=bar_axis, ticks=[0, 1, 2])
    bar.ax.set_yticklabels(["0", "even", "≥2×"], fontsize=fontsize - 1)
    bar.set_label("load ÷ even load", fontsize=fontsize - 1)
    return figure


def layer_heatmap(snapshot: HeadLoadSnapshot, title: str | None = None) -> Figure:
    """Paper figure: layers x heads (in % of tokens), shared heads ``S`` on grey."""
    return paper_figure(layer_grid(snapshot, title))


def group_heatmap(layer: LayerLoad, group: GroupLoad, max_groups: int | None = None,
                  title: str | None = None) -> Figure:
    """Paper figure: groups x routed heads of one layer (the paper's Fig. 3 as a heatmap)."""
    return paper_figure(group_grid(layer, group, max_groups, title))


def figure_rgb(figure: Figure) -> np.ndarray:
    """A matplotlib figure rendered at its own size and dpi, as an (H, W, 3) uint8 array."""
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def group_views(snapshot: HeadLoadSnapshot) -> list[tuple[LayerLoad, GroupLoad]]:
    """(layer, group table) of every routed layer's group tables, in the snapshot's order."""
    by_index = {layer.index: layer for layer in snapshot.layers}
    return [(by_index[group.layer], group) for group in snapshot.groups
            if group.layer in by_index and by_index[group.layer].routed and group.labels]


def snapshot_figures(snapshot: HeadLoadSnapshot, max_groups: int | None = None) -> dict[str, Figure]:
    """Every paper figure of a snapshot by file stem: ``layers`` and ``<kind>_layer_XX`` for each routed layer."""
    figures = {"layers": layer_heatmap(snapshot)}
    for layer, group in group_views(snapshot):
        figures[f"{group.kind}_layer_{group.layer:02d}"] = group_heatmap(layer, group, max_groups)
    return figures


# ----------------------------------------------------------------------------------------------------------- summary

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
