"""What ``moh predict`` writes: each batch's predictions as they come, into a file beside the checkpoint's run."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import IO

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from moh_lightning.outputs import check_output_folder


class PredictionWriter(BasePredictionWriter):
    """Writes what a task's ``predict_step`` returns, batch by batch, and says where when the predictions end.

    A classifier's top-k classes become a CSV: the image file, then for k = 1, 2, ... the class (the data module's
    ``class_names``, or the index where it has none) and its probability. A language model's completions become JSON
    lines, ``{"prompt": ..., "completion": ...}``. The file is named after what was predicted (``<image folder>.csv``,
    ``<prompts file>.jsonl``) and lies in ``output``; by default in ``predictions/`` of the run the checkpoint
    (``--ckpt_path``) comes from (``runs/<name>/version_N/`` for ``runs/<name>/version_N/checkpoints/last.ckpt``, else
    the checkpoint's folder), or of the trainer's log folder when no checkpoint is given. Under several processes each
    writes its own part, ``<name>.rank<r>.csv``. Nothing is written over: an ``output`` folder that holds anything
    already is refused before the checkpoint loads (unless ``overwrite``), and a run's ``predictions/`` that holds
    earlier predictions of the same name gets ``<name>-2.csv``, ``-3``, ... beside them.

    Args:
        output: The folder to write into, instead of the run's ``predictions/``.
        overwrite: Write into an ``output`` folder that holds files already, replacing those of the same names.
    """

    def __init__(self, output: str | None = None, overwrite: bool = False) -> None:
        super().__init__("batch")
        self.output, self.overwrite = output, overwrite
        self._folder: Path | None = None
        self._name = ""
        self._path: Path | None = None
        self._file: IO | None = None
        self._rows = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning restores the checkpoint after the callbacks' setup: a refusal here costs no loading.
        if stage == "predict" and self.output is not None:
            check_output_folder(self.output, "--predictions.output", self.overwrite, "--predictions.overwrite")

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._folder, self._path, self._rows = predictions_folder(self.output, trainer), None, 0
        dataset = trainer.predict_dataloaders.dataset
        name = dataset.source.resolve().name if dataset.source.is_dir() else dataset.source.stem
        # Chosen by rank 0 before any rank writes, so that every rank's part carries the same name.
        self._name = name if self.output is not None else trainer.strategy.broadcast(unused_name(self._folder, name))

    def write_on_batch_end(self, trainer: Trainer, pl_module: LightningModule, prediction: dict, batch_indices,
                           batch, batch_idx: int, dataloader_idx: int) -> None:
        dataset = trainer.predict_dataloaders.dataset  # the predict set's `items` name what each index is
        items = [dataset.items[i] for i in prediction["index"].tolist()]
        if "classes" in prediction:
            classes, probs = prediction["classes"].tolist(), prediction["probs"].tolist()
            if self._file is None:
                top_k = len(classes[0])
                self._open(trainer, "csv", ["file", *[f"{column}_{k}" for k in range(1, top_k + 1)
                                                      for column in ("class", "probability")]])
            names = getattr(trainer.datamodule, "class_names", None) or []
            writer = csv.writer(self._file)
            for item, row_classes, row_probs in zip(items, classes, probs, strict=True):
                writer.writerow([item, *[cell for c, p in zip(row_classes, row_probs, strict=True)
                                         for cell in (names[c] if c < len(names) else c, round(p, 6))]])
        else:
            if self._file is None:
                self._open(trainer, "jsonl")
            for prompt, completion in zip(items, prediction["completions"], strict=True):
                self._file.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
        self._rows += len(items)

    def _open(self, trainer: Trainer, suffix: str, header: list[str] | None = None) -> None:
        """Opens ``<name>[.rank<r>].<suffix>`` in the folder for writing, with a CSV ``header``."""
        part = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        self._folder.mkdir(parents=True, exist_ok=True)
        self._path = self._folder / f"{self._name}{part}.{suffix}"
        self._file = self._path.open("w", newline="" if suffix == "csv" else None, encoding="utf-8")
        if header:
            csv.writer(self._file).writerow(header)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # After the progress bar's last frame (see RunSummary), so the line stays below it.
        if stage == "predict" and self._path is not None:
            if trainer.progress_bar_callback is not None:
                trainer.progress_bar_callback.teardown(trainer, pl_module, stage)
            kind = "images classified" if self._path.suffix == ".csv" else "prompts continued"
            print(f"moh predict: {self._rows} {kind}: {self._path}")
            self._path = None


def unused_name(folder: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``, ... : the first that no file in ``folder`` is named after (``<name>.csv``,
    ``<name>.rank0.jsonl``)."""
    held = [entry.name for entry in folder.iterdir()] if folder.is_dir() else []
    candidate, repeat = name, 1
    while any(entry.startswith(f"{candidate}.") for entry in held):
        repeat += 1
        candidate = f"{name}-{repeat}"
    return candidate


def predictions_folder(output: str | None, trainer: Trainer) -> Path:
    """Where predictions go (see ``PredictionWriter``): ``output``, else ``predictions/`` of the checkpoint's run."""
    if output is not None:
        return Path(output).expanduser()
    if trainer.ckpt_path is None:
        return Path(trainer.log_dir or ".") / "predictions"
    checkpoint = Path(trainer.ckpt_path).expanduser()
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    return run / "predictions"


__all__ = ["PredictionWriter", "predictions_folder", "unused_name"]
