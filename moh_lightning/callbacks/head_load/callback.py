"""``HeadLoadCallback``: the Lightning hooks of the head-load dashboards, and nothing else.

Apart from the counting, the drawing and the loggers so that this file only says *when*: count after each batch,
close a window every ``log_every_n_steps`` batches and each validation, write the run folder and hand every logger's
adapter what happened. What is logged is listed in the package's docstring.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from moh_lightning import lightning_compat as compat
from moh_lightning.callbacks.head_load.counting import HeadLoadCounter, layer_name
from moh_lightning.callbacks.head_load.loads import SUMMARY_FILE, mean_load_entropy
from moh_lightning.callbacks.head_load.loggers import LoggerAdapter, adapter
from moh_lightning.callbacks.head_load.render import (
    figure_rgb,
    group_card,
    layer_card,
    loads_over_time,
    over_time_card,
    save_png,
)
from moh_lightning.callbacks.head_load.summary import hparam_metrics, run_hparams, summary_markdown
from moh_lightning.callbacks.logger_runs import logged_earlier, record_logged, run_folder
from moh_lightning.tasks.base import MoHTask


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
        images_every_n_windows: Log the training heatmap and each routed layer's load-over-time card every this
            many logging windows, the first window included (1 = every window), and the last window's (the steps
            since the last full window close it) when training ends. Drawing a card takes ~0.1 s of host time
            (matplotlib), which every window of a small model's CPU run would add to its step time: the per-head
            scalars and histograms come every window.
        images_every_n_validations: Draw the validation heatmaps (layers and each routed layer's groups: a card
            each) every this many validations of a fit, the first included, and the last one at the end of
            training; ``loads.json`` is written at every validation. Seven cards took 4x the MNIST default's whole
            validation. ``moh validate`` / ``moh test`` always draw theirs.
        hparam_metrics: Scalar tags shown as metrics beside the hyper-parameters (TensorBoard HParams); None: the
            ones the run logs (its task's, its callbacks', the final load entropy: ``summary.hparam_metrics``).
    """

    def __init__(self, log_every_n_steps: int | None = None, low_load: float = 0.01, max_groups: int = 12,
                 collapse_windows: int = 5, timestep_buckets: int = 4, images_every_n_windows: int = 10,
                 images_every_n_validations: int = 5,
                 hparam_metrics: list[str] | None = None) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"HeadLoadCallback log_every_n_steps={log_every_n_steps} must be at least 1.")
        if collapse_windows < 1:
            raise ValueError(f"HeadLoadCallback collapse_windows={collapse_windows} must be at least 1.")
        if images_every_n_windows < 1:
            raise ValueError(f"HeadLoadCallback images_every_n_windows={images_every_n_windows} must be at least 1.")
        if images_every_n_validations < 1:
            raise ValueError(f"HeadLoadCallback images_every_n_validations={images_every_n_validations} must be at "
                             f"least 1.")
        if timestep_buckets < 0:
            raise ValueError(f"HeadLoadCallback timestep_buckets={timestep_buckets} must be >= 0.")
        self.log_every_n_steps = log_every_n_steps
        self.low_load = low_load
        self.max_groups = max_groups
        self.collapse_windows = collapse_windows
        self.timestep_buckets = timestep_buckets
        self.images_every_n_windows = images_every_n_windows
        self.images_every_n_validations = images_every_n_validations
        self._validations = 0
        self._undrawn: tuple | None = None
        self.hparam_metrics = hparam_metrics
        self._metrics: tuple[str, ...] = ()
        self.counter = HeadLoadCounter(low_load, collapse_windows, timestep_buckets)
        self._windows = 0
        self._drawn_step: int | None = None  # of the last training heatmap drawn
        self._hparams: dict[str, Any] = {}
        self._run = ""

    @property
    def collapsed_heads(self) -> list[tuple[int, int]]:
        """(layer, head) of every routed head that has collapsed so far, in the order they did."""
        return self.counter.collapsed_heads

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._window = self.log_every_n_steps or trainer.log_every_n_steps
        self._run = _run_name(trainer)  # here, where every rank asks (the run folder is broadcast)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.counter.find_layers(pl_module)
        self._hparams = run_hparams(pl_module, self.counter.layers)
        others = [callback for callback in trainer.callbacks if callback is not self]
        self._metrics = tuple(self.hparam_metrics or hparam_metrics(pl_module, others))
        if trainer.is_global_zero:
            # Before Lightning logs its own hyper-parameters (right after on_fit_start): TensorBoard keeps the first
            # HParams record of a run, so this one, with these names and real metrics, is the one it shows.
            routed = [index for index, layer in self.counter.routed_layers() if layer.router.num_routed_heads]
            for logger in trainer.loggers:
                adapter(logger).start(self._hparams, self._metrics, routed, trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.counter.count_train_batch() and self.counter.window_batches >= self._window:
            self._close_window(trainer, draw=self._windows % self.images_every_n_windows == 0)

    def _close_window(self, trainer: Trainer, draw: bool) -> None:
        """Logs the window's scalars and histograms, and with ``draw`` its cards. Every rank calls it (the counts are
        summed over them); rank 0 logs."""
        snapshot, metrics = self.counter.close_window(trainer.strategy.reduce, trainer.global_step,
                                                      trainer.current_epoch, self._run,
                                                      warn=trainer.is_global_zero)
        self._windows += 1
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._log_once(trainer, "head_load_vs_even", snapshot.step, lambda shown: shown.histograms(snapshot))
        if draw:
            self._draw_training(trainer, snapshot)

    def _draw_training(self, trainer: Trainer, snapshot) -> None:
        """The window's heatmap, and each routed layer's load per head over the windows so far."""
        if not snapshot.routed_layers:
            return
        self._drawn_step = snapshot.step
        self._log_image(trainer, "head_load/heatmap_train", layer_card(snapshot), step=snapshot.step)
        for layer in snapshot.routed_layers:
            card = over_time_card(self.counter.history, layer)
            if card is not None:
                self._log_image(trainer, f"head_load/over_time_{layer_name(layer.index)}", card, step=snapshot.step)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.counter.find_layers(pl_module)
        self.counter.start_validation(getattr(pl_module, "head_load_group_name", "group"))

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self.counter.has_gates():
            return
        groups = pl_module.head_load_groups(batch) if isinstance(pl_module, MoHTask) else None
        self.counter.count_validation_batch(groups, getattr(pl_module, "last_timesteps", None),
                                            _num_timesteps(pl_module))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._close_evaluation(trainer, pl_module, "validation", "val")

    # `moh test` measures the head load of its split as `moh validate` does, into its own run folder.
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_validation_epoch_start(trainer, pl_module)

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self.on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_evaluation(trainer, pl_module, "test", "test")

    def _close_evaluation(self, trainer: Trainer, pl_module: LightningModule, split: str, tag: str) -> None:
        """Saves the validation's or test's head load (``split``) in the run folder and logs its heatmaps under
        ``head_load/heatmap_<tag>``."""
        # A fit's validation at its step; `moh validate` / `moh test` at the checkpoint's (callbacks.LoggerRuns).
        step = trainer.global_step if trainer.state.fn == TrainerFn.FITTING else compat.logging_step(trainer)
        snapshot = self.counter.close_validation(
            trainer.strategy.reduce, step, trainer.current_epoch, self._run,
            lambda kind, count: _group_labels(trainer, pl_module, kind, count), split)
        if snapshot is None:
            return
        folder = _head_load_folder(trainer)
        if folder is None:
            return
        loads_file = snapshot.save(folder)
        for logger in trainer.loggers:
            adapter(logger).loads_saved(loads_file)
        self._undrawn = None
        if split == "validation":
            self._validations += 1
            if (self._validations - 1) % self.images_every_n_validations:
                self._undrawn = (snapshot, folder, tag)  # drawn at the end of training if no later one is
                return
        self._draw_evaluation(trainer, snapshot, folder, tag)

    def _draw_evaluation(self, trainer: Trainer, snapshot, folder: Path, tag: str) -> None:
        self._log_image(trainer, f"head_load/heatmap_{tag}", layer_card(snapshot), folder / "layers.png",
                        snapshot.step)
        for layer, group in snapshot.group_views():
            name = f"{group.kind}_layer_{group.layer:02d}"
            self._log_image(trainer, f"head_load/per_{name}", group_card(layer, group, self.max_groups),
                            folder / f"{name}.png", snapshot.step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The steps since the last full window close one more, so the last training heatmap is the last step's.
        if self.counter.window_batches:
            self._close_window(trainer, draw=True)
        elif self.counter.last_train is not None and self._drawn_step != self.counter.last_train.step:
            if trainer.is_global_zero:
                self._draw_training(trainer, self.counter.last_train)
        snapshot = self.counter.last_val or self.counter.last_train
        folder = _head_load_folder(trainer)
        if folder is None:
            return
        if self._undrawn is not None:  # the run folder's heatmaps are always the last validation's
            self._draw_evaluation(trainer, *self._undrawn)
            self._undrawn = None
        final: dict[str, float] = {}
        entropy = mean_load_entropy(snapshot.layers) if snapshot is not None else None
        if entropy is not None:
            final["head_load_balance/final_load_entropy"] = entropy
            for logger in trainer.loggers:
                logger.log_metrics(final, step=trainer.global_step)
        metrics = {name: _scalar(trainer.callback_metrics.get(name)) for name in self._metrics}
        metrics = {name: value for name, value in {**metrics, **final}.items() if value is not None}
        if snapshot is None:
            why = ("no logging window completed" if self.counter.routed_layers()
                   else "a dense model: no layer has routed heads")
            text = f"# Head load at the end of {self._run or 'the run'}\n\nNo routed head measured ({why}).\n"
        else:
            text = summary_markdown(snapshot, self.counter.collapse_events, self._hparams, metrics, self.low_load)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SUMMARY_FILE).write_text(text)
        history = self.counter.history
        budgets = (self.counter.last_train or self.counter.last_val).layers if history else []
        over_time = loads_over_time(history, budgets)
        if over_time is not None:
            save_png(figure_rgb(over_time), folder / "loads_over_time.png")
        for logger in trainer.loggers:
            adapter(logger).end(text, snapshot, history, over_time, trainer.global_step)

    def _log_image(self, trainer: Trainer, tag: str, rgb: np.ndarray, path: Path | None = None,
                   step: int | None = None) -> None:
        if path is not None:
            save_png(rgb, path)
        step = trainer.global_step if step is None else step
        self._log_once(trainer, tag, step, lambda shown: shown.image(tag, rgb, step))

    @staticmethod
    def _log_once(trainer: Trainer, key: str, step: int, show: Callable[[LoggerAdapter], None]) -> None:
        """``show`` on each logger's adapter, unless an earlier part of this run logged ``key`` at ``step`` (a
        resumed run repeats the steps after its checkpoint: no second image or histogram of one step)."""
        for logger in trainer.loggers:
            if not logged_earlier(logger, key, step):
                show(adapter(logger))
                record_logged(logger, key, step)


def _head_load_folder(trainer: Trainer) -> Path | None:
    """``head_load/`` in the run's own folder (the first logger's adapter says where), on rank 0; None on the other
    ranks and for a run without a run folder (no logger, or ``fast_dev_run``), which writes nothing. Call it on every
    rank: the run folder is broadcast from rank 0 under DDP / FSDP, and rank 0 would wait forever."""
    folder = run_folder(trainer)
    if folder is None:
        return None
    return adapter(trainer.logger).folder(folder) if trainer.is_global_zero else None


def _scalar(value) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _run_name(trainer: Trainer) -> str:
    """The run as its folder names it, ``<name>/version_N``, whatever the logger ("" without a run folder)."""
    folder = run_folder(trainer)
    return "" if folder is None else f"{folder.parent.name}/{folder.name}"


def _num_timesteps(pl_module: LightningModule) -> int:
    criterion = getattr(pl_module, "criterion", None)
    total = getattr(criterion, "num_timesteps", None) or getattr(pl_module, "hparams", {}).get("num_train_timesteps")
    return int(total or 1000)


def _group_labels(trainer: Trainer, pl_module: LightningModule, kind: str, count: int) -> list[str]:
    """Readable names of the groups, in id order: timestep ranges, text sources by file name, image classes by the
    names the task was given (its ``class_names``, the data module's class folders), else the data's own."""
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
    given = getattr(pl_module, "hparams", {}).get("class_names")
    if kind == "class" and given:
        names = [str(name) for name in given]
    if names and len(names) >= count:
        return [f"{i}: {names[i]}" if names[i] != str(i) else str(i) for i in range(count)]
    return [str(i) for i in range(count)]


__all__ = ["HeadLoadCallback"]
