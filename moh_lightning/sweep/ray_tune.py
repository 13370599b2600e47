"""The sweep on Ray Tune: the Ray it runs on, Tune's run or restore of the trials, and the trainable that is one trial.

Each trial is an ordinary ``moh fit`` run inside a Ray Tune trainable, in its run folder
``<out>/runs/<trial>/version_N/``. Tune's own experiment state in ``<out>/tune`` makes the sweep restartable:
``Tuner.restore`` runs only the trials that have not finished, and when none is left the results come from that state
without starting Ray. A local Ray keeps its session files in a temporary folder removed at exit, and authenticates
with a token held in its processes' environment, never written to ``~/.ray``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ray import tune

from moh_lightning.cli import main
from moh_lightning.sweep.grid import fit_args
from moh_lightning.sweep.report import STATUS_FAILED, STATUS_FINISHED, TrialResult
from moh_lightning.sweep.stopping import STOP_FILE, STOPPED_FILE, StopWhenAsked, wait_for_the_end

EXPERIMENT = "tune"          # Tune's experiment folder in <out>
RUNS = "runs"                # the trials' moh fit run folders in <out>
DONE_FILE = "sweep_result.json"  # in runs/<trial>/: the trial's final metrics, written when its fit returned
# The local Ray's token: one per process, as Ray keeps the first token it read for the process's life.
_RAY_TOKEN = secrets.token_hex(32)

# Environment of the sweep's driver while it runs (restored afterwards): no usage-stats upload, Tune's automatic
# loggers without the TensorBoard one (the trials' own runs hold the TensorBoard events), the stop signals left
# to the sweep (Tune's own Ctrl-C handler ends the loop before the trials have saved), and the terminal left to the
# sweep's own lines: a failed trial's traceback kept in its error.txt rather than printed, and Tune's former output
# engine, which `verbose=0` silences (the newer one prints its tables whatever the verbosity). No MLflow installation
# id in ~/.config/mlflow either: Tune imports MLflow, where installed, to count the callbacks it was given
# (ray.air._internal.usage.tag_callbacks), and MLflow writes one when imported.
DRIVER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
              "TUNE_DISABLE_SIGINT_HANDLER": "1", "TUNE_PRINT_ALL_TRIAL_ERRORS": "0", "RAY_AIR_NEW_OUTPUT": "0",
              "MLFLOW_DISABLE_TELEMETRY": "true"}
# Ray binds its servers (GCS, raylet, object manager, agents, the workers' and the driver's own) to the node's address,
# and on Linux takes the machine's network address for it, even when given 127.0.0.1 (ray.init resolves a loopback
# address to it). Ray's single-machine mode, its default on macOS and Windows, takes the loopback address instead, so
# that a local sweep listens on 127.0.0.1 only: read by ray.init in this process (from Ray's constants, which took the
# environment at Ray's import) and by the processes it starts (from their environment).
_LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
ERROR_FILE = "error.txt"     # in <out>/tune/<trial>/: Tune's record of a failed trial's traceback


@contextlib.contextmanager
def environ(values: dict[str, str], override: bool = False) -> Iterator[None]:
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


def tune_callbacks() -> list:
    """Tune callbacks of the run besides the JSON / CSV loggers (a seam for tests that interrupt a sweep)."""
    return []


class SayTrialEnds(tune.Callback):
    """One line as each trial ends, the sweep's only output while it runs (Tune's own progress tables are off)."""

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        print(f"moh sweep: trial {_trial_name(trial)} finished", file=sys.stderr, flush=True)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        # Tune's error file on this machine (the one in <out>/tune is a copy made later): its last line is the error.
        lines = Path(trial.error_file).read_text().splitlines() if os.path.isfile(trial.error_file or "") else []
        cause = next((line.strip() for line in reversed(lines) if line.strip()), "unknown error")
        print(f"moh sweep: trial {_trial_name(trial)} failed: {cause}", file=sys.stderr, flush=True)


class EndOnceSaved(tune.Callback):
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
def ray_temp_folder() -> Iterator[str]:
    """A temporary folder for what Ray and Tune write outside ``--out`` (a local Ray's session files, which Ray keeps
    in /tmp/ray for every session, Tune's lock files), removed when the sweep ends, however it ends. It is also the
    local Ray processes' TMPDIR: a trial's process is killed when the sweep ends, and what it made there (wandb's
    folders, which timm's import of wandb creates) would outlive it."""
    # A local Ray's sockets live below it (<folder>/ray/session_<date>_<pid>/sockets/plasma_store, 85 bytes from the
    # temporary folder's parent on), and a socket's path has at most 107 bytes: /tmp where the parent's is too long.
    folder = tempfile.mkdtemp(prefix="moh-ray-", dir=None if len(tempfile.gettempdir()) <= 20 else "/tmp")
    try:
        with environ({"RAY_TMPDIR": folder}), environ({"TMPDIR": folder}, override=True):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _local_ray(cores: int, folder: str) -> Iterator[None]:
    """A Ray of this machine for the sweep's time, listening on the loopback address only, its session files in
    ``folder`` (mode 700: no one else may read or plant anything there), with token authentication by a token of this
    process's own, in the environment its processes inherit (readable by this user only) rather than a
    ~/.ray/auth_token file."""
    import ray
    from ray._private import ray_constants
    from ray._raylet import Config

    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    try:
        with environ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": _RAY_TOKEN}), environ(_LOOPBACK_ONLY, override=True):
            ray_constants.ENABLE_RAY_CLUSTER = False
            # Ray reads its authentication mode into its config when imported; re-read here, as Ray's own switch to
            # token mode does (authentication_token_setup._enable_token_auth), and again once the variables are gone.
            Config.initialize("")
            # One level down: Ray makes its temporary folder and the session's folders in it writable by everyone (for
            # several users' sessions in one /tmp/ray), again as each of its processes starts; ``folder`` stays 700, so
            # no one else reaches into them.
            # No idle workers started for the first driver: Tune runs every trial in a worker of the trainable's own
            # runtime environment (its env_vars), never in one of those, which would each import Ray for nothing
            # (a second or two of CPU each, per core, while the sweep starts).
            ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False,
                     logging_level="WARNING", _temp_dir=os.path.join(folder, "ray"),
                     _system_config={"prestart_worker_first_driver": False})
            yield
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
        Config.initialize("")


def _trial_name(trial) -> str:
    return trial.config["trial"]["name"]


def run_on_tune(trials: list[dict], config_path: Path, out_dir: Path, address: str | None, max_concurrent: int,
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
                name=EXPERIMENT, storage_path=str(out_dir), verbose=0,
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                callbacks=[JsonLoggerCallback(), CSVLoggerCallback(), SayTrialEnds(), EndOnceSaved(out_dir),
                           *tune_callbacks()]))
    with _dropped(logging.getLogger("ray.tune.tune"), "Trials did not complete"):  # the sweep's last line says so
        done = tuner.fit()
    # By folder (named after the trial): a restored trial that failed without reporting has no config here.
    found = {Path(r.path).name: (r.error, r.metrics) for r in done if r.path}
    return [_trial_result(t, *found.get(t["name"], (None, None)), experiment) for t in trials]


@contextlib.contextmanager
def _dropped(logger: logging.Logger, prefix: str) -> Iterator[None]:
    """Drops the records of ``logger`` whose message starts with ``prefix`` for the block."""
    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith(prefix)

    drop = Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


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
            out.append(_trial_result(trial, None, state.last_result, experiment))
        elif state.status == "ERROR" and not retry_failed:
            error = state.get_pickled_error() or state.get_error() or RuntimeError(f"failed; see {state.path}")
            out.append(_trial_result(trial, error, state.last_result, experiment))
        else:
            return None
    return out


def _trial_result(trial: dict, error: BaseException | None, reported: dict | None, experiment: Path) -> TrialResult:
    out = TrialResult(name=trial["name"], cell=trial["cell"], seed=trial["seed"])
    if error is not None:
        out.status, out.error = STATUS_FAILED, _error_text(error)
        traceback = experiment / trial["name"] / ERROR_FILE
        out.traceback = str(traceback) if traceback.is_file() else None
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


@contextlib.contextmanager
def _capture_trainer(stop_file: Path) -> Iterator[list]:
    """The Trainer of the ``moh fit`` that ``moh_lightning.cli.main`` runs inside this block, once fit returned; the
    fit stops when ``stop_file`` appears (``StopWhenAsked``)."""
    from moh_lightning import trainer_cli  # main imports the class from there when it runs

    captured: list = []
    original = trainer_cli.MoHLightningCLI

    class Capturing(original):
        def before_fit(self) -> None:
            self.trainer.callbacks.insert(0, StopWhenAsked(stop_file))

        def after_fit(self) -> None:
            captured.append(self.trainer)

    trainer_cli.MoHLightningCLI = Capturing
    try:
        yield captured
    finally:
        trainer_cli.MoHLightningCLI = original


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
        wait_for_the_end(run_root)
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
            wait_for_the_end(run_root)
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
