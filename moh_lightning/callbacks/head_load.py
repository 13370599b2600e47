"""Head-load dashboards: how much each MoH layer uses each head, in TensorBoard.

Counts come from every MoH layer's ``last_gates`` after each training batch (a head is "loaded" by a token
when its gate is non-zero), summed over the logging window and over DDP ranks. At the end of validation, the
routed-head load per class of the deepest MoH layer that has routed heads (paper Fig. 3) is drawn with
matplotlib, logged as an image and saved as ``head_load/epoch_XXX.png`` in the run folder. The groups come from
the task's ``MoHTask.head_load_groups(batch)``.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.figure import Figure

from moh_lightning.layers import MoHAttention, moh_layers
from moh_lightning.tasks.base import MoHTask

log = logging.getLogger(__name__)


def head_load_statistics(load: torch.Tensor, low_load: float) -> dict[str, float]:
    """Summary scalars of one layer's per-head load (fraction of tokens using each routed head).

    Entropy is of the load normalised to a distribution, divided by log(#heads): 1 means perfectly even.
    """
    share = load / load.sum().clamp_min(1e-12)
    entropy = -(share * share.clamp_min(1e-12).log()).sum() / math.log(max(len(load), 2))
    return {
        "load_entropy": entropy.item(),
        "max_min_load_ratio": (load.max() / load.min().clamp_min(1e-12)).item(),
        "heads_under_low_load": (load < low_load).sum().item(),
    }


class HeadLoadCallback(Callback):
    """Logs per-layer head load and mean gate per head, and the per-class load of the last layer.

    Args:
        log_every_n_steps: Length of the logging window, in training batches; the Trainer's
            ``log_every_n_steps`` when None.
        low_load: A head used by fewer than this fraction of tokens counts as starved (default 1%).
        max_plot_classes: Classes drawn in the per-class figure (the first ones by id).
        collapse_windows: A routed head starved for this many logging windows in a row counts as collapsed: a
            warning names it, and ``head_load/layer_XX/collapsed_heads`` counts the layer's collapsed heads.
    """

    def __init__(self, log_every_n_steps: int | None = None, low_load: float = 0.01,
                 max_plot_classes: int = 10, collapse_windows: int = 5) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"HeadLoadCallback log_every_n_steps={log_every_n_steps} must be at least 1.")
        if collapse_windows < 1:
            raise ValueError(f"HeadLoadCallback collapse_windows={collapse_windows} must be at least 1.")
        self.log_every_n_steps = log_every_n_steps
        self.low_load = low_load
        self.max_plot_classes = max_plot_classes
        self.collapse_windows = collapse_windows
        self._layers: list[MoHAttention] = []
        self._plot_layer: MoHAttention | None = None
        self._starved_windows: dict[int, torch.Tensor] = {}  # layer -> (routed heads,) consecutive starved windows
        self._reset_window()
        self._class_counts: torch.Tensor | None = None  # (classes, h) routed loads of the last layer
        self._class_tokens: torch.Tensor | None = None  # (classes,)

    def _reset_window(self) -> None:
        self._selected: list[torch.Tensor] = []  # per layer (h,) tokens that used each head
        self._gate_sum: list[torch.Tensor] = []  # per layer (h,) sum of gates
        self._tokens: list[torch.Tensor] = []    # per layer () real tokens seen
        self._batches = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._window = self.log_every_n_steps or trainer.log_every_n_steps

    def _find_layers(self, pl_module: LightningModule) -> None:
        # Not in setup: a task may build its model later, in configure_model (the language model does).
        self._layers = moh_layers(pl_module)
        # The per-class figure shows routed heads, so it reads the deepest layer that has any (in the DiT
        # configs the last layers share every head, which would give an empty figure).
        routed = [layer for layer in self._layers if layer.router.num_routed_heads]
        self._plot_layer = routed[-1] if routed else None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._find_layers(pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._find_layers(pl_module)

    @staticmethod
    def _layer_counts(layer: MoHAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gates = layer.last_gates.float()                    # (B, N, h)
        selected = gates > 0
        # A real token has a non-zero gate on every shared head and on its top-k, so padding shows as all zero.
        real = selected.any(-1)
        return selected.sum((0, 1)).float(), gates.sum((0, 1)), real.sum().float()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self._layers or any(layer.last_gates is None for layer in self._layers):
            return
        counts = [self._layer_counts(layer) for layer in self._layers]
        if not self._selected:
            self._selected = [c[0] for c in counts]
            self._gate_sum = [c[1] for c in counts]
            self._tokens = [c[2] for c in counts]
        else:
            for i, (selected, gate_sum, tokens) in enumerate(counts):
                self._selected[i] += selected
                self._gate_sum[i] += gate_sum
                self._tokens[i] += tokens
        self._batches += 1
        if self._batches >= self._window:
            self._log_window(trainer, pl_module)

    def _log_window(self, trainer: Trainer, pl_module: LightningModule) -> None:
        reduce = trainer.strategy.reduce
        metrics: dict[str, float] = {}
        step = trainer.global_step
        for index, layer in enumerate(self._layers):
            tokens = reduce(self._tokens[index].clone(), reduce_op="sum").clamp_min(1)
            load = reduce(self._selected[index].clone(), reduce_op="sum") / tokens
            mean_gate = reduce(self._gate_sum[index].clone(), reduce_op="sum") / tokens
            shared = layer.router.num_shared_heads
            routed_load = load[shared:]
            if routed_load.numel():
                for key, value in head_load_statistics(routed_load, self.low_load).items():
                    metrics[f"head_load/layer_{index:02d}/{key}"] = value
                metrics[f"head_load/layer_{index:02d}/collapsed_heads"] = self._track_collapse(
                    trainer, index, routed_load, shared)
            if trainer.is_global_zero:
                _log_per_head(trainer, f"head_load/layer_{index:02d}/load", load, step)
                _log_per_head(trainer, f"head_load/layer_{index:02d}/mean_gate", mean_gate, step)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        self._reset_window()

    def _track_collapse(self, trainer: Trainer, index: int, routed_load: torch.Tensor, shared: int) -> int:
        """Counts consecutive starved windows per routed head; warns once when a head reaches ``collapse_windows``."""
        previous = self._starved_windows.get(index, torch.zeros_like(routed_load, dtype=torch.long))
        starved = torch.where(routed_load < self.low_load, previous + 1, 0)
        self._starved_windows[index] = starved
        newly = (starved == self.collapse_windows).nonzero().flatten()
        if len(newly) and trainer.is_global_zero:
            heads = ", ".join(f"{shared + h} ({routed_load[h].item():.2%})" for h in newly.tolist())
            log.warning("Routing collapse in MoH layer %d at step %d: routed head(s) %s served under %.0f%% of tokens "
                        "for %d logging windows in a row. Raise model.init_args.load_balance_beta or lower the "
                        "learning rate.", index, trainer.global_step, heads, 100 * self.low_load,
                        self.collapse_windows)
        return int((starved >= self.collapse_windows).sum().item())

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._class_counts = self._class_tokens = None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._plot_layer is None or not isinstance(pl_module, MoHTask) or self._plot_layer.last_gates is None:
            return
        groups = pl_module.head_load_groups(batch)
        if groups is None:
            return
        gates = self._plot_layer.last_gates
        per_sample = (gates > 0).float().sum(1)                    # (B, h) tokens using each head
        tokens = (gates > 0).any(-1).float().sum(1)                # (B,)
        groups = groups.to(gates.device).long()
        size = int(groups.max().item()) + 1
        if self._class_counts is None:
            self._class_counts = gates.new_zeros(size, gates.shape[-1])
            self._class_tokens = gates.new_zeros(size)
        elif size > len(self._class_tokens):
            grow = size - len(self._class_tokens)
            self._class_counts = torch.cat([self._class_counts, gates.new_zeros(grow, gates.shape[-1])])
            self._class_tokens = torch.cat([self._class_tokens, gates.new_zeros(grow)])
        self._class_counts.index_add_(0, groups, per_sample)
        self._class_tokens.index_add_(0, groups, tokens)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self._class_counts is None:
            return
        counts, tokens = self._gather_classes(trainer)
        # trainer.log_dir broadcasts from rank 0 under DDP / FSDP: every rank must ask, or rank 0 waits forever.
        folder = Path(trainer.log_dir or trainer.default_root_dir) / "head_load"
        if not trainer.is_global_zero:
            return
        shared = self._plot_layer.router.num_shared_heads
        load = counts[:, shared:] / tokens[:, None].clamp_min(1)
        figure = plot_class_head_load(load[: self.max_plot_classes], first_head=shared,
                                      title="Routed-head load, deepest routed MoH layer "
                                            f"(epoch {trainer.current_epoch})")
        folder.mkdir(parents=True, exist_ok=True)
        figure.savefig(folder / f"epoch_{trainer.current_epoch:03d}.png", dpi=100)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("head_load/per_class_last_layer", figure, trainer.global_step,
                                             close=False)

    def _gather_classes(self, trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums the per-class counts over ranks; ranks may have seen different numbers of classes."""
        size = trainer.strategy.reduce(torch.tensor(len(self._class_tokens), device=self._class_tokens.device,
                                                    dtype=torch.float), reduce_op="max")
        grow = int(size.item()) - len(self._class_tokens)
        counts = torch.cat([self._class_counts, self._class_counts.new_zeros(grow, self._class_counts.shape[1])])
        tokens = torch.cat([self._class_tokens, self._class_tokens.new_zeros(grow)])
        return trainer.strategy.reduce(counts, reduce_op="sum"), trainer.strategy.reduce(tokens, reduce_op="sum")


def _log_per_head(trainer: Trainer, tag: str, values: torch.Tensor, step: int) -> None:
    """A TensorBoard histogram whose buckets are the head ids, so it reads as load per head."""
    values = values.detach().double().cpu()
    heads = len(values)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_histogram_raw(
                tag, min=0.0, max=float(heads), num=heads, sum=float(values.sum()),
                sum_squares=float((values ** 2).sum()), bucket_limits=[float(i + 1) for i in range(heads)],
                bucket_counts=values.tolist(), global_step=step)


def plot_class_head_load(load: torch.Tensor, first_head: int = 0, title: str = "") -> Figure:
    """Bar charts of routed-head load (classes x heads), one panel per class, as the paper's Fig. 3."""
    num_classes, heads = load.shape
    cols = min(num_classes, 5)
    rows = math.ceil(num_classes / cols)
    # A bare Figure (no pyplot) needs no GUI backend and is freed with its last reference.
    figure = Figure(figsize=(2.6 * cols, 2.2 * rows))
    axes = figure.subplots(rows, cols, squeeze=False, sharey=True)
    ids = list(range(first_head, first_head + heads))
    for index, axis in enumerate(axes.flat):
        if index >= num_classes:
            axis.axis("off")
            continue
        axis.bar(ids, load[index].cpu().numpy(), color="tab:blue")
        axis.set_title(f"class {index}", fontsize=9)
        axis.set_xlabel("routed head id", fontsize=8)
        axis.set_xticks(ids)
        axis.tick_params(labelsize=7)
    axes[0][0].set_ylabel("share of tokens", fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return figure
