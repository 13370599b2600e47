"""A run ends as a whole: on SIGTERM or Ctrl-C, when a rank hangs, when a node is lost.

``moh fit`` trains inside ``run_as_a_whole``, which gives every process of the run (the launching process and each
rank) a watchdog thread, and ``RunShutdown`` (``shutdown:``) holds the settings and names a failed collective's
missing ranks.

* SIGTERM or SIGINT (Ctrl-C) asks the run to stop at the end of the current step, where ``StepCheckpoint`` writes
  ``last.ckpt`` and says so in one line (exit code 128 + the signal: 143, 130). The watchdog hears the signal through
  Python's wakeup file descriptor, so also while the main thread is blocked in C (a collective waiting for a hung
  rank), where Python runs no signal handler, and forwards it to the ranks its process started. When no step ends
  within ``grace_period`` seconds, every process of the run is ended (ranks and loader workers, SIGKILL) and rank 0
  says why, what was saved and how to resume; a second signal does that at once. (SLURM sends SIGTERM, then SIGKILL
  after its ``KillWait``, 30 s by default; a container stop or a cloud preemption allows about as long.)
* Every collective waits at most ``collective_timeout`` seconds (torch's default is 30 minutes). A rank whose
  collective fails (a timeout, or a peer whose connection closed) reports it in the run's store (torch.distributed's
  ``TCPStore`` on rank 0), waits a few seconds for the others to report theirs, names the ranks that did not, and
  tells the run to stop: each rank's watchdog polls the store, and every rank, on every node, ends at once (nothing is
  left to save: saving needs every rank), as it does when the store no longer answers (rank 0 gone).
* No process outlives the run: ranks that Lightning's launcher starts as subprocesses get SIGTERM when their parent
  ends, however it ends (Linux's parent-death signal, as torch.multiprocessing gives the processes it starts); loader
  workers end with their rank (torch's worker watchdog) and ignore Ctrl-C, which a terminal sends to every process:
  their rank decides when they end.
"""
from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from functools import partial
from typing import Any

import psutil
import torch.distributed as dist
import torch.multiprocessing
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.constants import default_pg_timeout

from moh_lightning import lightning_compat as compat

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A stop signal this soon after the first is the same request: a terminal's Ctrl-C reaches every process of the run,
# which also gets the copy its launcher forwards.
_SAME_REQUEST_S = 1.0
# The launching process of forked ranks waits this much longer than they do: they end themselves and say why.
_LAUNCHER_MARGIN_S = 5.0
# The ranks of one failed collective report within seconds of each other: a closed connection fails them at once, a
# hung rank at the same timeout from about the same start.
_REPORT_WINDOW_S = 5.0
_POLL_S = 5.0  # how often a rank's watchdog asks the store whether the run ended elsewhere
_STORE_TIMEOUT = timedelta(seconds=10)


class RunShutdown(Callback):
    """Ends a run as a whole on SIGTERM or Ctrl-C, a hung rank or a lost node (the module's docstring says how).

    Args:
        grace_period: Seconds a stop signal waits for the end of the current step (and its checkpoint) before every
            process of the run is ended.
        collective_timeout: Seconds any collective waits for every rank, also how long the first process waits for
            the others to start; a strategy given a ``timeout`` of its own (``--trainer.strategy.timeout``) keeps it.
    """

    def __init__(self, grace_period: float = 20.0, collective_timeout: float = 600.0) -> None:
        if grace_period <= 0 or collective_timeout <= 0:
            raise ValueError(f"RunShutdown grace_period={grace_period} and collective_timeout={collective_timeout} "
                             f"must both be positive (seconds).")
        self.grace_period, self.collective_timeout = grace_period, collective_timeout
        self._store: dist.Store | None = None

    def bound_collectives(self, trainer: Trainer) -> None:
        """Gives the strategy ``collective_timeout`` unless it has a timeout of its own (not torch's default)."""
        if compat.collective_timeout(trainer.strategy) == default_pg_timeout:
            compat.set_collective_timeout(trainer.strategy, timedelta(seconds=self.collective_timeout))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and dist.is_initialized():
            self._store = _run_store()
            if _WATCH is not None:
                _WATCH.watch_store(_run_store())  # a client of its own: the thread polls while this one reports

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _take_back_sigterm(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _take_back_sigterm(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._store is None or not _collective_failed(exception):
            return
        rank = trainer.global_rank
        missing = _missing_ranks(self._store, rank, trainer.world_size)
        if missing:
            names = ", ".join(map(str, missing))
            who = (f"rank{'s' if len(missing) > 1 else ''} {names} did not reach it (hung, or its process or node "
                   f"is gone)")
        else:
            who = "every rank reached it"
        # gloo's messages start with their source location ("[.../gloo/transport/tcp/pair.cc:561] Connection closed
        # by peer [127.0.0.1]:39341. This is typically caused by ..."): its first sentence says what happened.
        first = re.sub(r"^\[[^\]]*\]\s*", "", str(exception).strip().split("\n")[0]).split(". ")[0]
        cause = first or type(exception).__name__
        say(f"moh: rank {rank}: a collective failed at step {trainer.global_step} ({cause}); {who}. Every process "
            f"of the run ends; the newest checkpoint is {newest_checkpoint(trainer)}. Once every rank can run, "
            f"continue with the same command and --ckpt_path last.", about=exception)
        _tell_the_run(self._store, f"rank {rank}: a collective failed")
        if _WATCH is not None:
            _WATCH.end_within_grace_period()  # the teardown still runs, unless it blocks on the broken collective


@contextmanager
def run_as_a_whole(trainer: Trainer) -> Iterator[None]:
    """Runs what it holds (``trainer.fit``) with every process of the run watched, then gives the signals back.

    A failure that ``RunShutdown`` already explained in one line ends with exit code 1 and no traceback.
    """
    global _WATCH, _said_for
    shutdown = next((callback for callback in trainer.callbacks if isinstance(callback, RunShutdown)), None)
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    shutdown.bound_collectives(trainer)
    if "LOCAL_RANK" in os.environ:  # a rank that a launcher started (Lightning's, torchrun): it ends with it
        torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGTERM)
    launcher = trainer.strategy.launcher
    forks = launcher is not None and launcher.is_interactive_compatible
    _WATCH = _Watch(trainer, shutdown.grace_period, launches_only=forks)
    if forks:
        launcher.launch = partial(_launch_forked, launcher.launch, shutdown.grace_period)
    try:
        yield
    except BaseException as error:
        if error is _said_for:
            raise SystemExit(1) from None
        raise
    finally:
        if forks:
            del launcher.launch
        _WATCH.close()
        _WATCH = _said_for = None


def say(line: str, about: BaseException | None = None) -> None:
    """Prints the one line on why the run stopped; the watchdog does not repeat it, nor ``moh`` the traceback of
    ``about``."""
    global _said_for
    print(line, file=sys.stderr, flush=True)
    if _WATCH is not None:
        _WATCH.said = True
    if about is not None:
        _said_for = about


def stop_signal() -> signal.Signals:
    """The signal that stopped this process: SIGTERM unless its watchdog heard another (Ctrl-C's SIGINT)."""
    return signal.Signals(_WATCH.signum) if _WATCH is not None and _WATCH.signum else signal.SIGTERM


def newest_checkpoint(trainer: Trainer) -> str:
    """The newest ``last`` checkpoint the run wrote (or resumed from), for a line on how to continue."""
    written = [callback for callback in trainer.checkpoint_callbacks
               if isinstance(callback, ModelCheckpoint) and callback.last_model_path]
    if not written:
        return "none yet (the same command starts afresh)"
    callback = max(written, key=compat.last_saved_step)
    step = compat.last_saved_step(callback)
    return f"{callback.last_model_path} (step {step})" if step else callback.last_model_path


class _Watch:
    """This process's watchdog: hears the stop signals, forwards them, and ends the process when the run must end."""

    def __init__(self, trainer: Trainer, grace_period: float, launches_only: bool = False,
                 forwards: bool = True) -> None:
        self.trainer, self.grace_period = trainer, grace_period
        self.launches_only, self.forwards = launches_only, forwards
        self.store: dist.Store | None = None
        self.signum: int | None = None
        self.heard_at: float | None = None
        self.deadline: float | None = None
        self.said = False
        self._elsewhere: str | None = None
        self._closing = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        # Python's own C-level handler writes each signal's number to the wakeup descriptor at once, whatever the
        # main thread does; the Python-level handler only has to exist (the default would kill the process or raise
        # KeyboardInterrupt in the middle of a step). A signal ignored by whoever started `moh` stays ignored (a
        # shell script's `moh ... &` ignores Ctrl-C), as Python itself leaves it.
        self.handlers = {signum: signal.signal(signum, _hear) for signum in STOP_SIGNALS
                          if signal.getsignal(signum) != signal.SIG_IGN}
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="moh-run-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        signal.set_wakeup_fd(self._wakeup)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        self._wake()  # the thread then returns
        self._thread.join()
        os.close(self._read)
        os.close(self._write)

    def request_stop(self, signum: int) -> None:
        """Stops the run at the end of this step, or ends it when none ends within the grace period."""
        self.signum, self.heard_at = signum, time.monotonic()
        self.end_within_grace_period()
        compat.request_stop(self.trainer)
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        launcher = self.trainer.strategy.launcher
        if launcher is not None and self.forwards:
            launcher.kill(signum)  # the ranks this process started

    def end_within_grace_period(self) -> None:
        margin = _LAUNCHER_MARGIN_S if self.launches_only else 0.0
        self.deadline = time.monotonic() + self.grace_period + margin
        self._wake()

    def watch_store(self, store: dist.Store) -> None:
        """Polls ``store`` every few seconds from now on, for a run that ended on another rank."""
        self.store = store
        self._wake()

    def _wake(self) -> None:
        """Makes the thread recompute when it wakes next (it may sleep with no timeout)."""
        with suppress(OSError):  # a full pipe already wakes it; a closed one has no thread left
            os.write(self._write, b"\0")

    def _watch(self) -> None:
        next_poll = time.monotonic() + _POLL_S
        while True:
            stopping_ranks = self.launches_only and self.heard_at is not None
            # Without a store (one process) nothing is polled: the thread sleeps in select until a signal, a
            # deadline or close() wakes it. A wake time left in the past would turn select into a busy spin.
            wakes = [at for at in (next_poll if self.store is not None else None, self.deadline) if at is not None]
            if stopping_ranks:
                wakes.append(time.monotonic() + 0.2)
            timeout = max(min(wakes) - time.monotonic(), 0.0) if wakes else None
            ready, _, _ = select.select([self._read], [], [], timeout)
            if self._closing:
                return
            if stopping_ranks and not _alive(psutil.Process().children(recursive=True)):
                # The ranks have ended and said why: Lightning's own way out of the launcher (joining, re-raising,
                # finalizing loggers it never used) would only add seconds.
                os._exit(128 + self.signum)
            if ready:
                for signum in os.read(self._read, 64):
                    if signum in STOP_SIGNALS:
                        self._heard(signum)
                continue
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._end(f"no step ended within the {self.grace_period:g} s grace period")
            if self.store is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + _POLL_S
                # Nothing is left to save (saving needs every rank) nor to wait for.
                try:
                    self._elsewhere = _ended_elsewhere(self.store, self.trainer.interrupted)
                except _NoAnswerYet:
                    with suppress(RuntimeError):  # (refused: the next poll finds the store gone)
                        self.store = _run_store()  # a client whose request timed out may read that late answer next
                if self._elsewhere:
                    self._end(self._elsewhere)

    def _heard(self, signum: int) -> None:
        if self.heard_at is None:
            self.request_stop(signum)
        elif time.monotonic() - self.heard_at >= _SAME_REQUEST_S:
            if not self.launches_only:
                self._end(f"a second {signal.Signals(signum).name} ended it at once")
            # Forked ranks end at once on their second signal, and rank 0 says what was saved.
            self._forward(signum)
            self.deadline = min(self.deadline, time.monotonic() + _LAUNCHER_MARGIN_S)

    def _end(self, why: str) -> None:
        """Ends every process under this one (ranks, loader workers), then this one, saying why unless said."""
        processes = psutil.Process().children(recursive=True)
        if not self.said:
            line = self._line(why, bool(_alive(processes)))
            if line:
                print(line, file=sys.stderr, flush=True)
        for process in processes:
            with suppress(psutil.NoSuchProcess):
                process.kill()
        if self.store is not None and not self._elsewhere:
            _tell_the_run(self.store, f"rank {self.trainer.global_rank} was ended: {why}")
        os._exit(128 + self.signum if self.signum else 1)

    def _line(self, why: str, ranks_left: bool) -> str | None:
        trainer, again = self.trainer, "Continue with the same command and --ckpt_path last."
        if self.launches_only:  # its ranks should have ended themselves (and said why) by now
            name = signal.Signals(self.signum).name
            return f"moh: stopped by {name}: the run's processes did not end ({why}) and were killed. {again}" \
                if ranks_left else None
        newest = newest_checkpoint(trainer)
        if self._elsewhere:  # said once a node: the rank that ended the run said it on its own node
            return (f"moh: rank {trainer.global_rank} was ended at step {trainer.global_step}: {why}. The newest "
                    f"checkpoint is {newest}. {again}") if trainer.local_rank == 0 else None
        if not trainer.is_global_zero:
            return None
        name = signal.Signals(self.signum).name
        return (f"moh: stopped by {name} at step {trainer.global_step}: {why}, so every process of the run was "
                f"ended; the newest checkpoint is {newest}. {again}")


_WATCH: _Watch | None = None
_said_for: BaseException | None = None


def _hear(signum: int, frame: Any) -> None:
    """The Python-level handler of the stop signals: the watchdog thread does the work (see ``_Watch``)."""


def _forget_the_watch() -> None:
    """In a process forked from a watched one (a forked rank, a loader worker): no watchdog thread came along, and
    the wakeup descriptor is the parent's. A loader worker keeps ``_hear``, so Ctrl-C leaves it to its rank."""
    global _WATCH
    if _WATCH is not None:
        _WATCH = None
        with suppress(ValueError):
            signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forget_the_watch)


def _take_back_sigterm(trainer: Trainer) -> None:
    """Puts the watchdog's handler back in place of Lightning's, which the trainer registers when it starts running.

    Lightning's handler broadcasts from inside the signal handler, a collective out of turn with whatever the main
    thread is doing; the watchdog sets the same flag and forwards the signal without one.
    """
    if _WATCH is None or signal.SIGTERM not in _WATCH.handlers:
        return
    signal.signal(signal.SIGTERM, _hear)
    if _WATCH.heard_at is not None:  # Lightning clears the flag when it starts running
        compat.request_stop(trainer)


def _launch_forked(launch: Callable, grace_period: float, function: Callable, *args: Any,
                   trainer: Trainer | None = None, **kwargs: Any) -> Any:
    """Lightning's fork launcher, with each rank watched and handling its exceptions as ``fit`` does in one process.

    A rank that ended on purpose (exit code > 0: a stop signal, an explained failure) has said why: ``moh`` exits with
    its code, without the launcher's traceback.
    """
    try:
        return launch(partial(_forked_rank, function, trainer, grace_period), *args, trainer=trainer, **kwargs)
    except torch.multiprocessing.ProcessExitedException as ended:
        if ended.exit_code > 0:
            raise SystemExit(ended.exit_code) from None
        raise


def _forked_rank(function: Callable, trainer: Trainer, grace_period: float, *args: Any, **kwargs: Any) -> Any:
    global _WATCH
    _WATCH = _Watch(trainer, grace_period, forwards=False)  # (its copy of the launcher lists the parent's ranks)
    try:
        return function(*args, **kwargs)
    except BaseException as exception:
        # Lightning's fork launcher runs fit without fit's exception handling: the callbacks' on_exception (the
        # checkpoint and exit code on SIGTERM, the missing ranks of a failed collective) would not run.
        compat.interrupt(trainer, exception)
        if exception is _said_for:
            raise SystemExit(1) from None
        raise


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those that still run: a zombie has ended, only its exit status waits for its parent."""
    alive = []
    for process in processes:
        with suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive


def _collective_failed(exception: BaseException) -> bool:
    """Whether a collective failed: torch.distributed's errors, and gloo's (plain RuntimeErrors naming its source)."""
    return isinstance(exception, dist.DistError) or "/gloo/" in str(exception)


def _run_store() -> dist.Store:
    """A client of the run's store (rank 0's ``TCPStore``, at the address every rank connected to), under a prefix."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=_STORE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore("moh_lightning/shutdown/", store)


def _missing_ranks(store: dist.Store, rank: int, world_size: int) -> list[int]:
    """The ranks that did not report the failure of the same collective within ``_REPORT_WINDOW_S``."""
    try:
        store.set(f"failed/{rank}", "1")
        reported, deadline = store.add("failed", 1), time.monotonic() + _REPORT_WINDOW_S
        while reported < world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            reported = store.add("failed", 0)
        return [other for other in range(world_size) if not store.check([f"failed/{other}"])]
    except RuntimeError:  # the store lives in rank 0's process
        return [0]


class _NoAnswerYet(Exception):
    """The run's store did not answer within ``_STORE_TIMEOUT``: slow (rank 0's machine fully loaded), not gone."""


def _ended_elsewhere(store: dist.Store, leaving: bool) -> str | None:
    """Why the run ended on another rank, if it did: its message in the store, or a store whose connection is gone
    while this rank is not ``leaving`` itself (past its last step boundary, or failed: rank 0 may end first).

    A request that timed out raises ``_NoAnswerYet``: a lost rank 0 closes its connections at once (its process or
    node is gone, the kernel resets them), and one that hangs is found by the collective timeout instead.
    """
    try:
        return store.get("stop").decode() if store.check(["stop"]) else None
    except RuntimeError as error:
        if leaving:
            return None
        if "timeout" in str(error).lower() or "timed out" in str(error).lower():
            raise _NoAnswerYet from error
        return "rank 0, which holds the run's store, is gone"


def _tell_the_run(store: dist.Store, why: str) -> None:
    with suppress(RuntimeError):
        store.set("stop", why)
