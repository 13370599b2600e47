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
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from jsonargparse.typing import NonNegativeFloat, PositiveInt
from lightning.pytorch import Callback
from ray import tune

from moh_lightning import lightning_compat as compat
from moh_lightning.cli import main
from moh_lightning.configs import resolve_config
from moh_lightning.sweep_report import (
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_UNFINISHED,
    TrialResult,
    format_value,
    short_keys,
    write_report,
)

SPEC_FILE = "sweep.json"     # in <out>: what was swept, so a restart with other settings is refused
EXPERIMENT = "tune"          # Tune's experiment folder in <out>
RUNS = "runs"                # the trials' moh fit run folders in <out>
DONE_FILE = "sweep_result.json"  # in runs/<trial>/: the trial's final metrics, written when its fit returned
STOP_FILE = "stop"            # in <out> while a stop signal asks the trials to stop
STOPPED_FILE = "stopped"      # in runs/<trial>/: the trial saved at a step boundary and waits for the sweep to end
_SAME_REQUEST_S = 1.0         # a second signal this soon is the same Ctrl-C reaching the process again
# The local Ray's token: one per process, as Ray keeps the first token it read for the process's life.
_RAY_TOKEN = secrets.token_hex(32)

# Environment of the sweep's driver while it runs (restored afterwards): no usage-stats upload, Tune's automatic
# loggers without the TensorBoard one (the trials' own runs hold the TensorBoard events), and the stop signals left
# to the sweep (Tune's own Ctrl-C handler ends the loop before the trials have saved).
_DRIVER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
               "TUNE_DISABLE_SIGINT_HANDLER": "1"}


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
    `callback_metrics` when fit returns: the last value logged of each) are reported to Tune. A failed trial is
    reported with its error and the others go on. Killed or interrupted, the same command continues the sweep
    from Tune's state in `<out>/tune`: finished trials are not run again, unfinished ones continue from their
    newest checkpoint (`--ckpt_path last`) and failed ones run again when `retry_failed`. When nothing is left
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
    base = _baseline_index(cells, shown, baseline)
    out_dir = Path(out if out is not None else Path("sweeps") / config_path.stem).resolve()
    names = trial_names(shown, seeds)
    trials = [{"name": names[c, s], "cell": c, "seed": seed, "overrides": cell}
              for c, cell in enumerate(cells) for s, seed in enumerate(seeds)]
    _check_spec(out_dir, {"fit_config": str(config_path), "grid": grid or {},
                          "seeds": seeds, "extra_args": list(extra_args)})

    try:
        with _environ(_DRIVER_ENV), _ray_temp_folder() as ray_folder, _StopSignals(out_dir) as stop:
            results = _run_on_tune(trials, config_path, out_dir, address, max_concurrent, cpus_per_trial,
                                   gpus_per_trial, retry_failed, reuse_workers, list(extra_args), ray_folder)
    except _EndNow as end:  # Ray was shut down on the way out, with the trials' processes
        print(f"moh sweep: a second {signal.Signals(end.signum).name} ended the sweep at once; each trial continues "
              f"from its newest checkpoint with the same command: {_same_command()}", file=sys.stderr)
        raise SystemExit(128 + end.signum) from None
    paths = write_report(out_dir, results, shown, seeds, metric, mode, base, title=config_path.name)
    counts = {s: sum(r.status == s for r in results) for s in (STATUS_FINISHED, STATUS_FAILED, STATUS_UNFINISHED)}
    for r in results:
        if r.status == STATUS_FAILED:
            print(f"moh sweep: trial {r.name} failed: {r.error}", file=sys.stderr)
    if stop.signum:
        # The exit code of a process the signal ended (143, 130), as `moh fit` stops; one line on how to go on.
        print(f"moh sweep: stopped by {signal.Signals(stop.signum).name}: {counts[STATUS_FINISHED]} of "
              f"{len(results)} trials finished, the running ones saved at a step boundary; the report so far is "
              f"{paths['markdown']}. Continue with the same command: {_same_command()}", file=sys.stderr)
        raise SystemExit(128 + stop.signum)
    print(f"moh sweep: {counts[STATUS_FINISHED]} finished, {counts[STATUS_FAILED]} failed, "
          f"{counts[STATUS_UNFINISHED]} unfinished of {len(results)} trials; {paths['markdown']}", file=sys.stderr)
    return paths["markdown"]


def _same_command() -> str:
    """The command line that started this sweep, to repeat it; in words when it was not `moh` (a test, Python)."""
    if Path(sys.argv[0]).name == "moh":
        return shlex.join(["moh", *sys.argv[1:]])
    return "`moh sweep` with the same arguments"


# ----------------------------------------------------------------------------------------------- stopping

class _StopSignals:
    """The sweep's handlers of SIGTERM and Ctrl-C while it runs (the main thread's, restored afterwards).

    The first signal writes ``<out>/stop``, which every trial's ``StopWhenAsked`` reads after each step;
    ``_EndOnceSaved`` then ends Tune's loop. A second one, a second or more later, ends the sweep at once.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / STOP_FILE
        self.signum: int | None = None
        self.heard_at = 0.0
        self._kept: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        self.path.unlink(missing_ok=True)  # a stop file left by a sweep that was killed
        if threading.current_thread() is threading.main_thread():
            self._kept = {signum: signal.signal(signum, self._heard) for signum in (signal.SIGTERM, signal.SIGINT)
                          if signal.getsignal(signum) != signal.SIG_IGN}
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._kept.items():
            signal.signal(signum, handler)
        self.path.unlink(missing_ok=True)

    def _heard(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum, self.heard_at = signum, time.monotonic()
            self.path.write_text(signal.Signals(signum).name)
            print(f"moh sweep: {signal.Signals(signum).name}: every running trial stops at its next step boundary "
                  f"with its checkpoint; a second signal ends the sweep at once.", file=sys.stderr, flush=True)
        elif time.monotonic() - self.heard_at >= _SAME_REQUEST_S:
            raise _EndNow(signum)


class _EndNow(BaseException):
    """A second stop signal: leaves Tune's loop at once (Ray is shut down on the way out)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopWhenAsked(Callback):
    """A trial's callback: stops its fit at the end of the step during which ``<out>/stop`` appeared, as SIGTERM
    stops ``moh fit`` (``StepCheckpoint`` saves ``last.ckpt`` there). First among the callbacks, so that the
    checkpoint callbacks, which Lightning runs last, see the request in the same step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.path.exists():  # a stat per step: microseconds
            compat.request_stop(trainer)


# ----------------------------------------------------------------------------------------------- the grid

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


def _baseline_index(cells: list[dict[str, Any]], shown: list[dict[str, Any]], baseline: dict[str, Any] | None) -> int:
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


def _check_spec(out_dir: Path, spec: dict[str, Any]) -> None:
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


# ----------------------------------------------------------------------------------------------- Ray Tune

@contextlib.contextmanager
def _environ(values: dict[str, str], override: bool = False) -> Iterator[None]:
    """Sets environment variables (those not set already, unless ``override``), and restores the environment
    afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if override:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tune_callbacks() -> list:
    """Tune callbacks of the run besides the JSON / CSV loggers (a seam for tests that interrupt a sweep)."""
    return []


class _EndOnceSaved(tune.Callback):
    """Ends Tune's loop once a stop was asked (``<out>/stop``) and every running trial has saved and said so.

    By Tune's own interruption (SIGUSR1, which Tune always handles): the loop ends, Tune saves its state with the
    stopped trials unfinished, and the same command continues them. Kept with Tune's state, so it holds paths only.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = str(out_dir)
        self._sent = False

    def __getstate__(self) -> dict:
        return {"out_dir": self.out_dir}

    def __setstate__(self, state: dict) -> None:
        self.out_dir, self._sent = state["out_dir"], False

    def on_step_end(self, iteration, trials, **info) -> None:
        out = Path(self.out_dir)
        if self._sent or not (out / STOP_FILE).exists():
            return
        running = [trial for trial in trials if trial.status == "RUNNING"]
        if all((out / RUNS / _trial_name(trial) / STOPPED_FILE).exists() for trial in running):
            self._sent = True
            os.kill(os.getpid(), signal.SIGUSR1)


@contextlib.contextmanager
def _ray_temp_folder() -> Iterator[str]:
    """A temporary folder for what Ray and Tune write outside ``--out`` (a local Ray's session files, which Ray keeps
    in /tmp/ray for every session, Tune's lock files), removed when the sweep ends, however it ends. It is also the
    local Ray processes' TMPDIR: a trial's process is killed when the sweep ends, and what it made there (wandb's
    folders, which timm's import of wandb creates) would outlive it."""
    # A local Ray's sockets live below it (<folder>/session_<date>_<pid>/sockets/plasma_store), and a socket's path
    # has at most 107 bytes: /tmp where the temporary folder's own path is too long for that.
    folder = tempfile.mkdtemp(prefix="moh-ray-", dir=None if len(tempfile.gettempdir()) <= 40 else "/tmp")
    try:
        with _environ({"RAY_TMPDIR": folder}), _environ({"TMPDIR": folder}, override=True):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _local_ray(cores: int, folder: str) -> Iterator[None]:
    """A Ray of this machine for the sweep's time, its session files in ``folder``, with token authentication by a
    token of this process's own, in the environment its processes inherit (readable by this user only) rather than a
    ~/.ray/auth_token file."""
    import ray
    from ray._raylet import Config

    try:
        with _environ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": _RAY_TOKEN}):
            # Ray reads its authentication mode into its config when imported; re-read here, as Ray's own switch to
            # token mode does (authentication_token_setup._enable_token_auth), and again once the variables are gone.
            Config.initialize("")
            ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False,
                     logging_level="WARNING", _temp_dir=folder)
            yield
    finally:
        ray.shutdown()
        Config.initialize("")


def _trial_name(trial) -> str:
    return trial.config["trial"]["name"]


def _run_on_tune(trials: list[dict], config_path: Path, out_dir: Path, address: str | None, max_concurrent: int,
                 cpus_per_trial: int | None, gpus_per_trial: float, retry_failed: bool, reuse_workers: bool,
                 extra_args: list[str], ray_folder: str) -> list[TrialResult]:
    import ray

    experiment = out_dir / EXPERIMENT
    restore = tune.Tuner.can_restore(experiment)
    if restore:
        settled = _settled(experiment, trials, retry_failed)
        if settled is not None:  # nothing left to run: the report straight from Tune's saved state, no Ray
            return settled
    with contextlib.ExitStack() as ray_session:
        if address and not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            ray_session.callback(ray.shutdown)
        elif not ray.is_initialized():
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            ray_session.enter_context(_local_ray(cores, ray_folder))
        return _fit_on_tune(trials, config_path, out_dir, max_concurrent, cpus_per_trial, gpus_per_trial,
                            retry_failed, reuse_workers, extra_args, restore)


def _fit_on_tune(trials: list[dict], config_path: Path, out_dir: Path, max_concurrent: int,
                 cpus_per_trial: int | None, gpus_per_trial: float, retry_failed: bool, reuse_workers: bool,
                 extra_args: list[str], restore: bool) -> list[TrialResult]:
    """Tune's run of the trials on the Ray this process is connected to."""
    import ray
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    if cpus_per_trial is None:
        node_cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        cpus_per_trial = max(1, int(min(c for c in node_cpus if c > 0) // max_concurrent))
    trainable = tune.with_resources(
        tune.with_parameters(_trainable, fit_config=str(config_path), runs=str(out_dir / RUNS),
                             stop_file=str(out_dir / STOP_FILE), cwd=os.getcwd(), extra_args=extra_args,
                             threads=cpus_per_trial),
        {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    experiment = out_dir / EXPERIMENT
    if restore:
        # Resumed, not restarted: a restarted trial is a new Tune trial in a new folder (`<trial>_1a2b`), whose
        # result would not be found by name. The trainable itself continues from the run's last checkpoint.
        tuner = tune.Tuner.restore(str(experiment), trainable=trainable, resume_unfinished=True,
                                   resume_errored=retry_failed)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search(
                [{"name": t["name"], "cell": t["cell"], "seed": t["seed"], "overrides": t["overrides"]}
                 for t in trials])},
            tune_config=tune.TuneConfig(max_concurrent_trials=max_concurrent, reuse_actors=reuse_workers,
                                        trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
            run_config=tune.RunConfig(
                name=EXPERIMENT, storage_path=str(out_dir),
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                callbacks=[JsonLoggerCallback(), CSVLoggerCallback(), _EndOnceSaved(out_dir), *_tune_callbacks()]))
    # By folder (named after the trial): a restored trial that failed without reporting has no config here.
    found = {Path(r.path).name: (r.error, r.metrics) for r in tuner.fit() if r.path}
    return [_trial_result(t, *found.get(t["name"], (None, None))) for t in trials]


def _settled(experiment: Path, trials: list[dict], retry_failed: bool) -> list[TrialResult] | None:
    """Every trial's result from Tune's saved state if a restore would run none of them; None otherwise."""
    from ray.tune import ExperimentAnalysis

    quiet = logging.getLogger("ray.tune.analysis.experiment_analysis")  # warns of trials without result files
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        saved = {Path(t.path).name: t for t in ExperimentAnalysis(str(experiment)).trials if t.path}
    except Exception:  # let Tuner.restore deal with (and report) a state it cannot read
        return None
    finally:
        quiet.setLevel(level)
    if set(saved) != {t["name"] for t in trials}:  # not all trials created yet
        return None
    out = []
    for trial in trials:
        state = saved[trial["name"]]
        if state.status == "TERMINATED":
            out.append(_trial_result(trial, None, state.last_result))
        elif state.status == "ERROR" and not retry_failed:
            error = state.get_pickled_error() or state.get_error() or RuntimeError(f"failed; see {state.path}")
            out.append(_trial_result(trial, error, state.last_result))
        else:
            return None
    return out


def _trial_result(trial: dict, error: BaseException | None, reported: dict | None) -> TrialResult:
    out = TrialResult(name=trial["name"], cell=trial["cell"], seed=trial["seed"])
    if error is not None:
        out.status, out.error = STATUS_FAILED, _error_text(error)
    elif isinstance((reported or {}).get("metrics"), dict):
        out.status = STATUS_FINISHED
        out.metrics = {k: float(v) for k, v in reported["metrics"].items()}
        out.run_dir = reported.get("run_dir")
        out.node = reported.get("node")
    return out


def _error_text(error: BaseException) -> str:
    """The trial's own exception as one line (``Type: message``) out of Ray's wrapped traceback."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    text = str(error).strip()
    if "Traceback" in text:  # a RayTaskError's text: the last line is the original exception
        text = [line for line in text.splitlines() if line.strip()][-1].strip()
        return text
    return f"{type(error).__name__}: {' '.join(text.split())}"


# ----------------------------------------------------------------------------------------------- one trial

def fit_args(fit_config: str, extra_args: Sequence[str], overrides: dict[str, Any], seed: int, runs: str,
             name: str) -> list[str]:
    """The ``moh fit`` arguments of one trial; ``--ckpt_path last`` continues it when it was started before."""
    args = ["fit", "--config", fit_config, *extra_args]
    for key, value in overrides.items():
        args += [f"--{key}", cli_value(value)]
    return args + ["--seed_everything", str(seed), "--trainer.logger.init_args.save_dir", runs,
                   "--trainer.logger.init_args.name", name, "--ckpt_path", "last"]


@contextlib.contextmanager
def _capture_trainer(stop_file: Path) -> Iterator[list]:
    """The Trainer of the ``moh fit`` that ``moh_lightning.cli.main`` runs inside this block, once fit returned; the
    fit stops when ``stop_file`` appears (``StopWhenAsked``)."""
    from moh_lightning import cli

    captured: list = []
    original = cli.MoHLightningCLI

    class Capturing(original):
        def before_fit(self) -> None:
            self.trainer.callbacks.insert(0, StopWhenAsked(stop_file))

        def after_fit(self) -> None:
            captured.append(self.trainer)

    cli.MoHLightningCLI = Capturing
    try:
        yield captured
    finally:
        cli.MoHLightningCLI = original


def _trainable(config: dict, fit_config: str, runs: str, stop_file: str, cwd: str, extra_args: list[str],
               threads: int) -> None:
    """Ray Tune trainable: one ``moh fit`` run in this process; reports its final metrics."""
    import ray

    trial = config["trial"]
    run_root = Path(runs) / trial["name"]
    done, stop = run_root / DONE_FILE, Path(stop_file)
    (run_root / STOPPED_FILE).unlink(missing_ok=True)
    if done.is_file():  # finished before an interruption that Tune's saved state had not caught up with
        tune.report(json.loads(done.read_text()))
        return
    if stop.exists():
        _wait_for_the_end(run_root)
    if os.path.isdir(cwd):  # relative paths in the config mean what they mean for `moh fit` from there
        os.chdir(cwd)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    torch._dynamo.reset()  # a reused worker: the last trial's graphs would count against this one's recompile limit
    args = fit_args(fit_config, extra_args, trial["overrides"], trial["seed"], runs, trial["name"])
    try:
        with _capture_trainer(stop) as captured:
            main(args)
    except SystemExit as exit:  # the CLI's one-line errors; a SystemExit would end the Ray worker instead
        if stop.exists():  # stopped as asked, at a step boundary with its checkpoint
            _wait_for_the_end(run_root)
        message = exit.code if isinstance(exit.code, str) else f"moh fit exited with status {exit.code}"
        raise RuntimeError(message) from None
    if not captured:
        raise RuntimeError(f"moh fit {' '.join(args[1:])} returned without a finished fit")
    trainer = captured[0]
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
               if not isinstance(v, torch.Tensor) or v.numel() == 1}
    report = {"metrics": metrics, "run_dir": trainer.log_dir, "global_step": trainer.global_step,
              "node": ray.util.get_node_ip_address()}
    run_root.mkdir(parents=True, exist_ok=True)
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(done)
    tune.report(report)


def _wait_for_the_end(run_root: Path) -> None:
    """Says that this trial has stopped (``_EndOnceSaved`` waits for every running trial's word), then waits for
    Tune to end the sweep: ending the trial here would make it finished or failed, not unfinished."""
    run_root.mkdir(parents=True, exist_ok=True)
    (run_root / STOPPED_FILE).touch()
    while True:
        time.sleep(1)
