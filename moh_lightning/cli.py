"""The ``moh`` command: a table from command names to what runs them.

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's (``moh_lightning.trainer_cli``); every other command
is a typed function parsed by jsonargparse, so it takes ``--help``, ``--config`` and overrides the same way. Nothing is
imported until a command runs, so ``moh --help`` and a mistyped command answer before torch would have loaded; an
integration missing for a command is one line naming the extra that installs it.
"""
from __future__ import annotations

import difflib
import errno
import functools
import gc
import getpass
import importlib
import inspect
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

from moh_lightning.errors import MissingExtraError, UsageError, debugging, missing_extra


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


def command_description(function: Callable) -> str:
    """What ``moh <tool> --help`` says above its options: every paragraph of the docstring before its ``Args:``.

    jsonargparse's own description is the docstring's first line, which cut a first sentence that runs over two.
    """
    text = re.split(r"\n(?:Args|Returns|Raises|Examples?):\n", inspect.getdoc(function) or "")[0]
    return text.replace("``", "`").strip()


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


def user_error(command: str, error: BaseException) -> str | None:
    """The one line for an error caused by what the user gave (a value, a file, a folder, a permission, a full disk,
    an extra not installed), None for any other error: a bug, which keeps its traceback."""
    from moh_lightning.serialization import UnsafeCheckpointError

    if isinstance(error, ImportError) and not isinstance(error, MissingExtraError):
        error = missing_extra(error) or error
    if isinstance(error, MissingExtraError):
        return f"moh {command}: {error}"
    if isinstance(error, (UsageError, UnsafeCheckpointError)):
        return f"moh: {error}"
    if isinstance(error, OSError) and error.filename is not None:
        what = {errno.ENOSPC: "no space left on the device; free some or write elsewhere",
                errno.EDQUOT: "over the disk quota; free some space or write elsewhere",
                errno.EACCES: "permission denied; choose a path you can write to or change its permissions",
                errno.EPERM: "not permitted; choose a path you can write to",
                errno.EROFS: "a read-only file system; write elsewhere",
                errno.ENOENT: "no such file or folder; check the path",
                errno.EISDIR: "a folder where a file is expected; give a file",
                errno.ENOTDIR: "a file where a folder is expected; give a folder"}.get(error.errno)
        return f"moh {command}: {error.filename}: {what or error.strerror}" if what or error.strerror else None
    return None


def _debugging(given: list[str]) -> bool:
    """``MOH_DEBUG=1`` or ``--debug``: every error with its traceback. The flag is taken off the command line, and the
    variable set, so the processes a run starts (DDP's, a sweep's trials) show theirs too."""
    if "--debug" in given:
        given.remove("--debug")
        if "--debug" in sys.argv:
            sys.argv.remove("--debug")
        os.environ["MOH_DEBUG"] = "1"
    return debugging()


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``moh``; ``args`` replaces ``sys.argv[1:]`` so tests drive it from Python.

    ``moh``, ``moh -h`` and ``moh --help`` list the commands. The one boundary for errors: an unknown command and
    anything the user gave that cannot work stop in one line and a non-zero exit; any other error is a bug, shown with
    its traceback and a line saying so; ``MOH_DEBUG=1`` or ``--debug`` shows every traceback.
    """
    given = list(sys.argv[1:] if args is None else args)
    debug = _debugging(given)
    args = None if args is None else given
    if given[:1] in (["-h"], ["--help"]):
        print(commands_help())
        return
    if not given:
        raise SystemExit(commands_help())
    if not given[0].startswith("-") and given[0] not in COMMANDS:
        raise SystemExit(unknown_command(given[0]))
    quiet_third_party()
    command = given[0] if given[0] in COMMANDS else "fit"
    try:
        with _no_empty_inductor_folder():
            _run(command, given, args, debug)
    finally:
        if args is None:  # the command of this process, which ends with it
            # Python's exit would search the millions of objects torch, Lightning and Ray made for cycles to free:
            # seconds of CPU, for memory that the process's end frees anyway.
            gc.freeze()


@contextmanager
def _no_empty_inductor_folder() -> Iterator[None]:
    """Importing torch._dynamo (Lightning does, through torchmetrics and torchvision) makes Inductor's cache folder
    ``$TMPDIR/torchinductor_<user>`` even where nothing is compiled; one that this command made and left empty goes."""
    folder = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    existed = folder.exists()
    try:
        yield
    finally:
        if not existed:
            with suppress(OSError):  # not empty (something was compiled), or gone already
                folder.rmdir()


def _run(command: str, given: list[str], args: list[str] | None, debug: bool) -> None:
    try:
        if command in TOOLS:
            from jsonargparse import CLI

            from moh_lightning.cli_args import resolve_config_args
            from moh_lightning.cli_errors import OneLineToolParser

            function = target(TOOLS[command])
            CLI(function, args=resolve_config_args(given[1:]), as_positional=False, parser_class=OneLineToolParser,
                prog=f"moh {command}", description=command_description(function))
        else:
            from moh_lightning.trainer_cli import MoHLightningCLI

            MoHLightningCLI(args=args)  # None: Lightning's DDP launcher starts each further process from sys.argv
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as error:
        line = user_error(command, error)
        if debug:
            raise
        if line is not None:
            raise SystemExit(line) from None
        # Raised as it is (a caller of main() sees the error itself), with a note Python prints after the traceback.
        note = (f"moh {command}: an unexpected {type(error).__name__}: this is a bug in moh-lightning; please report "
                f"it with the traceback.")
        if hasattr(error, "add_note"):  # Python 3.11
            error.add_note(note)
        else:
            print(note, file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
