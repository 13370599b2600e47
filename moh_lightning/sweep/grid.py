"""The sweep's grid: its cells, the trials' names, the baseline cell, and each trial's ``moh fit`` arguments.

``sweep.json`` in the sweep folder records what was swept, so that the same folder is not continued with another
grid, other seeds, another config or other extra arguments.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moh_lightning.sweep.report import cell_label, format_value, short_keys

SPEC_FILE = "sweep.json"     # in <out>: what was swept, so a restart with other settings is refused


def grid_cells(grid: dict[str, list | dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every combination of the grid's values, in the grid's order (the last key varies fastest): the override
    values, and the same cells as shown in trial names and tables (a named value by its name)."""
    grid = {key.removeprefix("--"): values for key, values in (grid or {}).items()}
    choices = {}
    for key, values in grid.items():
        if not isinstance(values, (list, tuple, dict)) or not values:
            raise SystemExit(f"moh sweep: --grid {key!r} needs a non-empty list of values (or a mapping of named "
                             f"values), got {values!r}.")
        if key in ("seed_everything", "config", "ckpt_path") or key.startswith("trainer.logger"):
            raise SystemExit(f"moh sweep: --grid {key!r} is set by the sweep itself (seeds: --seeds).")
        choices[key] = list(values.items()) if isinstance(values, dict) else [(value, value) for value in values]
    combos = list(itertools.product(*choices.values()))
    return ([{key: value for key, (_, value) in zip(choices, combo, strict=True)} for combo in combos],
            [{key: shown for key, (shown, _) in zip(choices, combo, strict=True)} for combo in combos])


def cli_value(value: Any) -> str:
    """A grid value as the command-line text jsonargparse reads back as the same value."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[str(value)]
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        if e and "." not in mantissa:  # YAML 1.1 reads 1e-05 as a string, 1.0e-05 as a float
            text = f"{mantissa}.0e{exponent}"
        return text
    return json.dumps(value)


def trial_names(cells: list[dict[str, Any]], seeds: list[int]) -> dict[tuple[int, int], str]:
    """Readable, file-name-safe, unique names: ``top_k=2-seed=1``; the cell index is added only on a clash."""
    short = short_keys(list(cells[0]))

    def name(cell: dict[str, Any], seed: int, prefix: str = "") -> str:
        parts = [f"{short[k]}={format_value(v)}" for k, v in cell.items()] + [f"seed={seed}"]
        return re.sub(r"[^A-Za-z0-9._=+-]+", "_", prefix + "-".join(parts))[:120]

    names = {(c, s): name(cell, seed) for c, cell in enumerate(cells) for s, seed in enumerate(seeds)}
    if len(set(names.values())) < len(names):
        names = {(c, s): name(cell, seed, f"cell{c}-") for c, cell in enumerate(cells) for s, seed in enumerate(seeds)}
    return names


def baseline_index(cells: list[dict[str, Any]], shown: list[dict[str, Any]], baseline: dict[str, Any] | None) -> int:
    """The cell ``baseline`` names, by override values or by the names of named values."""
    if not baseline:
        return 0
    baseline = {key.removeprefix("--"): value for key, value in baseline.items()}
    unknown = set(baseline) - set(cells[0])
    if unknown:
        raise SystemExit(f"moh sweep: --baseline keys {sorted(unknown)} are not grid keys {list(cells[0])}.")
    match = [c for c, (cell, names) in enumerate(zip(cells, shown, strict=True))
             if all(cli_value(v) in (cli_value(cell[k]), cli_value(names[k])) for k, v in baseline.items())]
    if len(match) != 1:
        raise SystemExit(f"moh sweep: --baseline {baseline} matches {len(match)} grid cells; it must name one.")
    return match[0]


def check_spec(out_dir: Path, spec: dict[str, Any]) -> None:
    """Records what the sweep in ``out_dir`` runs; refuses to continue a different one there."""
    path = out_dir / SPEC_FILE
    spec = json.loads(json.dumps(spec))
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != spec:
            changed = sorted(k for k in spec if previous.get(k) != spec[k])
            raise SystemExit(f"moh sweep: {out_dir} holds a different sweep (its {', '.join(changed)} differ, see "
                             f"{path}): give another --out, or delete that folder to start over.")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2) + "\n")


def fit_args(fit_config: str, extra_args: Sequence[str], overrides: dict[str, Any], seed: int, runs: str,
             name: str) -> list[str]:
    """The ``moh fit`` arguments of one trial; ``--ckpt_path last`` continues it when it was started before."""
    args = ["fit", "--config", fit_config, *extra_args]
    for key, value in overrides.items():
        args += [f"--{key}", cli_value(value)]
    return args + ["--seed_everything", str(seed), "--trainer.logger.init_args.save_dir", runs,
                   "--trainer.logger.init_args.name", name, "--ckpt_path", "last"]


def check_cells(fit_config: str, extra_args: Sequence[str], cells: list[dict[str, Any]], shown: list[dict[str, Any]],
                runs: str) -> None:
    """Parses each cell's ``moh fit`` arguments as its trials will (to ``--print_config``, which builds nothing; a
    tenth of a second a cell), so that a misspelled key or a value of the wrong type stops the sweep in one line
    before Ray starts, instead of failing every trial of the cell."""
    from moh_lightning.cli import main

    short = short_keys(list(cells[0]))
    for cell, names in zip(cells, shown, strict=True):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the config it prints
                main([*fit_args(fit_config, extra_args, cell, 0, runs, "check"), "--print_config"])
        except SystemExit as exit:
            if exit.code not in (0, None):
                message = exit.code if isinstance(exit.code, str) else f"moh fit exits with status {exit.code}"
                raise SystemExit(f"moh sweep: the cell {cell_label(names, short)} cannot run: "
                                 f"{message.removeprefix('moh: ')}") from None
