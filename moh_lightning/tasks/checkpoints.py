"""Reading and writing task checkpoints for the tools that evaluate, export or convert them.

Every tool reads the checkpoint's task first (``read_checkpoint``): given another kind of checkpoint it stops in one
line naming the kind it got and the tool that fits, instead of failing inside the wrong class's ``__init__``; given a
file that is not a ``moh fit`` checkpoint, or one whose pickle names a type no checkpoint needs, it stops in one line
too, and nothing in the file has run (``serialization.load_file``).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from moh_lightning.data.tokenizers import RUN_TOKENIZER
from moh_lightning.serialization import UnsafeCheckpointError, load_file
from moh_lightning.tasks.language_model import LanguageModel

# The task class (its name) -> the tools that take its checkpoints.
TOOLS_FOR = {
    "LanguageModel": "moh generate, moh lm-eval or moh export-hf",
    "ClassConditionalDiffusion": "moh sample (then moh fidelity or moh digit_quality on its samples)",
    "ImageClassifier": "moh export-timm, or moh digit_quality --classifier",
    "TransNeXtClassifier": "moh export-timm",
}
# Checkpoints without the task's class path (written outside LightningCLI): the kind from the arch config's type.
_ARCH_TASK = {"LlamaConfig": "LanguageModel", "DiTConfig": "ClassConditionalDiffusion", "ViTConfig": "ImageClassifier",
              "TransNeXtConfig": "TransNeXtClassifier"}


def checkpoint_task(raw: dict) -> str:
    """The class name of the task a loaded checkpoint was written by; ``unknown`` when it does not say."""
    hparams = raw.get("hyper_parameters") or {}
    class_path = hparams.get("_class_path")
    if class_path:
        return str(class_path).rpartition(".")[2]
    arch = hparams.get("arch")
    if arch is not None and type(arch).__name__ in _ARCH_TASK:
        return _ARCH_TASK[type(arch).__name__]
    keys = raw.get("state_dict") or {}
    if any(k.startswith("model.y_embedder") for k in keys):
        return "ClassConditionalDiffusion"
    if any(k.startswith("model.stages.") for k in keys):
        return "TransNeXtClassifier"
    if any(k.startswith("model.patch_embed.") for k in keys):
        return "ImageClassifier"
    if any(k.startswith("model.embed.") for k in keys):
        return "LanguageModel"
    return "unknown"


def read_checkpoint(checkpoint: str | Path, expected: type | tuple[type, ...], tool: str,
                    map_location: str = "cpu", mmap: bool = False) -> dict:
    """The loaded checkpoint, after checking it was written by one of the ``expected`` task classes.

    The kind is the task's class path that LightningCLI saves with the hyper-parameters, else the type of the
    ``arch`` config, else told from the weights' names. A missing file, a file that is not a ``moh fit``
    checkpoint, one that would run code, or another task's checkpoint stops the tool with one line
    (``SystemExit``); for another task's it names the kind it got and the tool that fits it. ``mmap`` maps the
    tensors instead of reading them, for a tool that only checks the kind before something else loads the file.
    """
    path = Path(checkpoint)
    if not path.is_file():
        raise SystemExit(f"moh {tool}: checkpoint {checkpoint}: no such file; give a .ckpt written by `moh fit`.")
    expected = expected if isinstance(expected, tuple) else (expected,)
    names = {cls.__name__ for cls in expected}
    wanted = " or ".join(sorted(names))
    try:
        raw = load_file(path, map_location=map_location, mmap=mmap)
    except UnsafeCheckpointError as error:
        raise SystemExit(f"moh {tool}: {error}") from None
    except Exception as error:  # not a torch file at all, or a damaged one
        raise SystemExit(f"moh {tool}: {checkpoint} does not load as a checkpoint ({type(error).__name__}); give a "
                         f".ckpt written by `moh fit` with a {wanted}.") from None
    suite = isinstance(raw, dict) and all(isinstance(raw.get(key), dict) for key in ("state_dict", "hyper_parameters"))
    kind = checkpoint_task(raw) if suite else "unknown"
    if kind == "unknown":
        raise SystemExit(f"moh {tool}: {checkpoint} is not a checkpoint of this suite (no `moh fit` task or "
                         f"weights in it); give a .ckpt written by `moh fit` with a {wanted}.")
    if kind not in names:
        fits = TOOLS_FOR.get(kind)
        advice = f"use {fits} for it" if fits else "give a checkpoint written by `moh fit` with that task"
        raise SystemExit(f"moh {tool}: {checkpoint} is a {kind} checkpoint, and {tool} takes {wanted} ones; "
                         f"{advice}.")
    return raw


def load_language_model(checkpoint: str | Path, map_location: str = "cpu",
                        tool: str = "generate") -> tuple[LanguageModel, dict]:
    """A trained ``LanguageModel`` in eval mode and its data module's hyper-parameters (tokenizer, ...).

    A tokenizer the run keeps in its folder (``TextDataModule.keep_in_run_folder``) is recorded by its absolute path;
    where the run folder has moved since, the copy beside this checkpoint (``<run>/tokenizer``) is the one read.
    """
    raw = read_checkpoint(checkpoint, LanguageModel, tool, map_location)
    data_hparams = dict(raw.get("datamodule_hyper_parameters") or {})
    recorded, kept = data_hparams.get("tokenizer"), Path(checkpoint).resolve().parent.parent / RUN_TOKENIZER
    moved = isinstance(recorded, str) and Path(recorded).name == RUN_TOKENIZER and not Path(recorded).exists()
    if moved and kept.is_dir():
        data_hparams["tokenizer"] = str(kept)
    hparams = dict(raw["hyper_parameters"])
    hparams["init_from"] = hparams["init_from_hf"] = None  # the checkpoint already holds the converted weights
    task = LanguageModel(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    task.configure_model()
    task.load_state_dict(raw["state_dict"])
    task.tokens_seen = raw.get("tokens_seen", 0)
    return task.eval(), data_hparams


@contextmanager
def one_line_errors(tool: str):
    """A missing file, an unreachable hub or weights that do not fit stop the tool with one line saying so."""
    try:
        yield
    except (OSError, ValueError) as error:
        raise SystemExit(f"moh {tool}: {error}") from None


def write_checkpoint(path: str | Path, task: type, task_hparams: dict, state_dict: dict[str, torch.Tensor],
                     datamodule_hparams: dict) -> Path:
    """A checkpoint of ``task`` in the layout ``moh fit`` writes and the tools read (``load_from_checkpoint``, the
    data module's hyper-parameters, the task's class path), for weights that were not trained here."""
    import lightning

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    task_hparams = {"_class_path": f"{task.__module__}.{task.__qualname__}", **task_hparams}
    torch.save({"state_dict": state_dict, "hyper_parameters": task_hparams,
                "datamodule_hyper_parameters": datamodule_hparams, "pytorch-lightning_version": lightning.__version__,
                "epoch": 0, "global_step": 0}, path)
    return path


__all__ = ["TOOLS_FOR", "checkpoint_task", "load_language_model", "one_line_errors", "read_checkpoint",
           "write_checkpoint"]
