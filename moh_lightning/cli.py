"""The ``moh`` command: LightningCLI for fit / validate / test / predict, plus the suite's own tools.

``moh fit --config vit_s_75.yaml`` runs a shipped config from any folder: a ``--config`` value that is not a
file resolves against the suite's ``cli_configs/``. Tools that are not Trainer loops (sampling, generation,
evaluation, benchmarks) are plain typed functions listed in ``TOOLS`` and parsed by jsonargparse, so they
take ``--help``, ``--config`` and command-line overrides the same way.
"""
from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from jsonargparse import CLI
from jsonargparse._common import debug_mode_active
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

# name -> "module:function"; imported only when called so `moh fit` does not load every task.
TOOLS: dict[str, str] = {
    "bench": "moh_lightning.tools.bench:bench",
    "sample": "moh_lightning.tools.sample:sample",
    "fidelity": "moh_lightning.tools.fidelity:fidelity",
    "digit_quality": "moh_lightning.tools.digit_quality:digit_quality",
    "generate": "moh_lightning.tools.generate:generate",
    "convert-llama": "moh_lightning.tools.export:convert_llama",
    "export-hf": "moh_lightning.tools.export:export_checkpoint",
    "lm-eval": "moh_lightning.tools.lm_eval:lm_eval",
}

_CONFIG_FLAGS = ("--config", "-c")


def config_dir() -> Path:
    """The shipped ``cli_configs/``: installed with the package, or beside it in a source checkout."""
    packaged = Path(__file__).resolve().parent / "cli_configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "cli_configs"


def resolve_config(value: str) -> str:
    """A path as given when it exists, else the shipped config of that name; a clear error otherwise."""
    if Path(value).is_file():
        return value
    shipped = config_dir() / value
    if not shipped.suffix:
        shipped = shipped.with_suffix(".yaml")
    if shipped.is_file():
        return str(shipped)
    names = ", ".join(sorted(p.name for p in config_dir().glob("*.yaml")))
    raise SystemExit(f"moh: --config {value}: no such file here nor in the shipped configs ({names}).")


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """Rewrites every ``--config NAME`` / ``--config=NAME`` to a path (see ``resolve_config``)."""
    out, args = [], list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            out += [arg, resolve_config(args[i + 1])]
            i += 2
            continue
        flag, sep, value = arg.partition("=")
        if sep and flag in _CONFIG_FLAGS:
            arg = f"{flag}={resolve_config(value)}"
        out.append(arg)
        i += 1
    return out


def one_line_error(message: str) -> str:
    """A jsonargparse error report (usage, nested union and subclass reports) as one line naming the key."""
    unknown = re.search(r"unrecognized arguments: (\S+?)(?:=|\s|$)|Option '([^']+)' is not accepted", message)
    if unknown:
        # Inside a subclass the report names the group ("model") and the argument relative to its init_args.
        group = re.match(r'Parser key "([^"]+)"', message)
        name = (unknown.group(1) or unknown.group(2)).lstrip("-")
        key = f"{group.group(1)}.init_args.{name}" if group and "." not in group.group(1) else name
        return (f"unknown config key {key!r}: check its spelling and level against `moh fit --config <yaml> "
                f"--print_config` (keys are not abbreviated).")
    # Otherwise the innermost reason (e.g. a ValueError of an __init__) after the key it belongs to.
    keys = re.findall(r'Parser key "([^"]+)"', message)
    lines = [line.strip(" -") for line in message.splitlines() if line.strip(" -")]
    reasons = [line for line in lines if not re.match(r"(Parser key|Does not validate|Subtypes|Errors|Given value"
                                                      r"|Expected a <class 'NoneType'>|Problem with given)", line)]
    reason = " ".join(reasons or lines)
    if keys:
        return f"config key {'.init_args.'.join(keys)!r}: {reason}"
    built = re.search(r"class_path='(?:\w+\.)*(\w+)'", message)
    return f"{built.group(1)}: {reason}" if built else reason


class OneLineErrorParser(LightningArgumentParser):
    """Parser errors as one line naming the key and what to do, instead of usage text and nested reports.

    Abbreviated options are errors too (argparse would silently read ``--trainer.max_step`` as ``max_steps``).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or debug_mode_active():  # jsonargparse catches these errors itself
            super().error(message, ex)
        raise SystemExit(f"moh: {one_line_error(message)}")


class MoHLightningCLI(LightningCLI):
    """LightningCLI over any of the suite's tasks and data modules, chosen by ``class_path`` in the config."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_class=OneLineErrorParser,
            args=args,
            run=run,
        )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:  # an __init__ check (e.g. a head budget) inside jsonargparse's nested report
            raise SystemExit(f"moh: {one_line_error(str(error))}") from None


def _tool(name: str) -> Callable:
    module, _, function = TOOLS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``moh``; ``args`` replaces ``sys.argv[1:]`` so tests drive it from Python."""
    from_command_line = args is None
    args = resolve_config_args(sys.argv[1:] if from_command_line else args)
    if args and args[0] in TOOLS:
        CLI(_tool(args[0]), args=args[1:], as_positional=False)
        return
    if from_command_line:  # LightningCLI warns when given args while sys.argv has its own.
        sys.argv[1:] = args
    MoHLightningCLI(args=None if from_command_line else args)


if __name__ == "__main__":
    main()
