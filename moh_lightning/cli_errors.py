"""jsonargparse's error reports (usage text, nested union and subclass reports) as the one line ``moh`` prints."""
from __future__ import annotations

import re


def one_line_error(message: str) -> str:
    """A jsonargparse error report as one line naming the key and what to do."""
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
