"""A run ends as a whole: SIGTERM to a run whose rank hangs, a hung rank and no signal, a lost node and its resume.

Each `moh fit` is forked from the test process into a session of its own (each node of the 2-node run in its own; see
tests/moh_process.py for what makes it a fresh `moh`); after each scenario no process of those sessions may remain,
and whatever a failing test leaves is killed by PID. The runs are the exact-resume tests' embedded ViT (one block,
2 loader workers a rank, 7 steps, checkpoints every 3) on 2 gloo processes: forked by Lightning (`ddp_fork`) for the
hung rank, one `moh fit` a node on loopback for the lost node (whose uninterrupted reference is the same 2 ranks
forked in the test process). Rank 1 stops making progress before step 4 (``faults.HangAtStep``), while rank 0 waits
for it in that step's first collective.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from exact_runs import RUN, VIT, assert_same_run, load_checkpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from moh_process import MohProcess, start_moh
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.constants import default_pg_timeout

from moh_lightning.callbacks import RunShutdown, run_store, shutdown, watchdog
from moh_lightning.lightning_compat import collective_timeout

# The `moh fit` runs are marked distributed one by one; the unit tests of the watchdog and the store below are not.
DISTRIBUTED = pytest.mark.distributed

FORKED = ["--trainer.strategy=ddp_fork", "--trainer.devices=2", "--trainer.accelerator=cpu"]
HANG = ["--trainer.callbacks+=faults.HangAtStep", "--trainer.callbacks.step=4"]
LAST = RUN / "version_0" / "checkpoints" / "last.ckpt"
AGAIN = "Continue with the same command and --ckpt_path last."


class Runs:
    """The `moh fit` processes a test starts, each forked from this one as the leader of a session of its own (see
    tests/moh_process.py), and what is left of them."""

    def __init__(self) -> None:
        self.leaders: list[MohProcess] = []

    def start(self, folder: Path, *args: str, env: dict[str, str] | None = None) -> MohProcess:
        folder.mkdir(exist_ok=True)
        n = len(list(folder.glob("err*.txt")))  # err0.txt, err1.txt, ... in the order started in this folder
        process = start_moh(["fit", *VIT, *args], folder, {**os.environ, **(env or {})}, stdout=folder / f"out{n}.txt",
                            stderr=folder / f"err{n}.txt")
        self.leaders.append(process)
        return process

    def left(self) -> list[psutil.Process]:
        """The live processes of the runs' sessions (a zombie has ended; only its parent's exit status is left)."""
        sessions, found = {leader.pid for leader in self.leaders}, []
        for process in psutil.process_iter(["status"]):
            with suppress(psutil.Error, OSError):
                if os.getsid(process.pid) in sessions and process.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(process)
        return found

    def assert_none_left(self, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [(process.pid, process.info["status"]) for process in left]

    def kill_all(self) -> None:
        for process in self.left():
            with suppress(psutil.Error):
                process.kill()


@pytest.fixture
def runs(monkeypatch):
    # Forked, the runs share this process's settings: a failed collective waits 1 s (not 5) for the other ranks'
    # reports, which a hung or lost rank never sends, and each rank asks the run's store every second (not every 5)
    # whether the run ended elsewhere.
    monkeypatch.setattr(run_store, "_REPORT_WINDOW_S", 1.0)
    monkeypatch.setattr(watchdog, "_POLL_S", 1.0)
    started = Runs()
    yield started
    started.kill_all()


def _wait_for(path: Path, run: MohProcess, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert run.poll() is None and time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _exit_code(run: MohProcess, folder: Path, n: int, timeout: float) -> tuple[int, str]:
    """The run's exit status, with the end of what it wrote to ``err<n>.txt`` for the assertion's message."""
    code = run.wait(timeout=timeout)
    return code, (folder / f"err{n}.txt").read_text()[-3000:]


def _said(folder: Path, n: int = 0) -> list[str]:
    return [line for line in (folder / f"err{n}.txt").read_text().splitlines() if line.startswith("moh: ")]


@DISTRIBUTED
def test_sigterm_to_forked_ranks_saves_at_the_step_boundary_and_ends_them_all(runs, tmp_path):
    """The step ends within the grace period (rank 0 lingers 2 s in step 5): both ranks save there and stop. Before,
    `moh` (the launching process, where Lightning handles no signal) ended at once without a word, and its ranks
    trained on without it (measured: to the run's end, step=0000006.ckpt written after the signal)."""
    run = runs.start(tmp_path, *FORKED, "--trainer.callbacks+=faults.HangAtStep", "--trainer.callbacks.step=4",
                     "--trainer.callbacks.rank=0", "--trainer.callbacks.seconds=2")
    _wait_for(tmp_path / "at_step_4_rank0", run)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) == 143
    assert _said(tmp_path) == [f"moh: stopped by SIGTERM after step 5; saved {LAST}. {AGAIN}"]
    assert load_checkpoint(tmp_path / LAST)["global_step"] == 5
    runs.assert_none_left()


@DISTRIBUTED
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_ends_a_run_whose_rank_hangs_with_every_process(signals, runs, tmp_path):
    """One SIGTERM: no step ends, so after the grace period every rank and loader worker is ended; a second SIGTERM
    ends them at once. Either way one line says why, what was saved and how to resume."""
    grace = 2 if signals == 1 else 60
    run = runs.start(tmp_path, *FORKED, *HANG, f"--shutdown.grace_period={grace}")
    _wait_for(tmp_path / "at_step_4_rank1", run)
    _wait_for(tmp_path / "at_step_4_rank0", run)
    time.sleep(1)  # rank 0 is in the step's first collective, where Python runs no signal handler
    sent = time.monotonic()
    run.send_signal(signal.SIGTERM)
    if signals == 2:
        time.sleep(1.5)
        run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=grace + 60) == 143
    took = time.monotonic() - sent
    why = (f"no step ended within the {grace} s grace period" if signals == 1 else
           "a second SIGTERM ended it at once")
    assert _said(tmp_path) == [f"moh: stopped by SIGTERM at step 4: {why}, so every process of the run was ended; "
                               f"the newest checkpoint is {LAST} (step 3). {AGAIN}"]
    assert (grace <= took < grace + 15) if signals == 1 else took < 15, took
    runs.assert_none_left()
    assert load_checkpoint(tmp_path / LAST)["global_step"] == 3


@DISTRIBUTED
def test_a_hung_rank_ends_the_run_at_the_collective_timeout_naming_it(runs, tmp_path):
    timeout = 10
    run = runs.start(tmp_path, *FORKED, *HANG, f"--shutdown.collective_timeout={timeout}", "--shutdown.grace_period=2")
    _wait_for(tmp_path / "at_step_4_rank0", run)
    started = time.monotonic()
    assert run.wait(timeout=timeout + 60) == 1
    took = time.monotonic() - started
    said = _said(tmp_path)
    assert len(said) == 1 and said[0].startswith(f"moh: rank 0: a collective failed at step 4 (Timed out waiting "
                                                 f"{timeout * 1000}ms for "), said
    assert said[0].endswith(f"rank 1 did not reach it (hung, or its process or node is gone). Every process of the "
                            f"run ends; the newest checkpoint is {LAST} (step 3). Once every rank can run, continue "
                            f"with the same command and --ckpt_path last."), said
    assert "Traceback" not in (tmp_path / "err0.txt").read_text()
    assert timeout <= took < timeout + 25, took  # the timeout, the others' reports (1 s), rank 1's poll of the store
    runs.assert_none_left()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_nodes(runs: Runs, folder: Path, *args: str) -> list[MohProcess]:
    """`moh fit` twice, as on two machines of one process each that share the run folder (NODE_RANK 0 and 1)."""
    address = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    return [runs.start(folder, "--trainer.strategy=ddp", "--trainer.num_nodes=2", "--trainer.devices=1",
                       "--trainer.accelerator=cpu", "--shutdown.collective_timeout=60", *args,
                       env={**address, "NODE_RANK": str(node)}) for node in (0, 1)]


@DISTRIBUTED
def test_a_lost_node_ends_the_survivor_and_both_nodes_resume_exactly(runs, tmp_path, vit_ddp_uninterrupted):
    """Every process of a DDP run ended mid-epoch (node 1 killed, node 0 ending itself), then both nodes resumed from
    the step-3 checkpoint: each rank's own random states and loader position (2 workers each), the uninterrupted
    run's batches, losses and weights. The reference is the uninterrupted 2-rank run forked in the test process: the
    same 2 gloo ranks of one process each, global ranks, samplers and seeds as the 2 nodes' (measured: bit-identical).
    """
    folder = tmp_path / "lost"
    survivor, lost = _two_nodes(runs, folder, "--trainer.callbacks+=faults.KillNodeAtStep",
                                "--trainer.callbacks.step=5")
    code, err = _exit_code(lost, folder, 1, timeout=600)
    assert code == -signal.SIGKILL, err  # node 1, loader workers and all, before step 5
    killed = time.monotonic()
    code, err = _exit_code(survivor, folder, 0, timeout=120)
    assert code == 1, err
    assert time.monotonic() - killed < 30  # its next collective fails at once; 1 s for the others' reports
    said = _said(folder)
    # gloo's words for the closed connection vary ("Connection closed by peer", "Read error ...: Connection reset").
    assert len(said) == 1 and said[0].startswith("moh: rank 0: a collective failed at step 5 (") \
        and "Connection" in said[0], said
    assert f"; rank 1 did not reach it (hung, or its process or node is gone). Every process of the run ends; the " \
           f"newest checkpoint is {LAST} (step 3)." in said[0]
    runs.assert_none_left()

    for n, node in enumerate(_two_nodes(runs, folder, "--ckpt_path", "last"), start=2):
        code, err = _exit_code(node, folder, n, timeout=600)
        assert code == 0, err
    assert_same_run(vit_ddp_uninterrupted, folder)
    assert f"Restoring states from the checkpoint path at {LAST}" in (folder / "err2.txt").read_text()
    runs.assert_none_left()


def test_collectives_are_bounded_unless_the_strategy_has_a_timeout_of_its_own():
    shutdown, default, own = RunShutdown(collective_timeout=90), DDPStrategy(), DDPStrategy(timeout=timedelta(hours=2))
    assert collective_timeout(default) == default_pg_timeout == timedelta(minutes=30)
    for strategy in (default, own):
        shutdown.bound_collectives(SimpleNamespace(strategy=strategy))
    assert collective_timeout(default) == timedelta(seconds=90) and collective_timeout(own) == timedelta(hours=2)
    with pytest.raises(ValueError, match="grace_period=0"):
        RunShutdown(grace_period=0)


@pytest.mark.parametrize("with_store", [False, True], ids=["one process", "with a run store"])
@pytest.mark.slow
def test_the_watchdog_idles_at_zero_cpu(monkeypatch, with_store):
    # Past its first poll time a watchdog without a store once busy-spun in select (every `moh fit` ran ~3x slower).
    # A short poll interval puts the test past several poll times within seconds.
    monkeypatch.setattr(watchdog, "_POLL_S", 0.2)
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=None), interrupted=False)
    watch = watchdog.Watch(trainer, grace_period=20.0)
    try:
        if with_store:
            with socket.socket() as free:
                free.bind(("127.0.0.1", 0))
                port = free.getsockname()[1]
            server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            watch.watch_store(PrefixStore("moh_lightning/shutdown/", server))
        before = time.process_time()  # this process's CPU time, all threads: the main thread only sleeps
        time.sleep(3.0)
        used = time.process_time() - before
    finally:
        watch.close()
    assert used < 0.15, f"the watchdog used {used:.2f} CPU seconds in 3 s of waiting"


class _SlowStore:
    """A run store whose requests fail as a client's do: ``error`` raised by every request."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def check(self, keys):
        raise self.error


def test_a_store_that_answers_late_is_not_taken_for_a_lost_rank_0():
    # Under full load rank 0 may answer a poll after the client's timeout: that rank is slow, not gone (a lost
    # node's connections close at once), and taking it for gone ended a healthy rank with exit code 1.
    with pytest.raises(run_store.NoAnswerYet):
        run_store.ended_elsewhere(_SlowStore(RuntimeError("Socket Timeout")), leaving=False)
    closed = RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")
    gone = run_store.ended_elsewhere(_SlowStore(closed), leaving=False)
    assert gone == "rank 0, which holds the run's store, is gone"
    assert run_store.ended_elsewhere(_SlowStore(closed), leaving=True) is None


def test_a_rank_past_its_last_step_does_not_take_rank_0_ending_for_a_lost_node(monkeypatch):
    # At a run's end rank 0 may exit, and its store with it, while another rank still writes its logs: that rank took
    # the closed store for a lost rank 0 and ended with exit code 1 (seen once in the two-node resume above).
    asked: list[bool] = []
    monkeypatch.setattr(watchdog, "_POLL_S", 0.05)
    monkeypatch.setattr(watchdog, "ended_elsewhere", lambda store, leaving: asked.append(leaving))  # "not ended"

    def leaving_after(hook: str, fn: TrainerFn) -> bool:
        trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=None), interrupted=False,
                                  state=SimpleNamespace(fn=fn))
        watch = watchdog.Watch(trainer, grace_period=20.0)
        monkeypatch.setattr(shutdown, "_WATCH", watch)
        try:
            getattr(RunShutdown(), hook)(trainer, None)
            asked.clear()
            watch.watch_store(object())
            deadline = time.monotonic() + 10
            while not asked and time.monotonic() < deadline:
                time.sleep(0.01)
            return asked[-1]
        finally:
            watch.close()

    assert not leaving_after("on_validation_end", TrainerFn.FITTING)  # a fit's validation: training goes on
    assert not leaving_after("on_train_start", TrainerFn.FITTING)
    for hook, fn in [("on_train_end", TrainerFn.FITTING), ("on_validation_end", TrainerFn.VALIDATING),
                     ("on_test_end", TrainerFn.TESTING), ("on_predict_end", TrainerFn.PREDICTING)]:
        assert leaving_after(hook, fn), hook
