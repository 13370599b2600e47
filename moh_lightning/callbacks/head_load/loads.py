"""What the head-load dashboards measure, as plain numbers: the schema of ``head_load/loads.json``.

Apart from the counting (torch, a model) and the drawing (matplotlib) so that ``moh head-figures`` and the summary
read a finished run's numbers without either. A head's *load* is the share of tokens that use it (a non-zero gate):
shared heads serve every token (load 1), and a layer's routed heads share ``top_k`` slots per token, so each routed
head's *balanced* load is ``top_k / routed heads``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

LOADS_FILE = "loads.json"
HISTORY_FILE = "loads_history.jsonl"
SUMMARY_FILE = "summary.md"


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
    split: str                 # "train", "validation" or "test"
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

    def group_views(self) -> list[tuple[LayerLoad, GroupLoad]]:
        """(layer, group table) of every routed layer's group tables, in the snapshot's order."""
        by_index = {layer.index: layer for layer in self.layers}
        return [(by_index[group.layer], group) for group in self.groups
                if group.layer in by_index and by_index[group.layer].routed and group.labels]


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
