"""jsonargparse's error reports (usage text, nested union and subclass reports) as the one line ``moh`` prints, and the
tools' parser that prints them."""
from __future__ import annotations

import re
import sys

from jsonargparse import ArgumentParser, DefaultHelpFormatter

from moh_lightning.errors import debugging


def one_line_error(message: str, listing: str = "moh fit --config <yaml> --print_config") -> str:
    """A jsonargparse error report as one line naming the key and what to do; ``listing`` is the command that lists
    the valid keys."""
    unknown = re.search(r"unrecognized arguments: (\S+?)(?:=|\s|$)|Option '([^']+)' is not accepted", message)
    if unknown:
        # Inside a subclass the report names the group ("model"), then each nested group within its init_args
        # ("arch.moh"), and last the argument relative to the innermost one.
        groups = re.findall(r'Parser key "([^"]+)"', message)
        name = (unknown.group(1) or unknown.group(2)).lstrip("-")
        key = ".".join([f"{groups[0]}.init_args", *groups[1:], name]) if groups and "." not in groups[0] else name
        if ":" in name:  # YAML reads `{path:my.txt}` as the key 'path:my.txt' without a value
            field, _, value = name.partition(":")
            return (f"unknown config key {key!r}: in YAML a key takes its value after a colon and a space, so write "
                    f"'{field}: {value}' (a space after the colon).")
        return (f"unknown config key {key!r}: check its spelling and level against `{listing}` (keys are not "
                f"abbreviated).")
    keys = re.findall(r'Parser key "([^"]+)"', message)
    missing = re.search(r"(?:class_path '([\w.]+)':\s*)?the following arguments are required: ([\w., ]+)", message)
    if missing:
        return _required(keys, *missing.groups(), listing)
    # Otherwise the innermost reason (e.g. a ValueError of an __init__) after the key it belongs to.
    lines = [line.strip(" -") for line in message.splitlines() if line.strip(" -")]
    reasons = [line for line in lines if not re.match(r"(Parser key|Does not validate|Subtypes|Errors|Given value"
                                                      r"|Expected a <class 'NoneType'>|Problem with given)", line)]
    reason = _restriction(" ".join(reasons or lines))
    if keys:
        return f"config key {'.init_args.'.join(keys)!r}: {reason}"
    built = re.search(r"class_path='(?:\w+\.)*(\w+)'", message)
    return f"{built.group(1)}: {reason}" if built else reason


class OneLineErrors:
    """A jsonargparse parser whose errors are one line naming the key (``one_line``), not usage text and nested
    reports; abbreviated options are errors too (argparse would read ``--num_sample`` as ``--num_samples``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or debugging():  # jsonargparse catches these errors itself
            super().error(message, ex)
        raise SystemExit(self.one_line(message))

    def one_line(self, message: str) -> str:
        return f"{self.prog}: {one_line_error(message, f'{self.prog} --help')}"


class OneLineToolParser(OneLineErrors, ArgumentParser):
    """A tool's parser (``prog`` is ``moh <tool>``), with one-line errors and a description in paragraphs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, formatter_class=ParagraphsHelpFormatter, **kwargs)


class ParagraphsHelpFormatter(DefaultHelpFormatter):
    """Fills each paragraph of a description on its own, where argparse runs them together into one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(ParagraphsHelpFormatter, self)._fill_text(paragraph, width, indent)
                             for paragraph in text.split("\n\n"))


def _required(keys: list[str], class_path: str | None, names: str, listing: str) -> str:
    """The flags a config left out, with what their class says to give (its ``required_help``), else ``listing``."""
    # As for an unknown key: the subclass's group, then the nested groups within its init_args.
    prefix = ".".join([f"{keys[0]}.init_args", *keys[1:], ""]) if class_path and keys else ".".join([*keys, ""])
    flags = [f"--{prefix}{name.strip()}" for name in names.split(",")]
    cls = _imported(class_path)
    helps = [cls.required_help[name.strip()] for name in names.split(",")
             if name.strip() in getattr(cls, "required_help", {})]
    owner = f" by {cls.__name__}" if cls is not None else ""
    said = f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} required{owner}"
    return said + "".join(f": {text}" for text in helps) if helps else f"{said}; `{listing}` describes it."


def _imported(class_path: str | None) -> type | None:
    """The class a config names, which jsonargparse has imported already; None when there is none."""
    module, _, name = (class_path or "").rpartition(".")
    return getattr(sys.modules.get(module), name, None)


def _restriction(reason: str) -> str:
    """jsonargparse's report on a restricted number type ("Not of type PositiveInt: -5 does not conform to restriction
    v>0") as what the value must be ("-5 given; it must be > 0")."""
    found = re.search(r"Not of type \w+: (\S*) ?does not conform to restriction (v[^E]*?)\s*"
                      r"(?:Expected a typing\.Literal\[(.+?)\].*)?$", reason)
    if found is None:
        return reason
    given, rule, also = found.groups()
    rule = re.sub(r"v([<>]=?)", r"\1 ", rule)
    return reason[:found.start()] + f"{given or 'the value'} given; it must be {rule}" + (f" or {also}" if also else "")
