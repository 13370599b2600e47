"""``moh sweep`` on a local Ray: it listens on the loopback address only, keeps its folders to this user, and a sweep
with a failed trial says so in one line and a non-zero exit.

One tiny 2-trial sweep (the embedded MNIST config, 2 steps a trial) runs as a process of its own, in a fresh HOME and
TMPDIR; one of its trials fails (a file stands where its run folder goes). While it runs, the test samples every
listening socket of the sweep's process and its descendants (the driver, the GCS, the raylet, the agents, the
workers) and the mode of every folder in its temporary folder.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import ctrl_c_restored
from sweep_cases import read_csv

from moh_lightning import cli

TRIALS = ["seed=0", "seed=1"]
FAILING = TRIALS[1]
# Short: each trial trains 2 steps, validates on one batch and builds no progress bar.
EXTRA_ARGS = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"]
# Set by pytest and CI; MLflow writes nothing in HOME where it sees one, and the sweep's user has none.
TESTING_VARIABLES = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS")


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _listening(root: psutil.Process) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening socket of ``root`` and its descendants."""
    out = set()
    for process in [root, *root.children(recursive=True)]:
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


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("local_sweep")
    home, tmp = base / "home", Path(tempfile.mkdtemp(dir="/tmp"))  # a short TMPDIR: Ray's sockets go below
    home.mkdir()
    out = base / "sweep"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / FAILING).write_text("not a folder")
    args = ["sweep", "--fit_config", "vit_tiny_mnist_75.yaml", "--seeds", "[0, 1]", "--out", str(out),
            "--cpus_per_trial", "1", "--extra_args", json.dumps(EXTRA_ARGS)]
    env = {key: value for key, value in os.environ.items() if key not in TESTING_VARIABLES}
    env.update(HOME=str(home), TMPDIR=str(tmp), OMP_NUM_THREADS="1")
    sweep = subprocess.Popen([sys.executable, "-m", "moh_lightning.cli", *args], cwd=base, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=ctrl_c_restored)
    listening, modes, root = set(), set(), psutil.Process(sweep.pid)
    deadline = time.monotonic() + 600
    while sweep.poll() is None and time.monotonic() < deadline:
        listening |= _listening(root)
        modes |= set(_folder_modes(tmp).items())
        time.sleep(0.5)
    if sweep.poll() is None:
        os.killpg(sweep.pid, 9)
    stdout, stderr = sweep.communicate(timeout=60)
    left_in_tmp = sorted(p.name for p in tmp.iterdir())
    if not left_in_tmp:
        tmp.rmdir()
    return {"returncode": sweep.returncode, "stdout": stdout, "stderr": stderr, "listening": listening,
            "folder_modes": modes, "out": out, "home": home, "left_in_tmp": left_in_tmp}


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time (test_sweep.py)
def test_a_local_sweep_listens_on_loopback_only_and_keeps_its_folders_to_itself(local_sweep: dict) -> None:
    listening = sorted(local_sweep["listening"])
    print("listening during the sweep:", *(f"{ip}:{port} {name}" for name, ip, port in listening), sep="\n  ")
    names = {name for name, _, _ in listening}
    # The sampling saw the cluster: the GCS, the raylet and a worker.
    assert {"gcs_server", "raylet"} <= names and any(name.startswith("ray::") for name in names), listening
    exposed = [(name, ip, port) for name, ip, port in listening if not _loopback(ip)]
    assert exposed == [], exposed
    # The sweep's temporary folder, Ray's below it, is never open to another user, not even for a moment (Ray makes its
    # own folders writable by everyone).
    assert len({name for name, _ in local_sweep["folder_modes"]}) == 1
    assert {mode for _, mode in local_sweep["folder_modes"]} == {0o700}, local_sweep["folder_modes"]
    # Nothing left outside --out: the temporary folder is gone, and HOME holds only matplotlib's font cache and
    # settings (no ~/.ray, no ~/.config/mlflow/telemetry.json).
    assert local_sweep["left_in_tmp"] == []
    left = [path.relative_to(local_sweep["home"]) for path in local_sweep["home"].rglob("*") if path.is_file()]
    assert all(path.parts[:2] in ((".cache", "matplotlib"), (".config", "matplotlib")) for path in left), left


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time (test_sweep.py)
def test_a_sweep_with_a_failed_trial_exits_non_zero_in_one_line_and_its_report_names_the_cause(
        local_sweep: dict) -> None:
    out, stderr = local_sweep["out"], local_sweep["stderr"]
    assert local_sweep["returncode"] == 1, stderr[-3000:]
    # The terminal holds the suite's own lines only: no Ray traceback, no Tune table.
    lines = [line for line in (stderr + local_sweep["stdout"]).splitlines() if line.strip()]
    assert all(line.startswith("moh sweep: ") for line in lines), "\n".join(lines)
    assert "Traceback" not in stderr
    assert lines[-1].startswith(f"moh sweep: 1 of 2 trials failed; {out / 'results.md'} gives each one's error, "
                                f"{out / 'tune'}/<trial>/error.txt its traceback; the same command runs only the "
                                f"failed and unfinished trials again"), lines
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert [trials[name]["status"] for name in TRIALS] == ["finished", "failed"]
    cause = trials[FAILING]["error"]
    assert "\n" not in cause and FAILING in cause and "Error" in cause, cause
    traceback = Path(trials[FAILING]["traceback"])
    assert traceback == out / "tune" / FAILING / "error.txt"
    assert 'in _trainable\n' in traceback.read_text() and traceback.read_text().rstrip().endswith(cause)
    markdown = (out / "results.md").read_text()
    assert f"| `{FAILING}` | {cause.replace('|', chr(92) + '|')} | `tune/{FAILING}/error.txt` |" in markdown
    assert f"moh sweep: trial {FAILING} failed: {cause}" in lines


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
