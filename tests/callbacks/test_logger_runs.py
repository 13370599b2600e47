"""Every logger the docs name, through the whole path of a run: ``moh fit``, Ctrl-C or SIGTERM, ``--ckpt_path
last``, ``moh validate`` of its checkpoint. The run goes on in the same logger run, logs no step twice, and keeps its
config, checkpoints and head-load files in its run folder and its logger run. The real libraries: TensorBoard's and
the CSV logger's files, MLflow's default sqlite store and a tracking server on 127.0.0.1, W&B offline."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from faults import wait_until_the_stop_is_heard
from lightning.pytorch import Callback
from moh_process import start_moh
from wandb_records import history

from moh_lightning.cli import main

pytestmark = pytest.mark.slow

NAME = "vit_tiny_mnist_75"
RUN = Path("runs") / NAME / "version_0"
# The embedded ViT shrunk to seconds: 5 steps of 4 batches an epoch, a validation after step 3, a checkpoint every 3,
# a heatmap every step (so that a resumed run that logged one twice is seen). Stopped in step 4, the last of the first
# epoch, the run continues into the next.
ARGS = ["--config", f"{NAME}.yaml", "--trainer.max_steps=5", "--trainer.limit_train_batches=4",
        "--trainer.limit_val_batches=2", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=1",
        "--head_load.images_every_n_windows=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.init_args.arch.depth=1", "--data.init_args.batch_size=16", "--checkpoint.every_n_train_steps=3"]
# The dashboards page's recipes.
LOGGERS = {
    "tensorboard": [],
    "csv": ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"],
    "mlflow": ["--trainer.logger", "lightning.pytorch.loggers.MLFlowLogger"],
    "wandb": ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.init_args.offline",
              "true", "--trainer.logger.init_args.project", "moh"],
}


class PauseInStep4(Callback):
    """Writes ``paused`` when step 4 starts (after the step-3 checkpoint) and waits there, up to 30 s, until the run's
    watchdog has heard a stop signal."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == 3:
            Path("paused").touch()
            wait_until_the_stop_is_heard(trainer, seconds=30)


class StopInStep4(Callback):
    """Sends its own process the signal ``stop`` when step 4 starts (after the step-3 checkpoint), and waits there
    until the run's watchdog has heard it: what a stop from outside does, in this process."""

    def __init__(self, stop: str) -> None:
        self.stop = getattr(signal, stop)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == 3:
            os.kill(os.getpid(), self.stop)
            wait_until_the_stop_is_heard(trainer, seconds=30)


def _fit_and_stop(folder: Path, logger: list[str], stop: str, process: bool = False) -> None:
    """``moh fit`` stopped in step 4 by the signal ``stop`` (SIGINT as Ctrl-C sends it): in this process (the stop's
    path is the same whatever the logger), or once in a process of its own (``process``), a server's run taken up by
    the next process. That process is a fork of this one: a fresh interpreter would spend its first 5-10 s importing
    torch and Lightning again, and the run it starts, stops and leaves behind on the server is the same."""
    code = 143 if stop == "SIGTERM" else 130
    if not process:
        # As a `moh` process restores it: a background job (`bash .ci/run &`) starts with SIGINT ignored, and
        # the run rightly leaves an ignored signal alone.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.raises(SystemExit) as exit_info:
                main(["fit", *ARGS, *logger, "--trainer.callbacks+=test_logger_runs.StopInStep4",
                      f"--trainer.callbacks.stop={stop}"])
        finally:
            signal.signal(signal.SIGINT, previous)
        assert exit_info.value.code == code
        return
    run = start_moh(["fit", *ARGS, *logger, "--trainer.callbacks+=test_logger_runs.PauseInStep4"], Path.cwd(),
                    os.environ, folder / "out.txt", folder / "err.txt")
    deadline = time.monotonic() + 300
    while not (folder / "paused").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(getattr(signal, stop))
    assert run.wait(timeout=120) == code, (folder / "err.txt").read_text()[-3000:]


def _continue_and_validate(logger: list[str], capsys) -> str:
    """``--ckpt_path last`` and a ``moh validate`` of the run's checkpoint; what the resumed fit printed."""
    main(["fit", *ARGS, *logger, "--ckpt_path", "last"])
    printed = capsys.readouterr().out
    _finish_wandb()
    main(["validate", *ARGS, *logger, "--ckpt_path", str(RUN / "checkpoints" / "last.ckpt")])
    _finish_wandb()
    return printed


def _finish_wandb(exit_code: int | None = None) -> None:
    """Ends a W&B run as the end of a ``moh`` process does, with its exit code (its files are complete only then)."""
    import wandb

    if wandb.run is not None:
        wandb.run.finish(exit_code=exit_code)


def _assert_once_each(steps: dict[str, list[int]]) -> None:
    """Every step of the run logged once: train/loss at each of the 5 steps, no metric twice at one step (Lightning
    logs ``epoch`` with each call, so twice where a validation follows a step)."""
    assert sorted(steps["train/loss"]) == list(range(5)), steps["train/loss"]
    twice = {key: [step for step, n in Counter(found).items() if n > 1] for key, found in steps.items()}
    assert not {key: found for key, found in twice.items() if found and key != "epoch"}


def _assert_run_folder(folder: Path, head_load: bool = True) -> None:
    run = folder / RUN
    assert {"config.yaml", "checkpoints", "logged_steps.json"} <= {path.name for path in run.iterdir()}
    assert [path.name for path in run.parent.iterdir()] == ["version_0"]  # continued, and evaluated beside it
    assert (run / "eval" / "validate-last" / "config.yaml").is_file()
    assert (run / "head_load" / "summary.md").is_file() == head_load


@pytest.mark.parametrize(("kind", "stop"), [("tensorboard", "SIGTERM"), ("csv", "SIGINT")])
def test_a_folder_logger_run_continues_in_its_folder_without_a_step_twice(kind, stop, run_dir, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fit_and_stop(run_dir, LOGGERS[kind], stop)
    printed = _continue_and_validate(LOGGERS[kind], capsys)
    _assert_run_folder(run_dir)
    if kind == "csv":
        import csv

        rows = list(csv.DictReader((run_dir / RUN / "metrics.csv").open()))
        steps = {key: [int(row["step"]) for row in rows if row[key]] for key in rows[0] if key != "step"}
        assert steps["val/acc1"] == [2]  # logged before the checkpoint, and kept by the resumed run
        assert f"metrics:     {RUN / 'metrics.csv'}" in printed
    else:
        events = EventAccumulator(str(run_dir / RUN), size_guidance={"scalars": 0, "images": 0}).Reload()
        steps = {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
        assert Counter(event.step for event in events.Images("head_load/heatmap_train")).most_common(1)[0][1] == 1
        assert f"dashboards:  tensorboard --logdir {RUN.parent.parent}" in printed  # beside its siblings
    _assert_once_each(steps)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, _empty_mlflow_store):
    """A local MLflow tracking server on 127.0.0.1, on MLflow's recommended sqlite store, serving its artifacts.

    Without MLflow's job execution (its GenAI jobs): on by default, it starts a job runner and seven huey consumers
    beside the server, eight more processes importing MLflow on the machine the tests share, which took 40 s to end."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    shutil.copyfile(_empty_mlflow_store, folder / "mlflow.db")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([Path(sys.executable).with_name("mlflow"), "server", "--host", "127.0.0.1", "--port",
                               str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                               "--artifacts-destination", str(folder / "artifacts")], cwd=folder,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=open(folder / "server.txt", "w"), stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail(f"the MLflow server did not start: {(folder / 'server.txt').read_text()[-2000:]}")
    yield uri
    server.terminate()
    server.wait(timeout=60)


@pytest.mark.parametrize(("store", "stop"), [
    ("sqlite", "SIGINT"),
    pytest.param("server", "SIGTERM", marks=pytest.mark.server)])
def test_an_mlflow_run_is_continued_with_its_artifacts_and_no_step_twice(store, stop, run_dir, capsys, request,
                                                                         mlflow_uri_unset, mlflow_store):
    from mlflow import MlflowClient

    logger = list(LOGGERS["mlflow"])
    if store == "server":
        uri = request.getfixturevalue("mlflow_server")
        logger += ["--trainer.logger.init_args.tracking_uri", uri]
    else:
        uri = mlflow_store(run_dir / "mlflow.db")  # MLflow's default store, in the working folder
    _fit_and_stop(run_dir, logger, stop, process=store == "server")  # one real server's run across processes
    printed = _continue_and_validate(logger, capsys)
    _assert_run_folder(run_dir)
    client = MlflowClient(uri)
    runs = {run.info.run_name: run for run in client.search_runs(
        [client.get_experiment_by_name("lightning_logs").experiment_id])}
    assert sorted(runs) == [f"{NAME}/version_0", f"{NAME}/version_0/eval/validate-last"]
    run = runs[f"{NAME}/version_0"]
    assert run.info.status == "FINISHED"
    assert runs[f"{NAME}/version_0/eval/validate-last"].data.tags["mlflow.parentRunId"] == run.info.run_id
    _assert_once_each({key: [metric.step for metric in client.get_metric_history(run.info.run_id, key)]
                       for key in run.data.metrics})
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id, "head_load")}
    assert {"head_load/summary.md", "head_load/loads.json", "head_load/loads_over_time.png"} <= artifacts
    images = [artifact.path for artifact in client.list_artifacts(run.info.run_id, "images")
              if artifact.path.endswith(".png") and "heatmap_train" in artifact.path]
    assert sorted(int(path.split("+step+")[1].split("+")[0]) for path in images) == list(range(1, 6))
    page = f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert f"MLflow run:  {NAME}/version_0 ({run.info.run_id})" in printed
    assert (f"{uri}/{page}" if store == "server" else f"http://127.0.0.1:5000/{page}") in printed


def test_a_wandb_offline_run_is_continued_under_its_id_without_a_step_twice(run_dir, capsys):
    _fit_and_stop(run_dir, LOGGERS["wandb"], "SIGINT")
    _finish_wandb(exit_code=130)
    printed = _continue_and_validate(LOGGERS["wandb"], capsys)
    _assert_run_folder(run_dir, head_load=False)  # a W&B run's head_load/ goes with its files
    parts = sorted((run_dir / RUN / "wandb").glob("offline-run-*"))
    assert len(parts) == 2 and len({part.name.rsplit("-", 1)[1] for part in parts}) == 1
    run_id = parts[0].name.rsplit("-", 1)[1]
    rows = [row for part in parts for row in history(part / f"run-{run_id}.wandb")]
    _assert_once_each({key: [row["trainer/global_step"] for row in rows if key in row]
                       for key in {key for row in rows for key in row} if not key.startswith(("_", "trainer/"))})
    assert (parts[-1] / "files" / "head_load" / "summary.md").is_file()
    assert f"W&B run:     {NAME}/version_0 ({run_id}, offline)" in printed
    assert (run_dir / RUN / "eval" / "validate-last" / "wandb").is_dir()
