"""What each logger shows of the head load: one small adapter per logger kind.

Apart from the callback so that a logger is one class here rather than a branch in every hook: the callback says
what happened (the run starts, an image, a window's histograms, a saved ``loads.json``, the run ends) and each
adapter shows it in its logger's own way. Scalars need no adapter: every Lightning logger takes ``log_metrics``.
TensorBoard gets images, histograms, the custom-scalars layout, text and HParams; Weights & Biases images, line-series
charts, a table, HTML text and config; MLflow step images, figures, text, artifacts and params; any other logger
(CSV) scalars only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from matplotlib.figure import Figure

from moh_lightning.callbacks.head_load.counting import layer_name
from moh_lightning.callbacks.head_load.loads import HeadLoadSnapshot

History = list[tuple[int, dict[int, list[float]]]]  # (step, layer -> routed loads) per logging window


class LoggerAdapter:
    """A logger the dashboards draw nothing for (CSV, or a kind they do not know): the run folder and scalars only."""

    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def folder(self, run_folder: Path) -> Path:
        """Where the run's ``head_load/`` files go, when this is the run's first logger."""
        return run_folder / "head_load"

    def start(self, hparams: dict[str, Any], hparam_metrics: tuple[str, ...], routed: list[int], step: int) -> None:
        """The run's head budget (``hparams``, shown beside ``hparam_metrics``) and its ``routed`` layer numbers."""

    def image(self, tag: str, rgb: np.ndarray, step: int) -> None:
        """A heatmap card, (H, W, 3) uint8."""

    def loads_saved(self, path: Path) -> None:
        """The latest ``loads.json`` was written to ``path``."""

    def histograms(self, snapshot: HeadLoadSnapshot) -> None:
        """A training window's routed loads, one histogram per routed layer."""

    def end(self, text: str, snapshot: HeadLoadSnapshot | None, history: History, over_time: Figure | None,
            step: int) -> None:
        """The end-of-run summary (markdown ``text``), the last snapshot and the loads of every window."""


class TensorBoardAdapter(LoggerAdapter):
    logger: TensorBoardLogger

    def start(self, hparams: dict[str, Any], hparam_metrics: tuple[str, ...], routed: list[int], step: int) -> None:
        from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # TensorBoard keeps the first HParams record of a run, so this one, written before Lightning's own, is the
        # one it shows; its metric values are the scalars of those tags in the run, the final ones.
        experiment, start, end = hparams_summary(hparams, {name: 0.0 for name in hparam_metrics})
        # The HParams table's trial column is 10em wide (~16 characters), which a run's path `<config>_75/version_0`
        # overflows before it says anything that tells two runs apart; the trial is named by its budget and version
        # first (`75% v0 <name>`, `dense v1 <name>`). Unique per run, so no two runs are merged into one group.
        plugin_data = start.value[0].metadata.plugin_data
        info = HParamsPluginData.FromString(plugin_data.content)
        info.session_start_info.group_name = trial_name(hparams, self.logger.name, self.logger.version)
        plugin_data.content = info.SerializeToString()
        writer = self.logger.experiment._get_file_writer()
        for summary in (experiment, start, end):
            writer.add_summary(summary, step)
        writer.flush()
        if not routed:
            return
        per_layer = {f"layer {i:02d}: routed-head load (share of tokens)":
                     ["Multiline", [rf"^head_load_per_head/{layer_name(i)}/head_\d+$"]] for i in routed}
        balance = {
            "busiest routed head ÷ balanced load (1 = even)":
                ["Multiline", [r"^head_load_balance/layer_\d+/busiest_head_vs_balanced$"]],
            "idlest routed head ÷ balanced load (1 = even, 0 = unused)":
                ["Multiline", [r"^head_load_balance/layer_\d+/idlest_head_vs_balanced$"]],
        }
        self.logger.experiment.add_custom_scalars(
            {"head load per layer (one line per routed head)": per_layer, "head load balance": balance})

    def image(self, tag: str, rgb: np.ndarray, step: int) -> None:
        self.logger.experiment.add_image(tag, rgb, step, dataformats="HWC")

    def histograms(self, snapshot: HeadLoadSnapshot) -> None:
        # Load ÷ even load, so that 1 is even in every layer and a Distributions band narrowing onto 1 is balance
        # reached; fixed bins over the possible range (0 to every token), finer than TensorBoard's default buckets.
        for layer in snapshot.routed_layers:
            ratio = layer.routed_load / layer.balanced
            self.logger.experiment.add_histogram(f"head_load_vs_even/{layer_name(layer.index)}", ratio,
                                                 snapshot.step, bins=np.linspace(0.0, 1.0 / layer.balanced, 41))

    def end(self, text: str, snapshot: HeadLoadSnapshot | None, history: History, over_time: Figure | None,
            step: int) -> None:
        self.logger.experiment.add_text("head_load/summary", text, step)
        self.logger.experiment.flush()


def trial_name(hparams: dict[str, Any], name: str, version: int | str) -> str:
    """A run's name in TensorBoard's HParams table: its head budget, version and name, in the order that fits."""
    budget = "dense" if hparams.get("moh/router") == "dense" else f"{100 * hparams['moh/activated_fraction']:.0f}%"
    version = f"v{version}" if isinstance(version, int) else str(version)
    return f"{budget} {version} {name}"


class WandbAdapter(LoggerAdapter):
    logger: WandbLogger

    def folder(self, run_folder: Path) -> Path:
        return Path(self.logger.experiment.dir) / "head_load"  # the run's files, which W&B uploads with it

    def start(self, hparams: dict[str, Any], hparam_metrics: tuple[str, ...], routed: list[int], step: int) -> None:
        self.logger.experiment.config.update(hparams, allow_val_change=True)

    def image(self, tag: str, rgb: np.ndarray, step: int) -> None:
        self.logger.log_image(key=tag, images=[rgb], step=step)

    def end(self, text: str, snapshot: HeadLoadSnapshot | None, history: History, over_time: Figure | None,
            step: int) -> None:
        import markdown
        import wandb

        self.logger.experiment.log({"head_load/summary": wandb.Html(markdown.markdown(text, extensions=["tables"])),
                                    "trainer/global_step": step})
        if snapshot is None:
            return
        columns = ["layer", "head", "shared", "load", "balanced load"]
        rows = [[layer.index, head, head < layer.shared, value, layer.balanced]
                for layer in snapshot.layers for head, value in enumerate(layer.load)]
        self.logger.log_table("head_load/loads", columns=columns, data=rows, step=step)
        steps = [window_step for window_step, _ in history]
        for layer in snapshot.routed_layers:
            lines = [loads[layer.index] for _, loads in history if layer.index in loads]
            if not lines or len(lines) != len(steps):
                continue
            heads = np.asarray(lines).T
            chart = wandb.plot.line_series(xs=steps, ys=heads.tolist(),
                                           keys=[f"head {layer.shared + h}" for h in range(len(heads))],
                                           title=f"layer {layer.index:02d}: routed-head load (share of tokens)",
                                           xname="step")
            self.logger.experiment.log({f"head_load_per_head/{layer_name(layer.index)}": chart,
                                        "trainer/global_step": step})


class MLflowAdapter(LoggerAdapter):
    logger: MLFlowLogger

    def start(self, hparams: dict[str, Any], hparam_metrics: tuple[str, ...], routed: list[int], step: int) -> None:
        from mlflow.entities import Param

        self.logger.experiment.log_batch(self.logger.run_id, params=[Param(key, str(value))
                                                                     for key, value in hparams.items()])

    def image(self, tag: str, rgb: np.ndarray, step: int) -> None:
        self.logger.experiment.log_image(self.logger.run_id, rgb, key=tag.replace("/", "."), step=step)

    def loads_saved(self, path: Path) -> None:
        # What `moh head-figures --run <loads.json>` draws from, kept with the run.
        self.logger.experiment.log_artifact(self.logger.run_id, str(path), "head_load")

    def end(self, text: str, snapshot: HeadLoadSnapshot | None, history: History, over_time: Figure | None,
            step: int) -> None:
        self.logger.experiment.log_text(self.logger.run_id, text, "head_load/summary.md")
        if over_time is not None:
            self.logger.experiment.log_figure(self.logger.run_id, over_time, "head_load/loads_over_time.png")


_ADAPTERS: list[tuple[type[Logger], type[LoggerAdapter]]] = [
    (TensorBoardLogger, TensorBoardAdapter), (WandbLogger, WandbAdapter), (MLFlowLogger, MLflowAdapter)]


def adapter(logger: Logger) -> LoggerAdapter:
    """The adapter for ``logger``'s kind; the plain one (scalars only) for any other."""
    return next((cls(logger) for kind, cls in _ADAPTERS if isinstance(logger, kind)), LoggerAdapter(logger))


__all__ = ["LoggerAdapter", "MLflowAdapter", "TensorBoardAdapter", "WandbAdapter", "adapter", "trial_name"]
