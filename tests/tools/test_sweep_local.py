"""``moh sweep`` on a local Ray, as a process: stopped by Ctrl-C and continued exactly, one failed trial said in one
line and a non-zero exit, listening on the loopback address only, its folders kept to this user, nothing left
outside its folder.

One tiny sweep of 3 trials (the embedded LM made tiny, 6 steps each, a checkpoint every 2) runs twice as a process of
its own, in a fresh HOME and TMPDIR, each call starting its own local Ray:
1. Ctrl-C (SIGINT to the sweep's process group) during the second trial, after its first checkpoint: exit 130
   (``HoldForCtrlC`` holds that trial there until the sweep heard it, so that it cannot end first, however fast);
2. the same command: the stopped trial continues to where an uninterrupted one ends; the third trial fails (a file
   stands where its run folder goes), the sweep reports it and exits 1. The finished trial is not trained again.
While each runs, the test samples every listening socket of the sweep's process and its descendants (the driver, the
GCS, the raylet, the agents, the workers) and the mode of every folder in its temporary folder. The trials' grid key
(how many checkpoints are kept) leaves their training the same. A third call in this process, without retrying the
failed trial and with another metric, only rewrites the report, without Ray.
"""
from __future__ import annotations

import contextlib
import csv
import io
import ipaddress
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch
import yaml
from conftest import ctrl_c_restored, pythonpath
from lightning.pytorch import Callback
from sweep_cases import FIT_CONFIG, read_csv, run_state, tiny_overlay

from moh_lightning import cli
from moh_lightning.sweep.stopping import STOP_FILE


def on_the_local_sweep(test):
    """A test of the one local sweep below: a server test, run where the other Ray cluster is not (one at a time)."""
    return pytest.mark.server(pytest.mark.xdist_group("ray")(pytest.mark.timeout(900)(test)))


UNINTERRUPTED, STOPPED, FAILING = TRIALS = ["keep=3-seed=0", "keep=4-seed=0", "keep=5-seed=0"]
STEPS, EVERY = 6, 2  # steps of a trial; a checkpoint every EVERY
# Set by pytest and CI; MLflow writes nothing in HOME where it sees one, and the sweep's user has none.
TESTING_VARIABLES = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS")


class HoldForCtrlC(Callback):
    """Holds the trial ``trial`` before the step after its step-``step`` checkpoint until the sweep was asked to stop
    (``stop_file`` exists), so that the Ctrl-C the test sends once it sees that checkpoint finds the trial running."""

    def __init__(self, trial: str, step: int, stop_file: str) -> None:
        self.trial, self.step, self.stop_file = trial, step, Path(stop_file)

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.logger.name != self.trial or trainer.global_step != self.step:
            return
        deadline = time.monotonic() + 300
        while not self.stop_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stop asked within 300 s of the step-{self.step} checkpoint")
            time.sleep(0.05)


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _processes(root: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [root, *root.children(recursive=True)]
    return []


def _listening(processes: list[psutil.Process]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening socket of ``processes``."""
    out = set()
    for process in processes:
        try:
            command = process.cmdline()
            name = Path(command[0]).name if command else process.name()  # gcs_server, raylet, ray::IDLE, python
            sockets = process.net_connections(kind="inet")
        except psutil.Error:  # ended meanwhile
            continue
        out |= {(name, s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN}
    return out


def _folder_modes(tmp: Path) -> dict[str, int]:
    """The mode of each temporary folder of a sweep in ``tmp`` now."""
    out = {}
    for path in tmp.glob("moh-ray-*"):
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
            out[path.name] = stat.S_IMODE(path.lstat().st_mode)
    return out


def _checkpoints(run: Path) -> list[Path]:
    return [path for path in run.glob("version_*/checkpoints/*.ckpt") if path.name != "last.ckpt"]


def _alive(processes: dict[int, psutil.Process]) -> list[str]:
    """Those of ``processes`` still running, waiting up to 15 s for them to end."""
    deadline = time.monotonic() + 15
    while True:
        left = [p for p in processes.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return [" ".join(p.cmdline()[:2]) for p in left]
        time.sleep(0.5)


def _run(args: list[str], cwd: Path, env: dict, tmp: Path, home: Path, stop_when=None) -> dict:
    """``moh sweep`` as a process, sampled while it runs; SIGINT to its process group once ``stop_when()``."""
    sessions = set(Path("/tmp/ray").glob("session_*"))
    sweep = subprocess.Popen([sys.executable, "-m", "moh_lightning.cli", *args], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=ctrl_c_restored)
    root = psutil.Process(sweep.pid)
    listening, modes, seen, stopped = set(), [], {}, False
    deadline, sampled = time.monotonic() + 420, 0.0
    while sweep.poll() is None and time.monotonic() < deadline:
        if stop_when is not None and not stopped and stop_when():
            os.killpg(sweep.pid, signal.SIGINT)
            stopped = True
        if time.monotonic() - sampled > 0.5:
            processes = _processes(root)
            seen.update((p.pid, p) for p in processes[1:])
            listening |= _listening(processes)
            modes.append(_folder_modes(tmp))
            sampled = time.monotonic()
        time.sleep(0.1)
    if sweep.poll() is None:
        os.killpg(sweep.pid, signal.SIGKILL)
    stdout, stderr = sweep.communicate(timeout=60)
    home_files = [path.relative_to(home) for path in home.rglob("*") if path.is_file()]
    return {"returncode": sweep.returncode, "stdout": stdout, "stderr": stderr, "listening": listening,
            "folder_modes": modes, "left_running": _alive(seen), "seen": len(seen), "home": home_files,
            "left_in_tmp": sorted(p.name for p in tmp.iterdir()),
            "new_ray_sessions": set(Path("/tmp/ray").glob("session_*")) - sessions}


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("local_sweep")
    home, tmp = base / "home", Path(tempfile.mkdtemp(dir="/tmp"))  # a short TMPDIR: Ray's sockets go below
    home.mkdir()
    overlay = base / "tiny.yaml"
    overlay.write_text(yaml.safe_dump(tiny_overlay(base, STEPS, EVERY)))
    out = base / "sweep"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / FAILING).write_text("not a folder")
    args = ["sweep", "--fit_config", FIT_CONFIG, "--grid", json.dumps({"checkpoint.keep": [3, 4, 5]}),
            "--seeds", "[0]", "--out", str(out), "--cpus_per_trial", "1", "--reuse_workers", "true",
            "--extra_args", json.dumps([
                "--config", str(overlay), "--trainer.callbacks+=test_sweep_local.HoldForCtrlC",
                f"--trainer.callbacks.trial={STOPPED}", f"--trainer.callbacks.step={EVERY}",
                f"--trainer.callbacks.stop_file={out / STOP_FILE}"])]
    env = {key: value for key, value in os.environ.items() if key not in TESTING_VARIABLES}
    # PYTHONPATH: the trials import HoldForCtrlC from this file.
    env.update(HOME=str(home), TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(__file__))
    runs = out / "runs"
    stopped = _run(args, base, env, tmp, home, stop_when=lambda: bool(_checkpoints(runs / STOPPED)))
    stopped["step"] = torch.load(runs / STOPPED / "version_0/checkpoints/last.ckpt", weights_only=False)["global_step"]
    stopped["stop_file"] = (out / STOP_FILE).exists()
    stopped["uninterrupted_run"] = run_state(runs / UNINTERRUPTED)
    again = _run(args, base, env, tmp, home)
    again["report"] = {name: (out / name).read_text() for name in ("trials.csv", "results.md")}
    if not again["left_in_tmp"]:
        tmp.rmdir()
    return {"stopped": stopped, "again": again, "out": out, "args": args}


@on_the_local_sweep
@pytest.mark.parametrize("call", ["stopped", "again"])
def test_a_local_sweep_listens_on_loopback_only_keeps_its_folders_to_itself_and_leaves_nothing_outside(
        local_sweep: dict, call: str) -> None:
    run = local_sweep[call]
    listening = sorted(run["listening"])
    print("listening during the sweep:", *(f"{ip}:{port} {name}" for name, ip, port in listening), sep="\n  ")
    names = {name for name, _, _ in listening}
    # The sampling saw the cluster: the GCS, the raylet and a worker.
    assert {"gcs_server", "raylet"} <= names and any(name.startswith("ray::") for name in names), listening
    exposed = [(name, ip, port) for name, ip, port in listening if not _loopback(ip)]
    assert exposed == [], exposed
    # The sweep's temporary folder, Ray's below it, is never open to another user, not even for a moment (Ray makes its
    # own folders writable by everyone).
    modes = {item for sample in run["folder_modes"] for item in sample.items()}
    assert len({name for name, _ in modes}) == 1
    assert {mode for _, mode in modes} == {0o700}, modes
    # Nothing left outside --out: no process of the sweep's Ray, no Ray session under /tmp/ray, the temporary folder
    # gone, and HOME holds only matplotlib's font cache and settings (no ~/.ray, no ~/.config/mlflow/telemetry.json).
    assert run["seen"] > 2 and run["left_running"] == []
    assert run["new_ray_sessions"] == set()
    assert run["left_in_tmp"] == []
    assert all(path.parts[:2] in ((".cache", "matplotlib"), (".config", "matplotlib")) for path in run["home"]), \
        run["home"]


@on_the_local_sweep
def test_a_stopped_sweep_saves_its_trials_exits_130_and_continues_exactly(local_sweep: dict) -> None:
    stopped, out = local_sweep["stopped"], local_sweep["out"]
    said = [line for line in stopped["stderr"].splitlines() if line.startswith("moh sweep:")]
    assert stopped["returncode"] == 130, stopped["stderr"][-3000:]
    assert said[-1].startswith("moh sweep: stopped by SIGINT: 1 of 3 trials finished, the running ones saved at a "
                               "step boundary;") and said[-1].endswith("Continue with the same command: `moh sweep` "
                                                                      "with the same arguments"), said
    assert stopped["step"] == EVERY + 1  # the step during which the sweep heard it, after the first checkpoint
    assert not stopped["stop_file"]
    # The same command: the finished trial is not trained again, and the stopped one ends where it would have.
    assert run_state(out / "runs" / UNINTERRUPTED) == stopped["uninterrupted_run"]
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert [trials[name]["status"] for name in TRIALS[:2]] == ["finished", "finished"]
    uninterrupted, resumed = (json.loads((out / "runs" / name / "sweep_result.json").read_text())
                              for name in (UNINTERRUPTED, STOPPED))
    assert resumed["global_step"] == uninterrupted["global_step"] == STEPS
    assert {key: resumed["metrics"][key] for key in ("train/loss", "val/loss")} == \
        {key: uninterrupted["metrics"][key] for key in ("train/loss", "val/loss")}
    for name in TRIALS[:2]:
        assert Path(trials[name]["run_dir"]) == out / "runs" / name / "version_0"


@on_the_local_sweep
def test_a_sweep_with_a_failed_trial_exits_non_zero_in_one_line_and_its_report_names_the_cause(
        local_sweep: dict) -> None:
    run, out = local_sweep["again"], local_sweep["out"]
    assert run["returncode"] == 1, run["stderr"][-3000:]
    # The terminal holds the suite's own lines only: no Ray traceback, no Tune table.
    lines = [line for line in (run["stderr"] + run["stdout"]).splitlines() if line.strip()]
    assert all(line.startswith("moh sweep: ") for line in lines), "\n".join(lines)
    assert "Traceback" not in run["stderr"]
    assert lines[-1].startswith(f"moh sweep: 1 of 3 trials failed; {out / 'results.md'} gives each one's error, "
                                f"{out / 'tune'}/<trial>/error.txt its traceback; the same command runs only the "
                                f"failed and unfinished trials again"), lines
    trials = {row["trial"]: row for row in csv.DictReader(io.StringIO(run["report"]["trials.csv"]))}
    assert list(trials) == TRIALS
    assert [trials[name]["status"] for name in TRIALS] == ["finished", "finished", "failed"]
    cause = trials[FAILING]["error"]
    assert "\n" not in cause and FAILING in cause and "Error" in cause, cause
    traceback = Path(trials[FAILING]["traceback"])
    assert traceback == out / "tune" / FAILING / "error.txt"
    assert 'in _trainable\n' in traceback.read_text() and traceback.read_text().rstrip().endswith(cause)
    markdown = run["report"]["results.md"]
    assert f"| `{FAILING}` | {cause.replace('|', chr(92) + '|')} | `tune/{FAILING}/error.txt` |" in markdown
    assert f"moh sweep: trial {FAILING} failed: {cause}" in lines


@on_the_local_sweep
def test_a_settled_sweep_rewrites_its_report_without_ray_and_refuses_a_different_sweep(
        local_sweep: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    out, args = local_sweep["out"], local_sweep["args"]
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("the settled sweep started Ray"))
    done = {name: run_state(out / "runs" / name) for name in TRIALS[:2]}
    # A different sweep in the same folder is refused before Ray starts.
    grid = args.index("--grid") + 1
    with pytest.raises(SystemExit, match="different sweep"):
        cli.main(args[:grid] + [json.dumps({"checkpoint.keep": [3, 4]})] + args[grid + 1:])
    # The same command without retrying failures, reporting another metric: nothing runs, the report is rewritten.
    with pytest.raises(SystemExit, match=re.escape("1 of 3 trials failed; ") + ".* the same command with "
                                         "--retry_failed true runs only the failed and unfinished"):
        cli.main(args + ["--retry_failed", "false", "--metric", "train/loss", "--mode", "min"])
    assert {name: run_state(out / "runs" / name) for name in TRIALS[:2]} == done
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert [trials[name]["status"] for name in TRIALS] == ["finished", "finished", "failed"]
    assert [c["train/loss n"] for c in read_csv(out / "results.csv")] == ["1", "1", "0"]
    assert "## train/loss" in (out / "results.md").read_text()
    assert (out / "train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_misspelled_grid_key_is_refused_before_ray_starts(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", "--fit_config", "vit_tiny_mnist_75.yaml", "--grid",
            json.dumps({"model.init_args.arch.moh.top_kk": [2]}), "--seeds", "[0]", "--out", str(out)]
    with pytest.raises(SystemExit) as refused:
        cli.main(args)
    assert refused.value.code == ("moh sweep: the cell top_kk=2 cannot run: unknown config key "
                                  "'model.init_args.arch.moh.top_kk': check its spelling and level against `moh fit "
                                  "--config <yaml> --print_config` (keys are not abbreviated).")
    assert not (out / "tune").exists()
