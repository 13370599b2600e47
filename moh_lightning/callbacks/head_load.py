"""Head-load dashboards: which heads each MoH layer uses, in TensorBoard, Weights & Biases, MLflow and the run folder.

A head is *loaded* by a token when its gate is non-zero (``MoHAttention.last_gates``); its load is the share of tokens
that use it. Counts are summed over a logging window of training batches and over DDP ranks, and over the whole
validation set. A routed head's *balanced* load is top-k / routed heads. What is logged, with the same names in every
task (TensorBoard groups tags by their first path part, so the images come first, in one group):

* ``head_load/heatmap_train`` (every logging window) and ``head_load/heatmap_val`` (each validation): layers x heads,
  shared heads marked, loads in % of tokens written in the cells, coloured by load / balanced load.
* ``head_load/per_<group>_layer_XX`` (each validation, every routed layer): groups x routed heads, the groups being
  what the task's ``head_load_groups`` returns, named by its ``head_load_group_name`` (class, source), and for a task
  that exposes ``last_timesteps`` (diffusion) also the timestep in ``timestep_buckets`` buckets (``per_timestep``).
* ``head_load_per_head/layer_XX/head_YY``: the exact load of every routed head each window (shared heads serve every
  token and are not repeated as constant series); a custom-scalars layout draws one chart per layer, one line per
  head.
* ``head_load_balance/layer_XX/busiest_head_vs_balanced`` and ``.../idlest_head_vs_balanced``: the largest and the
  smallest routed load divided by the balanced load (1 = even, 0 = an unused head), and at the end of training
  ``head_load_balance/final_load_entropy`` (mean over routed layers of the normalised entropy of the routed loads).
* ``head_load/layer_XX/collapsed_heads``: only from the first window in which a head of that layer collapsed.
* HParams under one vocabulary (``run_hparams``: ``moh/activated_fraction``, ``moh/shared_heads``, ``moh/top_k``,
  ``moh/load_balance_beta``, ``moh/router`` ...) with the run's final metrics (``hparam_metrics``).
* ``head_load/summary`` at the end of training: a markdown report per layer (Text tab and ``head_load/summary.md``).

TensorBoard gets images, scalars, the custom-scalars layout, text and HParams; Weights & Biases images, scalars,
line-series charts, a table, HTML text and config; MLflow step images, metrics, figures, text and params. Whatever
the logger (CSV or none too), the run folder's ``head_load/`` receives the latest heatmaps as PNG, ``loads.json``
(what ``moh head-figures`` draws paper figures from), ``loads_history.jsonl``, ``loads_over_time.png`` and
``summary.md``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from moh_lightning.callbacks.head_load_plots import (
    SUMMARY_FILE,
    GroupLoad,
    HeadLoadSnapshot,
    LayerLoad,
    figure_rgb,
    group_card,
    group_views,
    layer_card,
    mean_load_entropy,
    summary_markdown,
)
from moh_lightning.layers import MoHAttention, QueryNormRouter, activated_head_fraction
from moh_lightning.tasks.base import MoHTask

log = logging.getLogger(__name__)

#: Metrics shown beside the hyper-parameters (the last value logged in the run); a task logs the ones it has.
DEFAULT_HPARAM_METRICS = ("val/loss", "val/acc1", "val/bpb", "head_load_balance/final_load_entropy", "samples/fid")


def _layer(index: int) -> str:
    return f"layer_{index:02d}"


def _per_layer_value(values: list[float]) -> float | int:
    """One number for a per-layer setting: the value when every layer has it, else the mean over layers."""
    if len(set(values)) == 1:
        return values[0]
    return round(float(np.mean(values)), 3)


def run_hparams(pl_module: LightningModule, layers: list[MoHAttention]) -> dict[str, Any]:
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


class HeadLoadCallback(Callback):
    """Head-load heatmaps, per-head scalars, HParams and a summary for every MoH task and logger.

    Args:
        log_every_n_steps: Length of the logging window, in training batches; the Trainer's
            ``log_every_n_steps`` when None.
        low_load: A routed head used by fewer than this share of tokens counts as starved (default 1%).
        max_groups: Groups (classes, sources) drawn per group heatmap, the first ones by id; ``loads.json`` keeps
            all of them.
        collapse_windows: A routed head starved for this many logging windows in a row counts as collapsed: a
            warning names it, ``head_load/layer_XX/collapsed_heads`` counts the layer's collapsed heads from then
            on, and the summary lists it.
        timestep_buckets: Buckets of diffusion timesteps for the ``per_timestep`` heatmaps (tasks that expose
            ``last_timesteps``); 0 switches them off.
        images_every_n_windows: Log the training heatmap every this many logging windows (1 = every window).
        hparam_metrics: Scalar tags shown as metrics beside the hyper-parameters (TensorBoard HParams).
    """

    def __init__(self, log_every_n_steps: int | None = None, low_load: float = 0.01, max_groups: int = 12,
                 collapse_windows: int = 5, timestep_buckets: int = 4, images_every_n_windows: int = 1,
                 hparam_metrics: list[str] | tuple[str, ...] = DEFAULT_HPARAM_METRICS) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"HeadLoadCallback log_every_n_steps={log_every_n_steps} must be at least 1.")
        if collapse_windows < 1:
            raise ValueError(f"HeadLoadCallback collapse_windows={collapse_windows} must be at least 1.")
        if images_every_n_windows < 1:
            raise ValueError(f"HeadLoadCallback images_every_n_windows={images_every_n_windows} must be at least 1.")
        if timestep_buckets < 0:
            raise ValueError(f"HeadLoadCallback timestep_buckets={timestep_buckets} must be >= 0.")
        self.log_every_n_steps = log_every_n_steps
        self.low_load = low_load
        self.max_groups = max_groups
        self.collapse_windows = collapse_windows
        self.timestep_buckets = timestep_buckets
        self.images_every_n_windows = images_every_n_windows
        self.hparam_metrics = tuple(hparam_metrics)
        self._attention: list[MoHAttention] = []
        self._starved_windows: dict[int, torch.Tensor] = {}  # layer -> (routed heads,) consecutive starved windows
        self._collapse_seen: set[int] = set()
        self._collapse_events: list[dict] = []
        self._history: list[tuple[int, dict[int, list[float]]]] = []  # (step, layer -> routed loads)
        self._windows = 0
        self._last_train: HeadLoadSnapshot | None = None
        self._last_val: HeadLoadSnapshot | None = None
        self._hparams: dict[str, Any] = {}
        self._reset_window()
        self._reset_validation()

    # ------------------------------------------------------------------------------------------------- bookkeeping
    def _reset_window(self) -> None:
        self._selected: dict[int, torch.Tensor] = {}  # layer -> (h,) tokens that used each head
        self._gate_sum: dict[int, torch.Tensor] = {}  # layer -> (h,) sum of gates
        self._tokens: dict[int, torch.Tensor] = {}    # layer -> () real tokens seen
        self._batches = 0

    def _reset_validation(self) -> None:
        self._val_selected: dict[int, torch.Tensor] = {}
        self._val_gate_sum: dict[int, torch.Tensor] = {}
        self._val_tokens: dict[int, torch.Tensor] = {}
        self._group_counts: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer) -> (groups, routed heads)
        self._group_tokens: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer) -> (groups,)
        self._group_kind: str = "group"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._window = self.log_every_n_steps or trainer.log_every_n_steps

    def _find_layers(self, pl_module: LightningModule) -> None:
        # Not in setup: a task may build its model later, in configure_model (the language model does).
        self._attention = [m for m in pl_module.modules() if isinstance(m, MoHAttention)]

    def _routed_layers(self) -> list[tuple[int, MoHAttention]]:
        """(index, layer) of the layers with a router; the index is the layer's position among all attention layers."""
        return [(i, layer) for i, layer in enumerate(self._attention) if layer.is_moh]

    @staticmethod
    def _layer_counts(gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gates = gates.float()                    # (B, N, h)
        selected = gates > 0
        # A real token has a non-zero gate on every shared head and on its top-k, so padding shows as all zero.
        real = selected.any(-1)
        return selected.sum((0, 1)).float(), gates.sum((0, 1)), real.sum().float()

    @staticmethod
    def _accumulate(store: dict[int, torch.Tensor], index: int, value: torch.Tensor) -> None:
        store[index] = value if index not in store else store[index] + value

    def _layer_load(self, index: int, layer: MoHAttention, load: torch.Tensor | None,
                    mean_gate: torch.Tensor | None) -> LayerLoad:
        if not layer.is_moh:
            return LayerLoad(index=index, num_heads=layer.num_heads, shared=layer.num_heads, top_k=0,
                             load=[1.0] * layer.num_heads, dense=True)
        router = layer.router
        return LayerLoad(index=index, num_heads=layer.num_heads, shared=router.num_shared_heads,
                         top_k=router.top_k if router.num_routed_heads else 0,
                         load=[round(v, 6) for v in load.tolist()],
                         mean_gate=None if mean_gate is None else [round(v, 6) for v in mean_gate.tolist()])

    # ----------------------------------------------------------------------------------------------------- fit start
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._find_layers(pl_module)
        self._hparams = run_hparams(pl_module, self._attention)
        if trainer.is_global_zero:
            # Before Lightning logs its own hyper-parameters (right after on_fit_start): TensorBoard keeps the first
            # HParams record of a run, so this one, with these names and real metrics, is the one it shows.
            self._log_hparams(trainer)
            self._log_layout(trainer)

    def _log_hparams(self, trainer: Trainer) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                from torch.utils.tensorboard.summary import hparams

                # The metric values are the scalars of those tags in this run: the final ones are shown.
                experiment, start, end = hparams(self._hparams, {name: 0.0 for name in self.hparam_metrics})
                writer = logger.experiment._get_file_writer()
                for summary in (experiment, start, end):
                    writer.add_summary(summary, trainer.global_step)
                writer.flush()
            elif isinstance(logger, WandbLogger):
                logger.experiment.config.update(self._hparams, allow_val_change=True)
            elif isinstance(logger, MLFlowLogger):
                from mlflow.entities import Param

                params = [Param(key, str(value)) for key, value in self._hparams.items()]
                try:
                    logger.experiment.log_batch(logger.run_id, params=params)
                except Exception as error:  # a resumed MLflow run that logged other values refuses to overwrite
                    log.warning("MLflow kept the run's earlier head-budget params: %s", error)

    def _log_layout(self, trainer: Trainer) -> None:
        routed = [index for index, layer in self._routed_layers() if layer.router.num_routed_heads]
        if not routed:
            return
        per_layer = {f"layer {i:02d}: routed-head load (share of tokens)":
                     ["Multiline", [rf"^head_load_per_head/{_layer(i)}/head_\d+$"]] for i in routed}
        balance = {
            "busiest routed head ÷ balanced load (1 = even)":
                ["Multiline", [r"^head_load_balance/layer_\d+/busiest_head_vs_balanced$"]],
            "idlest routed head ÷ balanced load (1 = even, 0 = unused)":
                ["Multiline", [r"^head_load_balance/layer_\d+/idlest_head_vs_balanced$"]],
        }
        layout = {"head load per layer (one line per routed head)": per_layer, "head load balance": balance}
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(layout)

    # --------------------------------------------------------------------------------------------- training windows
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        routed = self._routed_layers()
        if not routed or any(layer.last_gates is None for _, layer in routed):
            return
        for index, layer in routed:
            selected, gate_sum, tokens = self._layer_counts(layer.last_gates)
            self._accumulate(self._selected, index, selected)
            self._accumulate(self._gate_sum, index, gate_sum)
            self._accumulate(self._tokens, index, tokens)
        self._batches += 1
        if self._batches >= self._window:
            self._log_window(trainer)

    def _reduced_loads(self, trainer: Trainer, selected: dict, gate_sum: dict, tokens: dict
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        reduce = trainer.strategy.reduce
        out = {}
        for index in sorted(selected):
            count = reduce(tokens[index].clone(), reduce_op="sum").clamp_min(1)
            out[index] = (reduce(selected[index].clone(), reduce_op="sum") / count,
                          reduce(gate_sum[index].clone(), reduce_op="sum") / count)
        return out

    def _snapshot(self, trainer: Trainer, loads: dict[int, tuple[torch.Tensor, torch.Tensor]], split: str,
                  groups: list[GroupLoad] | None = None) -> HeadLoadSnapshot:
        layers = []
        for index, layer in enumerate(self._attention):
            load, gate = loads.get(index, (None, None))
            if layer.is_moh and load is None:
                continue
            layers.append(self._layer_load(index, layer, load, gate))
        return HeadLoadSnapshot(step=trainer.global_step, epoch=trainer.current_epoch, split=split, layers=layers,
                                groups=groups or [], run=_run_name(trainer))

    def _log_window(self, trainer: Trainer) -> None:
        loads = self._reduced_loads(trainer, self._selected, self._gate_sum, self._tokens)
        self._reset_window()
        step = trainer.global_step
        snapshot = self._snapshot(trainer, loads, "train")
        metrics: dict[str, float] = {}
        history: dict[int, list[float]] = {}
        for layer in snapshot.routed_layers:
            name = _layer(layer.index)
            routed = layer.routed_load
            history[layer.index] = routed.tolist()
            for offset, value in enumerate(routed):
                metrics[f"head_load_per_head/{name}/head_{layer.shared + offset:02d}"] = float(value)
            metrics[f"head_load_balance/{name}/busiest_head_vs_balanced"] = float(routed.max() / layer.balanced)
            metrics[f"head_load_balance/{name}/idlest_head_vs_balanced"] = float(routed.min() / layer.balanced)
            collapsed = self._track_collapse(trainer, layer.index, torch.as_tensor(routed), layer.shared)
            if collapsed:
                self._collapse_seen.add(layer.index)
            if layer.index in self._collapse_seen:
                metrics[f"head_load/{name}/collapsed_heads"] = float(collapsed)
        self._last_train = snapshot
        self._history.append((step, history))
        self._windows += 1
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if snapshot.routed_layers and (self._windows - 1) % self.images_every_n_windows == 0:
            self._log_image(trainer, "head_load/heatmap_train", layer_card(snapshot), step)

    @property
    def collapsed_heads(self) -> list[tuple[int, int]]:
        """(layer, head) of every routed head that has collapsed so far, in the order they did."""
        return list(dict.fromkeys((event["layer"], event["head"]) for event in self._collapse_events))

    def _track_collapse(self, trainer: Trainer, index: int, routed_load: torch.Tensor, shared: int) -> int:
        """Counts consecutive starved windows per routed head; warns once when a head reaches ``collapse_windows``."""
        previous = self._starved_windows.get(index, torch.zeros_like(routed_load, dtype=torch.long))
        starved = torch.where(routed_load < self.low_load, previous + 1, 0)
        self._starved_windows[index] = starved
        newly = (starved == self.collapse_windows).nonzero().flatten().tolist()
        for head in newly:
            self._collapse_events.append({"layer": index, "head": shared + head, "step": trainer.global_step,
                                          "windows": self.collapse_windows,
                                          "load": float(routed_load[head])})
        if newly and trainer.is_global_zero:
            heads = ", ".join(f"{shared + h} ({routed_load[h].item():.2%})" for h in newly)
            log.warning("Routing collapse in MoH layer %d at step %d: routed head(s) %s served under %.0f%% of tokens "
                        "for %d logging windows in a row. Raise model.init_args.load_balance_beta or lower the "
                        "learning rate.", index, trainer.global_step, heads, 100 * self.low_load,
                        self.collapse_windows)
        return int((starved >= self.collapse_windows).sum().item())

    # ---------------------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._find_layers(pl_module)
        self._reset_validation()
        self._group_kind = getattr(pl_module, "head_load_group_name", "group")

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        routed = self._routed_layers()
        if not routed or any(layer.last_gates is None for _, layer in routed):
            return
        groups = pl_module.head_load_groups(batch) if isinstance(pl_module, MoHTask) else None
        timesteps = getattr(pl_module, "last_timesteps", None) if self.timestep_buckets else None
        for index, layer in routed:
            gates = layer.last_gates
            selected, gate_sum, tokens = self._layer_counts(gates)
            self._accumulate(self._val_selected, index, selected)
            self._accumulate(self._val_gate_sum, index, gate_sum)
            self._accumulate(self._val_tokens, index, tokens)
            shared = layer.router.num_shared_heads
            if not layer.router.num_routed_heads:
                continue
            used = gates > 0
            per_sample = used[..., shared:].float().sum(1)           # (B, routed) tokens using each routed head
            sample_tokens = used.any(-1).float().sum(1)              # (B,) real tokens
            if groups is not None and len(groups) == len(gates):
                self._add_groups(self._group_kind, index, groups.to(gates.device).long(), per_sample, sample_tokens)
            if timesteps is not None and len(timesteps) == len(gates):
                total = _num_timesteps(pl_module)
                bucket = timesteps.to(gates.device).long() * self.timestep_buckets // total
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

    def _gather_groups(self, trainer: Trainer, key: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums one group table over ranks; ranks may have seen different numbers of groups."""
        counts, tokens = self._group_counts[key], self._group_tokens[key]
        size = trainer.strategy.reduce(torch.tensor(len(tokens), device=tokens.device, dtype=torch.float),
                                       reduce_op="max")
        grow = int(size.item()) - len(tokens)
        counts = torch.cat([counts, counts.new_zeros(grow, counts.shape[1])])
        tokens = torch.cat([tokens, tokens.new_zeros(grow)])
        return trainer.strategy.reduce(counts, reduce_op="sum"), trainer.strategy.reduce(tokens, reduce_op="sum")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._val_selected:
            return
        loads = self._reduced_loads(trainer, self._val_selected, self._val_gate_sum, self._val_tokens)
        groups = []
        for key in sorted(self._group_counts):
            counts, tokens = self._gather_groups(trainer, key)
            kind, index = key
            load = counts / tokens[:, None].clamp_min(1)
            groups.append(GroupLoad(layer=index, kind=kind, labels=_group_labels(trainer, pl_module, kind, len(load)),
                                    load=[[round(v, 6) for v in row] for row in load.tolist()],
                                    tokens=tokens.tolist()))
        snapshot = self._snapshot(trainer, loads, "validation", groups)
        self._last_val = snapshot
        # trainer.log_dir broadcasts from rank 0 under DDP / FSDP: every rank must ask, or rank 0 waits forever.
        folder = _head_load_folder(trainer)
        if not trainer.is_global_zero or folder is None:
            return
        loads_file = snapshot.save(folder)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):  # what `moh head-figures --run <loads.json>` draws from
                logger.experiment.log_artifact(logger.run_id, str(loads_file), "head_load")
        step = trainer.global_step
        self._log_image(trainer, "head_load/heatmap_val", layer_card(snapshot), step, folder / "layers.png")
        for layer, group in group_views(snapshot):
            name = f"{group.kind}_layer_{group.layer:02d}"
            self._log_image(trainer, f"head_load/per_{group.kind}_layer_{group.layer:02d}",
                            group_card(layer, group, self.max_groups), step, folder / f"{name}.png")

    # ------------------------------------------------------------------------------------------------------- the end
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        snapshot = self._last_val or self._last_train
        folder = _head_load_folder(trainer)
        if not trainer.is_global_zero or folder is None:
            return
        final: dict[str, float] = {}
        if snapshot is not None:
            entropy = mean_load_entropy(snapshot.layers)
            if entropy is not None:
                final["head_load_balance/final_load_entropy"] = entropy
        if final:
            for logger in trainer.loggers:
                logger.log_metrics(final, step=trainer.global_step)
        metrics = {name: _scalar(trainer.callback_metrics.get(name)) for name in self.hparam_metrics}
        metrics = {name: value for name, value in {**metrics, **final}.items() if value is not None}
        if snapshot is None:
            why = ("no logging window completed" if self._routed_layers()
                   else "a dense model: no layer has routed heads")
            text = f"# Head load at the end of {_run_name(trainer) or 'the run'}\n\nNo routed head measured ({why}).\n"
        else:
            text = summary_markdown(snapshot, self._collapse_events, self._hparams, metrics, self.low_load)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SUMMARY_FILE).write_text(text)
        over_time = self._loads_over_time()
        if over_time is not None:
            _save_png(figure_rgb(over_time), folder / "loads_over_time.png")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("head_load/summary", text, trainer.global_step)
                logger.experiment.flush()
            elif isinstance(logger, WandbLogger):
                self._wandb_end(logger, text, snapshot, trainer.global_step)
            elif isinstance(logger, MLFlowLogger):
                logger.experiment.log_text(logger.run_id, text, "head_load/summary.md")
                if over_time is not None:
                    logger.experiment.log_figure(logger.run_id, over_time, "head_load/loads_over_time.png")

    def _wandb_end(self, logger: WandbLogger, text: str, snapshot: HeadLoadSnapshot | None, step: int) -> None:
        import markdown
        import wandb

        logger.experiment.log({"head_load/summary": wandb.Html(markdown.markdown(text, extensions=["tables"])),
                               "trainer/global_step": step})
        if snapshot is not None:
            columns = ["layer", "head", "shared", "load", "balanced load"]
            rows = [[layer.index, head, head < layer.shared, value, layer.balanced]
                    for layer in snapshot.layers for head, value in enumerate(layer.load)]
            logger.log_table("head_load/loads", columns=columns, data=rows, step=step)
        steps = [step for step, _ in self._history]
        for layer in snapshot.routed_layers if snapshot is not None else []:
            lines = [loads[layer.index] for _, loads in self._history if layer.index in loads]
            if not lines or len(lines) != len(steps):
                continue
            heads = np.asarray(lines).T
            chart = wandb.plot.line_series(xs=steps, ys=heads.tolist(),
                                           keys=[f"head {layer.shared + h}" for h in range(len(heads))],
                                           title=f"layer {layer.index:02d}: routed-head load (share of tokens)",
                                           xname="step")
            logger.experiment.log({f"head_load_per_head/{_layer(layer.index)}": chart, "trainer/global_step": step})

    def _loads_over_time(self) -> Figure | None:
        """One panel per routed layer, one line per routed head: the custom-scalars view as a figure."""
        layers = sorted({index for _, loads in self._history for index in loads})
        if not layers:
            return None
        cols = min(len(layers), 3)
        rows = -(-len(layers) // cols)
        figure = Figure(figsize=(5.2 * cols, 3.4 * rows), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.subplots(rows, cols, squeeze=False)
        budget = {layer.index: layer for layer in (self._last_train or self._last_val).layers}
        for axis, index in zip(axes.flat, layers):
            points = [(step, loads[index]) for step, loads in self._history if index in loads]
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
        for axis in list(axes.flat)[len(layers):]:
            axis.axis("off")
        figure.suptitle("Routed-head load over training (one line per head)", fontsize=13)
        figure.tight_layout()
        return figure

    # ------------------------------------------------------------------------------------------------------- output
    def _log_image(self, trainer: Trainer, tag: str, rgb: np.ndarray, step: int, path: Path | None = None) -> None:
        if path is not None:
            _save_png(rgb, path)
        for logger in trainer.loggers:
            _log_image(logger, tag, rgb, step)


def _log_image(logger: Logger, tag: str, rgb: np.ndarray, step: int) -> None:
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_image(tag, rgb, step, dataformats="HWC")
    elif isinstance(logger, WandbLogger):
        logger.log_image(key=tag, images=[rgb], step=step)
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_image(logger.run_id, rgb, key=tag.replace("/", "."), step=step)


def _save_png(rgb: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.png")
    Image.fromarray(rgb).save(partial)
    partial.replace(path)


def _scalar(value) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _run_name(trainer: Trainer) -> str:
    logger = trainer.logger
    if logger is None:
        return ""
    name, version = logger.name or "", logger.version
    return f"{name}/version_{version}" if isinstance(version, int) else f"{name}/{version}" if version else name


def _head_load_folder(trainer: Trainer) -> Path | None:
    """``head_load/`` in the run's own folder: the version folder of TensorBoard / CSV, the W&B run's files (which
    W&B uploads with the run), or a folder per MLflow run beside MLflow's store; None for a run without a run folder
    (no logger, or ``fast_dev_run``), which writes nothing. Call it on every rank."""
    # trainer.log_dir broadcasts from rank 0 under DDP / FSDP: every rank must ask, or rank 0 waits forever.
    log_dir = trainer.log_dir
    if log_dir is None or all(isinstance(logger, DummyLogger) for logger in trainer.loggers):
        return None  # without a logger Lightning's log_dir is the working folder, which is not the run's
    root = Path(log_dir)
    logger = trainer.logger
    if trainer.is_global_zero and isinstance(logger, WandbLogger):
        return Path(logger.experiment.dir) / "head_load"
    if trainer.is_global_zero and isinstance(logger, MLFlowLogger):
        return root / "head_load" / str(logger.run_id)
    return root / "head_load"


def _num_timesteps(pl_module: LightningModule) -> int:
    criterion = getattr(pl_module, "criterion", None)
    total = getattr(criterion, "num_timesteps", None) or getattr(pl_module, "hparams", {}).get("num_train_timesteps")
    return int(total or 1000)


def _group_labels(trainer: Trainer, pl_module: LightningModule, kind: str, count: int) -> list[str]:
    """Readable names of the groups: timestep ranges, text sources by file name, image classes by folder name."""
    if kind == "timestep":
        total = _num_timesteps(pl_module)
        edges = [round(i * total / count) for i in range(count + 1)]
        return [f"t {edges[i]}–{edges[i + 1] - 1}" for i in range(count)]
    datamodule = getattr(trainer, "datamodule", None)
    names: list[str] | None = None
    sources = getattr(datamodule, "sources", None)
    if kind == "source" and sources:
        names = [Path(str(getattr(source, "label", source))).name or str(source) for source in sources]
    for attribute in ("val_set", "val_dataset"):
        classes = getattr(getattr(datamodule, attribute, None), "classes", None)
        if kind == "class" and classes:
            names = [str(name) for name in classes]
    if names and len(names) >= count:
        return [f"{i}: {names[i]}" if names[i] != str(i) else str(i) for i in range(count)]
    return [str(i) for i in range(count)]
