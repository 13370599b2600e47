"""``moh sweep``: one ``moh fit`` config over a grid of overrides × seeds on Ray Tune, with a table and a plot.

Each trial is an ordinary ``moh fit`` run inside a Ray Tune trainable; its run folder is
``<out>/runs/<trial>/version_N/``. Tune's own experiment state in ``<out>/tune`` makes the sweep restartable:
the same command again restores it with ``Tuner.restore`` and runs only the trials that have not finished.

A sweep stops as a run does. SIGTERM or Ctrl-C asks every running trial to stop at its next step boundary with its
checkpoint (``StopWhenAsked``, through the file ``<out>/stop``: a trial runs in a thread of a Ray worker, which
hears no signal of its own); once each has saved, Tune ends its loop as on its own interruption (SIGUSR1), keeping
the unfinished trials unfinished, and ``moh sweep`` exits 143 / 130 with one line saying how to continue. A second
signal ends it at once. A local Ray keeps its session files in a temporary folder removed at exit, and
authenticates with a token held in its processes' environment, never written to ``~/.ray``.

This module is the command. ``grid`` makes its trials and their ``moh fit`` arguments, ``ray_tune`` runs them on Ray
Tune, ``stopping`` stops them at a step boundary on a signal, and ``report`` writes the table and the plot.
"""
from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from jsonargparse.typing import NonNegativeFloat, PositiveInt

from moh_lightning.configs import resolve_config
from moh_lightning.sweep.grid import baseline_index, check_cells, check_spec, grid_cells, trial_names
from moh_lightning.sweep.ray_tune import DRIVER_ENV, ERROR_FILE, EXPERIMENT, RUNS, environ, ray_temp_folder, run_on_tune
from moh_lightning.sweep.report import STATUS_FAILED, STATUS_FINISHED, STATUS_UNFINISHED, write_report
from moh_lightning.sweep.stopping import EndNow, StopSignals


def sweep(
        fit_config: str,
        grid: dict[str, list | dict[str, Any]] | None = None,
        seeds: Sequence[int] = (0, 1, 2),
        metric: str = "val/loss",
        mode: Literal["min", "max"] = "min",
        out: str | None = None,
        baseline: dict[str, Any] | None = None,
        address: str | None = None,
        max_concurrent: PositiveInt = 1,
        cpus_per_trial: PositiveInt | None = None,
        gpus_per_trial: NonNegativeFloat = 0,
        retry_failed: bool = True,
        reuse_workers: bool = True,
        extra_args: Sequence[str] = (),
) -> Path:
    """Run one `moh fit` config over a grid of overrides × seeds on Ray Tune; write a table and a plot.

    Every trial is an ordinary `moh fit --config <fit_config> <extra_args> <cell overrides> --seed_everything
    <seed> --ckpt_path last` run in a Ray Tune trainable, in its own run folder `<out>/runs/<trial>/version_N/`
    (events, config.yaml, checkpoints; trial names such as `top_k=2-seed=1`). Its final metrics (the trainer's
    `callback_metrics` when fit returns: the last value logged of each) are reported to Tune. Each cell's arguments
    are parsed before Ray starts, so a misspelled key or a mistyped value is refused in one line. A failed trial is
    reported with its error and the others go on; the sweep then exits non-zero, after its report. Killed or
    interrupted, the same command continues the sweep from Tune's state in `<out>/tune`: finished trials are not
    run again, unfinished ones continue from their newest checkpoint (`--ckpt_path last`) and failed ones run again
    when `retry_failed`. When nothing is left
    to run, the same command only rewrites the report from Tune's saved state (without starting Ray), so
    `--metric` / `--mode` / `--baseline` may change between calls; the grid, seeds, config and extra_args may
    not.

    Writes `<out>/results.md` and `<out>/results.csv` (one row per grid cell: each logged metric's mean ± std
    and n over seeds, and for each other cell Welch's t-test p-value and the 95% confidence interval of the
    difference to the baseline cell), `<out>/trials.csv` (one row per trial, with status, the Ray node it
    finished on, run folder and error) and `<out>/<metric>.png` (the metric per cell, each seed a dot, mean ±
    std as error bar).

    Args:
        fit_config: The `moh fit` config: a YAML path, or the name of a shipped config (`llm_stdlib_75.yaml`).
        grid: Override key -> values, e.g. `{"model.init_args.lr": [1e-3, 2e-3]}`; the cells are every
            combination. A mapping instead of a list names its values: `{"model.init_args.arch.moh": {"dense":
            null, "75%": {"num_shared_heads": 4, "top_k": 2}}}` labels trials and table rows `dense` / `75%`.
            None: the config as is, over seeds only.
        seeds: `seed_everything` values; every cell runs every seed.
        metric: The logged metric of the table's comparison and of the plot (any key of `callback_metrics`).
        mode: `min` or `max`: which direction of `metric` is better (marks the best cell).
        out: The sweep folder; `sweeps/<config stem>` when None.
        baseline: The cell the others are compared with, as override key -> value (a subset of the keys is
            enough when it names one cell); the first cell when None.
        address: A Ray cluster's address for `ray.init` (`auto`, `ray://head:10001`, ...); a fresh local Ray
            on this machine when None. On a cluster, `out` and the config must be on storage all nodes share.
        max_concurrent: Trials that run at the same time.
        cpus_per_trial: CPUs Ray reserves per trial, also its torch / OpenMP thread count; by default the
            cores of the smallest node divided by `max_concurrent`.
        gpus_per_trial: GPUs Ray reserves per trial (configs with `trainer.accelerator: gpu`).
        retry_failed: On a restart, run the trials that failed again.
        reuse_workers: Run trials one after another in the same Ray worker process (Tune's `reuse_actors`),
            each seeded afresh by its own `moh fit`, with the compiler's caches cleared; saves the ~12 s a fresh
            process costs per trial (results/sweep_overhead.md). False: a fresh process per trial, so no state at
            all carries over from one trial to the next.
        extra_args: Further `moh fit` arguments given to every trial, before the cell's overrides
            (e.g. `["--trainer.max_steps", "200"]`).
    """
    config_path = Path(resolve_config(fit_config)).resolve()
    cells, shown = grid_cells(grid)
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"moh sweep: --seeds {seeds} must be distinct and at least one.")
    if max_concurrent < 1:
        raise SystemExit(f"moh sweep: --max_concurrent {max_concurrent} must be at least 1.")
    base = baseline_index(cells, shown, baseline)
    out_dir = Path(out if out is not None else Path("sweeps") / config_path.stem).resolve()
    names = trial_names(shown, seeds)
    trials = [{"name": names[c, s], "cell": c, "seed": seed, "overrides": cell}
              for c, cell in enumerate(cells) for s, seed in enumerate(seeds)]
    check_spec(out_dir, {"fit_config": str(config_path), "grid": grid or {},
                         "seeds": seeds, "extra_args": list(extra_args)})
    check_cells(str(config_path), list(extra_args), cells, shown, str(out_dir / RUNS))

    try:
        with environ(DRIVER_ENV), ray_temp_folder() as ray_folder, StopSignals(out_dir) as stop:
            results = run_on_tune(trials, config_path, out_dir, address, max_concurrent, cpus_per_trial,
                                  gpus_per_trial, retry_failed, reuse_workers, list(extra_args), ray_folder)
    except EndNow as end:  # Ray was shut down on the way out, with the trials' processes
        print(f"moh sweep: a second {signal.Signals(end.signum).name} ended the sweep at once; each trial continues "
              f"from its newest checkpoint with the same command: {_same_command()}", file=sys.stderr)
        raise SystemExit(128 + end.signum) from None
    paths = write_report(out_dir, results, shown, seeds, metric, mode, base, title=config_path.name)
    counts = {s: sum(r.status == s for r in results) for s in (STATUS_FINISHED, STATUS_FAILED, STATUS_UNFINISHED)}
    if stop.signum:
        # The exit code of a process the signal ended (143, 130), as `moh fit` stops; one line on how to go on.
        print(f"moh sweep: stopped by {signal.Signals(stop.signum).name}: {counts[STATUS_FINISHED]} of "
              f"{len(results)} trials finished, the running ones saved at a step boundary; the report so far is "
              f"{paths['markdown']}. Continue with the same command: {_same_command()}", file=sys.stderr)
        raise SystemExit(128 + stop.signum)
    if counts[STATUS_FAILED]:
        again = "the same command" if retry_failed else "the same command with --retry_failed true"
        raise SystemExit(f"moh sweep: {counts[STATUS_FAILED]} of {len(results)} trials failed; {paths['markdown']} "
                         f"gives each one's error, {out_dir / EXPERIMENT}/<trial>/{ERROR_FILE} its traceback; "
                         f"{again} runs only the failed and unfinished trials again: {_same_command()}")
    print(f"moh sweep: {counts[STATUS_FINISHED]} finished, {counts[STATUS_FAILED]} failed, "
          f"{counts[STATUS_UNFINISHED]} unfinished of {len(results)} trials; {paths['markdown']}", file=sys.stderr)
    return paths["markdown"]


def _same_command() -> str:
    """The command line that started this sweep, to repeat it; in words when it was not `moh` (a test, Python)."""
    if Path(sys.argv[0]).name == "moh":
        return shlex.join(["moh", *sys.argv[1:]])
    return "`moh sweep` with the same arguments"
