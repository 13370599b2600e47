"""Counting head loads: which heads each MoH layer's tokens used, summed over a window and over DDP ranks.

Apart from the callback so that the numbers are made in one place, knowing nothing of loggers or files: the counter
reads ``MoHHeads.last_gates`` after each batch, reduces its sums over ranks (every rank must call the closing
methods: they all-reduce), tracks routing collapse, and hands back a ``HeadLoadSnapshot`` of plain numbers.

A head is *loaded* by a token when its gate is non-zero; its load is the share of tokens that use it. Training counts
are summed over a logging window of batches, validation counts over the whole validation set, also per group of
samples (class, text source, diffusion timestep bucket).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from moh_lightning.callbacks.head_load.loads import GroupLoad, HeadLoadSnapshot, LayerLoad
from moh_lightning.layers import MoHHeads

log = logging.getLogger(__name__)

#: ``Strategy.reduce``: ``reduce(tensor, reduce_op="sum" | "max")`` over the ranks.
Reduce = Callable[..., torch.Tensor]


def layer_name(index: int) -> str:
    return f"layer_{index:02d}"


def take_gates(layer: MoHHeads) -> torch.Tensor:
    """The layer's gates of the last forward, which it then no longer holds.

    Under CUDA graphs (``compile_kwargs: {mode: reduce-overhead}``) they live in the graphs' memory, which the next
    step's replay writes over: counted within the step they were made in, and released.
    """
    gates, layer.last_gates = layer.last_gates, None
    return gates


def _layer_counts(gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h,) tokens that used each head, (h,) sum of gates, () real tokens, of one batch's (B, N, h) gates."""
    gates = gates.float()
    selected = gates > 0
    # A real token has a non-zero gate on every shared head and on its top-k, so padding shows as all zero.
    real = selected.any(-1)
    return selected.sum((0, 1)).float(), gates.sum((0, 1)), real.sum().float()


class _Sums:
    """Per-layer sums of one counting period: tokens per head, gates per head, real tokens."""

    def __init__(self) -> None:
        self.selected: dict[int, torch.Tensor] = {}  # layer -> (h,)
        self.gate_sum: dict[int, torch.Tensor] = {}  # layer -> (h,)
        self.tokens: dict[int, torch.Tensor] = {}    # layer -> ()

    def add(self, index: int, gates: torch.Tensor) -> None:
        for store, value in zip((self.selected, self.gate_sum, self.tokens), _layer_counts(gates), strict=True):
            store[index] = value if index not in store else store[index] + value

    def reduced(self, reduce: Reduce) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer -> (load, mean gate) per head, over every rank."""
        out = {}
        for index in sorted(self.selected):
            count = reduce(self.tokens[index].clone(), reduce_op="sum").clamp_min(1)
            out[index] = (reduce(self.selected[index].clone(), reduce_op="sum") / count,
                          reduce(self.gate_sum[index].clone(), reduce_op="sum") / count)
        return out


class HeadLoadCounter:
    """Head loads of a model's MoH layers, its collapse record and the history of its training windows.

    Args:
        low_load: A routed head used by fewer than this share of tokens counts as starved.
        collapse_windows: Windows in a row a routed head must starve to count as collapsed.
        timestep_buckets: Buckets of diffusion timesteps counted per validation; 0 counts none.
    """

    def __init__(self, low_load: float, collapse_windows: int, timestep_buckets: int) -> None:
        self.low_load = low_load
        self.collapse_windows = collapse_windows
        self.timestep_buckets = timestep_buckets
        self.layers: list[MoHHeads] = []
        self.collapse_events: list[dict] = []
        self.history: list[tuple[int, dict[int, list[float]]]] = []  # (step, layer -> routed loads) per window
        self.last_train: HeadLoadSnapshot | None = None
        self.last_val: HeadLoadSnapshot | None = None
        self._starved_windows: dict[int, torch.Tensor] = {}  # layer -> (routed heads,) consecutive starved windows
        self._collapse_seen: set[int] = set()
        self._window = _Sums()
        self.window_batches = 0
        self.start_validation("group")

    def find_layers(self, module: torch.nn.Module) -> None:
        # Not once at setup: a task may build its model later, in configure_model (the language model does).
        self.layers = [m for m in module.modules() if isinstance(m, MoHHeads)]

    def routed_layers(self) -> list[tuple[int, MoHHeads]]:
        """(index, layer) of the layers with a router; the index is the layer's position among all attention layers."""
        return [(i, layer) for i, layer in enumerate(self.layers) if layer.is_moh]

    def has_gates(self) -> bool:
        """Whether the last batch can be counted: the model routes, and every routed layer recorded its gates."""
        routed = self.routed_layers()
        return bool(routed) and all(layer.last_gates is not None for _, layer in routed)

    @property
    def collapsed_heads(self) -> list[tuple[int, int]]:
        """(layer, head) of every routed head that has collapsed so far, in the order they did."""
        return list(dict.fromkeys((event["layer"], event["head"]) for event in self.collapse_events))

    # ------------------------------------------------------------------------------------------- training windows
    def count_train_batch(self) -> bool:
        """Adds the last training batch's gates to the window; False when there was nothing to count."""
        if not self.has_gates():
            return False
        for index, layer in self.routed_layers():
            self._window.add(index, take_gates(layer))
        self.window_batches += 1
        return True

    def close_window(self, reduce: Reduce, step: int, epoch: int, run: str, warn: bool
                     ) -> tuple[HeadLoadSnapshot, dict[str, float]]:
        """The window's snapshot and its scalars (per-head loads, balance, collapsed heads); starts the next window.

        ``warn``: log the collapse warning (on one rank).
        """
        loads = self._window.reduced(reduce)
        self._window, self.window_batches = _Sums(), 0
        snapshot = self._snapshot(loads, step, epoch, run, "train")
        metrics: dict[str, float] = {}
        history: dict[int, list[float]] = {}
        for layer in snapshot.routed_layers:
            name = layer_name(layer.index)
            routed = layer.routed_load
            history[layer.index] = routed.tolist()
            for offset, value in enumerate(routed):
                metrics[f"head_load_per_head/{name}/head_{layer.shared + offset:02d}"] = float(value)
            metrics[f"head_load_balance/{name}/busiest_head_vs_balanced"] = float(routed.max() / layer.balanced)
            metrics[f"head_load_balance/{name}/idlest_head_vs_balanced"] = float(routed.min() / layer.balanced)
            collapsed = self._track_collapse(layer.index, torch.as_tensor(routed), layer.shared, step, warn)
            if collapsed:
                self._collapse_seen.add(layer.index)
            if layer.index in self._collapse_seen:  # the series starts at the layer's first collapse
                metrics[f"head_load/{name}/collapsed_heads"] = float(collapsed)
        self.last_train = snapshot
        self.history.append((step, history))
        return snapshot, metrics

    def _track_collapse(self, index: int, routed_load: torch.Tensor, shared: int, step: int, warn: bool) -> int:
        """Counts consecutive starved windows per routed head; warns once when a head reaches ``collapse_windows``."""
        previous = self._starved_windows.get(index, torch.zeros_like(routed_load, dtype=torch.long))
        starved = torch.where(routed_load < self.low_load, previous + 1, 0)
        self._starved_windows[index] = starved
        newly = (starved == self.collapse_windows).nonzero().flatten().tolist()
        for head in newly:
            self.collapse_events.append({"layer": index, "head": shared + head, "step": step,
                                         "windows": self.collapse_windows, "load": float(routed_load[head])})
        if newly and warn:
            heads = ", ".join(f"{shared + h} ({routed_load[h].item():.2%})" for h in newly)
            log.warning("Routing collapse in MoH layer %d at step %d: routed head(s) %s served under %.0f%% of tokens "
                        "for %d logging windows in a row. Raise model.init_args.load_balance_beta or lower the "
                        "learning rate.", index, step, heads, 100 * self.low_load, self.collapse_windows)
        return int((starved >= self.collapse_windows).sum().item())

    # ------------------------------------------------------------------------------------------------- validation
    def start_validation(self, group_kind: str) -> None:
        """Forgets the previous validation; ``group_kind`` names what the task's ``head_load_groups`` returns."""
        self._val = _Sums()
        self._group_counts: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer) -> (groups, routed heads)
        self._group_tokens: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer) -> (groups,)
        self._group_kind = group_kind

    def count_validation_batch(self, groups: torch.Tensor | None, timesteps: torch.Tensor | None,
                               num_timesteps: int) -> None:
        """Adds the last validation batch: per layer, and per sample group / timestep bucket (``timesteps`` of
        ``num_timesteps``) for the layers with routed heads."""
        if not self.has_gates():
            return
        if not self.timestep_buckets:
            timesteps = None
        for index, layer in self.routed_layers():
            gates = take_gates(layer)
            self._val.add(index, gates)
            if not layer.router.num_routed_heads:
                continue
            used = gates > 0
            per_sample = used[..., layer.router.num_shared_heads:].float().sum(1)  # (B, routed) tokens per head
            sample_tokens = used.any(-1).float().sum(1)                          # (B,) real tokens
            if groups is not None and len(groups) == len(gates):
                self._add_groups(self._group_kind, index, groups.to(gates.device).long(), per_sample, sample_tokens)
            if timesteps is not None and len(timesteps) == len(gates):
                bucket = timesteps.to(gates.device).long() * self.timestep_buckets // num_timesteps
                bucket = bucket.clamp(0, self.timestep_buckets - 1)
                self._add_groups("timestep", index, bucket, per_sample, sample_tokens, size=self.timestep_buckets)

    def _add_groups(self, kind: str, index: int, groups: torch.Tensor, per_sample: torch.Tensor,
                    tokens: torch.Tensor, size: int | None = None) -> None:
        key = (kind, index)
        size = max(size or 0, int(groups.max().item()) + 1)
        counts = self._group_counts.get(key)
        if counts is None:
            counts = per_sample.new_zeros(size, per_sample.shape[1])
            self._group_tokens[key] = tokens.new_zeros(size)
        elif size > len(counts):
            counts = torch.cat([counts, counts.new_zeros(size - len(counts), counts.shape[1])])
            self._group_tokens[key] = torch.cat([self._group_tokens[key],
                                                 tokens.new_zeros(size - len(self._group_tokens[key]))])
        counts.index_add_(0, groups, per_sample)
        self._group_tokens[key].index_add_(0, groups, tokens)
        self._group_counts[key] = counts

    def _gather_groups(self, reduce: Reduce, key: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums one group table over ranks; ranks may have seen different numbers of groups."""
        counts, tokens = self._group_counts[key], self._group_tokens[key]
        size = reduce(torch.tensor(len(tokens), device=tokens.device, dtype=torch.float), reduce_op="max")
        grow = int(size.item()) - len(tokens)
        counts = torch.cat([counts, counts.new_zeros(grow, counts.shape[1])])
        tokens = torch.cat([tokens, tokens.new_zeros(grow)])
        return reduce(counts, reduce_op="sum"), reduce(tokens, reduce_op="sum")

    def close_validation(self, reduce: Reduce, step: int, epoch: int, run: str,
                         labels: Callable[[str, int], list[str]], split: str = "validation"
                         ) -> HeadLoadSnapshot | None:
        """The validation's snapshot (or the test's, ``split``), None when nothing was counted; ``labels(kind,
        count)`` names the groups."""
        if not self._val.selected:
            return None
        loads = self._val.reduced(reduce)
        groups = []
        for key in sorted(self._group_counts):
            counts, tokens = self._gather_groups(reduce, key)
            kind, index = key
            load = counts / tokens[:, None].clamp_min(1)
            groups.append(GroupLoad(layer=index, kind=kind, labels=labels(kind, len(load)),
                                    load=[[round(v, 6) for v in row] for row in load.tolist()],
                                    tokens=tokens.tolist()))
        self.last_val = self._snapshot(loads, step, epoch, run, split, groups)
        return self.last_val

    # --------------------------------------------------------------------------------------------------- snapshot
    def _snapshot(self, loads: dict[int, tuple[torch.Tensor, torch.Tensor]], step: int, epoch: int, run: str,
                  split: str, groups: list[GroupLoad] | None = None) -> HeadLoadSnapshot:
        layers = []
        for index, layer in enumerate(self.layers):
            load, gate = loads.get(index, (None, None))
            if layer.is_moh and load is None:
                continue
            layers.append(_layer_load(index, layer, load, gate))
        return HeadLoadSnapshot(step=step, epoch=epoch, split=split, layers=layers, groups=groups or [], run=run)


def _layer_load(index: int, layer: MoHHeads, load: torch.Tensor | None, mean_gate: torch.Tensor | None
                ) -> LayerLoad:
    if not layer.is_moh:
        return LayerLoad(index=index, num_heads=layer.num_heads, shared=layer.num_heads, top_k=0,
                         load=[1.0] * layer.num_heads, dense=True)
    router = layer.router
    return LayerLoad(index=index, num_heads=layer.num_heads, shared=router.num_shared_heads,
                     top_k=router.top_k if router.num_routed_heads else 0,
                     load=[round(v, 6) for v in load.tolist()],
                     mean_gate=None if mean_gate is None else [round(v, 6) for v in mean_gate.tolist()])


__all__ = ["HeadLoadCounter", "layer_name"]
