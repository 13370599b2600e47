"""``moh sweep --address``: a sweep across a real two-node Ray cluster on this machine, one node killed mid-sweep.

The fixture starts a head node and a worker node on the loopback address 127.0.0.2 with ``ray start``, one CPU each,
every port chosen free; ``moh sweep --address`` runs against them in this process (a driver's own process would only
add the seconds of importing torch and Lightning, and of its exit; the process-level promises, Ctrl-C, exit codes and
a local Ray's footprint, are test_sweep_local.py's). It runs 3 seeds, 2 at a time, so both nodes train. The worker
node's second trial SIGKILLs every process of its node (raylet, agents, itself) at step 3, after its step-2
checkpoint, as a machine lost mid-sweep would. Then:
1. the sweep goes on on the head node: the trials that finished keep their results (the one that finished on the
   lost node included), the interrupted trial is reported as failed and the sweep exits 1;
2. the same command again runs only that trial, which resumes from its step-2 checkpoint;
3. once more, it only rewrites the report, without Ray.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import ray
import yaml
from conftest import pythonpath
from lightning.pytorch import Callback
from ray._raylet import Config
from sweep_cases import FIT_CONFIG, read_csv, run_state, tiny_overlay
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moh_lightning import cli
from moh_lightning.sweep import ray_tune
from moh_lightning.sweep.ray_tune import DONE_FILE

# One Ray cluster at a time (test_sweep_local.py); two nodes and two sweeps take minutes on a loaded machine.
pytestmark = [pytest.mark.server, pytest.mark.xdist_group("ray"), pytest.mark.timeout(900)]

RAY = Path(sys.executable).with_name("ray")
# Loopback, yet an address of its own, so the nodes' IPs differ (Ray takes the head's 127.0.0.1 as the host's address).
WORKER_IP = "127.0.0.2"
STEPS, EVERY = 4, 2  # steps of a trial; a checkpoint every EVERY
KILL_STEP = 3  # after the first checkpoint


class LoseNode(Callback):
    """Makes a sweep lose the Ray node ``node_ip`` in the middle of its second trial there.

    On that node, after step ``step`` of a trial when another trial already finished there: writes ``marker`` and
    SIGKILLs every process of the node (the raylet, its agents, this trial), as a machine lost mid-sweep. On any
    other node a trial waits at its start until ``marker`` exists, so that node cannot take all the trials first.
    """

    def __init__(self, node_ip: str, step: int, marker: str) -> None:
        self.node_ip = node_ip
        self.step = step
        self.marker = Path(marker)

    def on_train_start(self, trainer, pl_module) -> None:
        deadline = time.monotonic() + 120
        while ray.util.get_node_ip_address() != self.node_ip and not self.marker.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node_ip} was not lost within 120 s")
            time.sleep(0.1)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != self.step or ray.util.get_node_ip_address() != self.node_ip:
            return
        done = Path(trainer.logger.save_dir).glob(f"*/{DONE_FILE}")
        if any(json.loads(path.read_text()).get("node") == self.node_ip for path in done):
            self.marker.touch()
            # Ray starts its workers in process groups of their own: the raylet's group holds the rest of the node.
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Cluster:
    address: str
    worker: subprocess.Popen


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every interface now (held open together, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def start_node(temp: Path, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``ray start --block`` in a session of its own (so the test can kill the whole node), once it is up."""
    # Every port of the node chosen here, so neither node takes Ray's fixed defaults (10001, 8265, 52365, ...).
    ports = dict(zip(["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                      "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"],
                     free_ports(6), strict=True))
    log = temp / f"{name}.log"
    with log.open("w") as out:
        node = subprocess.Popen(
            [str(RAY), "start", "--block", "--temp-dir", str(temp), "--num-cpus", "1", "--disable-usage-stats",
             "--min-worker-port", "0", "--max-worker-port", "0", *[str(x) for kv in ports.items() for x in kv], *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while "Ray runtime started" not in log.read_text():
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start of the {name} node failed (exit {node.poll()}):\n{log.read_text()}")
        time.sleep(0.2)
    return node


def stop_node(node: subprocess.Popen) -> None:
    """Kills the node's session: ``ray start``, the raylet and the node's other processes, and their workers."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(node.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)
    node.wait(timeout=30)


@pytest.fixture
def ray_cluster() -> Iterator[Cluster]:
    """A head node and a worker node on this machine, isolated from any other Ray here, stopped on teardown; this
    process's Ray set to drive it."""
    if not RAY.is_file():
        pytest.skip(f"no `ray` command next to {sys.executable} (ray[tune] installs it)")
    # Short: Ray's socket paths under it must stay within the 107 bytes of a Unix socket name.
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    # For the nodes and this process's driver alike: left unset, a head turns token authentication on when
    # ~/.ray/auth_token exists (any local Ray writes one), while a worker or driver given the address does not, and
    # is refused. This process's Ray read it when imported; Config.initialize reads it again, here and afterwards.
    auth = {"RAY_AUTH_MODE": "disabled"}
    env = {**os.environ, **auth, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           # The trials import LoseNode from this file, as a cluster's nodes import the suite.
           "PYTHONPATH": pythonpath(__file__),
           # The head declares a silent node dead after 1.5 s instead of Ray's 15 s, so the test stays short.
           "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
           # No idle workers for a first driver: the trials run in workers of their own runtime environment.
           "RAY_prestart_worker_first_driver": "0"}
    nodes = []
    try:
        port, client, dashboard = free_ports(3)
        nodes.append(start_node(temp, "head", [
            "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--ray-client-server-port", str(client),
            "--include-dashboard", "false", "--dashboard-port", str(dashboard)], env))
        address = f"127.0.0.1:{port}"
        nodes.append(start_node(temp, "worker", ["--address", address, "--node-ip-address", WORKER_IP], env))
        with ray_tune.environ(auth, override=True):
            Config.initialize("")
            yield Cluster(address, worker=nodes[1])
    finally:
        Config.initialize("")
        for node in nodes:
            stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)


def logged_steps(run: Path, tag: str) -> list[int]:
    return [event.step for event in EventAccumulator(str(run)).Reload().Scalars(tag)]


def moh_sweep(args: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """`moh sweep` with ``args`` in this process, as the ``moh`` command runs it: the line it exits with, if any."""
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).with_name("moh")), *args])
    usr1 = signal.getsignal(signal.SIGUSR1)  # Tune's, which it leaves set
    try:
        cli.main(args)
    except SystemExit as exit:
        return exit.code
    finally:
        signal.signal(signal.SIGUSR1, usr1)
    return None


def test_sweep_across_two_nodes_survives_losing_one(ray_cluster: Cluster, run_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    overlay = run_dir / "tiny.yaml"
    overlay.write_text(yaml.safe_dump(tiny_overlay(run_dir, STEPS, EVERY)))
    out = run_dir / "sweep"
    args = ["sweep", "--fit_config", FIT_CONFIG, "--seeds", "[0, 1, 2]", "--out", str(out),
            "--address", ray_cluster.address, "--max_concurrent", "2", "--reuse_workers", "true",
            "--extra_args", json.dumps([
                "--config", str(overlay),
                "--trainer.callbacks+=test_sweep_cluster.LoseNode", f"--trainer.callbacks.node_ip={WORKER_IP}",
                f"--trainer.callbacks.step={KILL_STEP}", f"--trainer.callbacks.marker={run_dir / 'node_lost'}"])]
    names = [f"seed={seed}" for seed in range(3)]

    # 1. The worker node dies in its second trial; the head node finishes the sweep's other trials, and the sweep
    # exits 1 with a line saying how to run the lost trial again.
    said = moh_sweep(args, monkeypatch)
    assert isinstance(said, str), said  # a one-line error: exit status 1
    assert said.startswith("moh sweep: 1 of 3 trials failed;") and said.endswith(shlex.join(["moh", *args])), said
    assert ray_cluster.worker.wait(timeout=30) is not None  # `ray start --block` went down with its node
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert list(trials) == names
    lost = [name for name in names if trials[name]["status"] != "finished"]
    assert len(lost) == 1 and trials[lost[0]]["status"] == "failed" and trials[lost[0]]["error"], trials
    finished = [name for name in names if name not in lost]
    nodes = {trials[name]["node"] for name in finished}
    assert len(nodes) == 2 and WORKER_IP in nodes, nodes
    (head_ip,) = nodes - {WORKER_IP}
    for name in finished:
        assert Path(trials[name]["run_dir"]) == out / "runs" / name / "version_0"
        assert json.loads((out / "runs" / name / DONE_FILE).read_text())["node"] == trials[name]["node"]
    checkpoint = out / "runs" / lost[0] / "version_0" / "checkpoints" / f"step={EVERY:07d}.ckpt"
    checkpoint_written = checkpoint.stat().st_mtime_ns
    done = {name: run_state(out / "runs" / name) for name in finished}

    # 2. The same command, on what is left of the cluster: the lost trial resumes from its last checkpoint.
    assert moh_sweep(args, monkeypatch) is None
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert [trials[name]["status"] for name in names] == ["finished"] * 3
    assert {name: run_state(out / "runs" / name) for name in finished} == done
    assert trials[lost[0]]["node"] == head_ip
    assert checkpoint.stat().st_mtime_ns == checkpoint_written  # resumed from it, not redone
    resumed = max(Path(trials[lost[0]]["run_dir"]).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    assert min(logged_steps(resumed, "train/loss")) >= EVERY
    assert json.loads((out / "runs" / lost[0] / DONE_FILE).read_text())["global_step"] == STEPS

    # 3. Once more: Tune's saved state knows the resumed trial as finished, so nothing runs and Ray is not asked.
    report = (out / "trials.csv").read_text()
    (out / "trials.csv").unlink()
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("the finished sweep started Ray"))
    cli.main(args)
    assert (out / "trials.csv").read_text() == report
