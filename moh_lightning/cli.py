"""The ``moh`` command: a table from command names to what runs them.

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's (``moh_lightning.trainer_cli``); every other command
is a typed function parsed by jsonargparse, so it takes ``--help``, ``--config`` and overrides the same way. Nothing is
imported until a command runs, so ``moh --help`` and a mistyped command answer before torch would have loaded; an
integration missing for a command is one line naming the extra that installs it.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import logging
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

from moh_lightning.errors import MissingExtraError, UsageError, missing_extra


class Command(NamedTuple):
    target: str  # "module:attribute.path", imported when the command runs
    summary: str  # its line in `moh --help`: the first sentence of its docstring (tests/cli/test_cli_help.py)


# LightningCLI's subcommands, each the Trainer method of its name.
LOOPS: dict[str, Command] = {
    "fit": Command("lightning.pytorch:Trainer.fit", "Runs the full optimization routine."),
    "validate": Command("lightning.pytorch:Trainer.validate", "Perform one evaluation epoch over the validation set."),
    "test": Command("lightning.pytorch:Trainer.test", "Perform one evaluation epoch over the test set."),
    "predict": Command("lightning.pytorch:Trainer.predict", "Run inference on your data."),
}
TOOLS: dict[str, Command] = {
    "bench": Command("moh_lightning.tools.bench:bench", "Benchmark MoH attention (head-sparse execution) and MoH "
                     "models against dense multi-head attention."),
    "sample": Command("moh_lightning.tools.sample:sample", "Samples images from a trained ClassConditionalDiffusion "
                      "checkpoint (its EMA weights)."),
    "fidelity": Command("moh_lightning.tools.fidelity:fidelity", "FID / sFID / IS / precision / recall of a folder or "
                        ".npz of samples against a reference set."),
    "digit_quality": Command("moh_lightning.tools.digit_quality:digit_quality", "Scores `moh sample` output of a "
                             "MNIST diffusion model with a trained MNIST classifier."),
    "generate": Command("moh_lightning.tools.generate:generate", "Continues a prompt with a trained MoH language "
                        "model, decoding through the KV cache."),
    "convert-hf": Command("moh_lightning.tools.export:convert_hf", "Converts any `transformers` causal LM whose "
                          "attention goes through transformers' attention interface (Qwen2, Qwen3, Mistral, Phi-3, "
                          "Gemma 2, LLaMA, ...) into a MoH folder with the parameter-free query-norm router."),
    "convert-llama": Command("moh_lightning.tools.export:convert_llama", "Converts a `transformers` LLaMA into a "
                             "MoH-LLaMA folder that `transformers` and lm-eval load."),
    "export-hf": Command("moh_lightning.tools.export:export_checkpoint", "Exports a `moh fit` LanguageModel checkpoint "
                         "to a `transformers` folder, optionally pushed to the hub."),
    "export-timm": Command("moh_lightning.tools.export_timm:export_timm", "Writes a `moh fit` image-classifier "
                           "checkpoint as a timm folder and optionally pushes it to the hub."),
    "load-authors-dit": Command("moh_lightning.tools.authors_dit:load_authors_dit_tool", "Loads the authors' MoH-DiT "
                                "into the suite's DiT and writes a checkpoint `moh sample` reads."),
    "load-authors-llama": Command("moh_lightning.tools.authors_llama:load_authors_llama_tool", "Loads their MoH-LLaMA3 "
                                  "into the suite's MoH-LLaMA and writes it for `moh lm-eval`."),
    "lm-eval": Command("moh_lightning.tools.lm_eval:lm_eval", "Evaluates a MoH language model with "
                       "lm-evaluation-harness and prints the harness's table."),
    "sweep": Command("moh_lightning.sweep:sweep", "Run one `moh fit` config over a grid of overrides × seeds on Ray "
                     "Tune; write a table and a plot."),
    "head-figures": Command("moh_lightning.tools.head_figures:head_figures", "Renders the head-load heatmaps of a run "
                            "folder as PDF / PNG figures."),
}
COMMANDS: dict[str, Command] = {**LOOPS, **TOOLS}


def target(command: Command) -> Callable:
    module, _, path = command.target.partition(":")
    return functools.reduce(getattr, path.split("."), importlib.import_module(module))


def commands_help() -> str:
    """What ``moh --help`` prints: every command with its one line."""
    width = max(map(len, COMMANDS))
    return "\n".join([
        "usage: moh <command> [--config NAME] [--key value ...]", "",
        "Trainer loops (LightningCLI; a --config name resolves against the shipped cli_configs/):",
        *(f"  {name:<{width}}  {command.summary}" for name, command in LOOPS.items()), "", "Tools:",
        *(f"  {name:<{width}}  {command.summary}" for name, command in TOOLS.items()), "",
        "`moh <command> --help` lists the options of a command."])


def unknown_command(name: str) -> str:
    """One line naming the commands and the one nearest to the mistyped ``name``."""
    nearest = difflib.get_close_matches(name, COMMANDS, n=1)
    hint = f" (did you mean {nearest[0]!r}?)" if nearest else ""
    return f"moh: unknown command {name!r}{hint}; the commands are {', '.join(COMMANDS)}; `moh --help` says more."


# Messages a user of `moh` can do nothing about, each silenced by its text and the module that emits it:
# torchdata's own call of a deprecated torch function, Lightning's own use of a deprecated torch class, and
# Lightning's advertisement for another logger; lm-eval's notes that `moh lm-eval --checkpoint` hands its harness model
# a built network (as it must: a `moh fit` checkpoint is no hub folder), and that a task's data set is read by the
# task's own function (as the shipped example's is).
_QUIET_WARNINGS = ((r"'set_vital' is deprecated", UserWarning, r"torchdata\.stateful_dataloader"),
                   (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
                    r"lightning\.pytorch\.utilities\._pytree"))
_QUIET_LOGS = (("lightning.pytorch.utilities.rank_zero", r"💡 Tip: For seamless cloud logging"),
               ("lm_eval.models.huggingface", r"`pretrained` model kwarg is not of type `str`"),
               ("lm_eval.models.huggingface", r"Passed an already-initialized model through `pretrained`"),
               ("lm_eval.api.task", r"\S+: Custom kwargs can be passed to `--metadata`"))


def quiet_third_party() -> None:
    """Silences the third-party messages in ``_QUIET_WARNINGS`` and ``_QUIET_LOGS``, and nothing else."""
    for message, category, module in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in _QUIET_LOGS:
        logger = logging.getLogger(name)
        if not any(getattr(f, "pattern", None) == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return re.match(self.pattern, str(record.msg)) is None


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``moh``; ``args`` replaces ``sys.argv[1:]`` so tests drive it from Python.

    ``moh``, ``moh -h`` and ``moh --help`` list the commands; an unknown command, a user's mistake (``UsageError``), a
    checkpoint refused for what its pickle names and an extra that is not installed stop in one line.
    """
    given = list(sys.argv[1:] if args is None else args)
    if given[:1] in (["-h"], ["--help"]):
        print(commands_help())
        return
    if not given:
        raise SystemExit(commands_help())
    if not given[0].startswith("-") and given[0] not in COMMANDS:
        raise SystemExit(unknown_command(given[0]))
    quiet_third_party()
    try:
        if given[0] in TOOLS:
            from jsonargparse import CLI

            from moh_lightning.cli_args import resolve_config_args

            CLI(target(TOOLS[given[0]]), args=resolve_config_args(given[1:]), as_positional=False)
        else:
            from moh_lightning.trainer_cli import MoHLightningCLI

            MoHLightningCLI(args=args)  # None: Lightning's DDP launcher starts each further process from sys.argv
    except MissingExtraError as error:
        raise SystemExit(f"moh {given[0]}: {error}") from None
    except UsageError as error:
        raise SystemExit(f"moh: {error}") from None
    except ImportError as error:
        extra = missing_extra(error)
        if extra is None:
            raise
        raise SystemExit(f"moh {given[0]}: {extra}") from None
    except Exception as error:
        from moh_lightning.serialization import UnsafeCheckpointError

        if isinstance(error, UnsafeCheckpointError):
            raise SystemExit(f"moh: {error}") from None
        raise


if __name__ == "__main__":
    main()
