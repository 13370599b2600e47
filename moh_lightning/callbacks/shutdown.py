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
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist
import torch.multiprocessing
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout

from moh_lightning import lightning_compat as compat
from moh_lightning.callbacks.run_store import collective_failed, missing_ranks, store_client, tell_the_run
from moh_lightning.callbacks.watchdog import Watch, hear, newest_checkpoint

_WATCH: Watch | None = None
_said_for: BaseException | None = None


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
            self._store = store_client()
            if _WATCH is not None:
                _WATCH.watch_store(store_client())  # a client of its own: the thread polls while this one reports

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _take_back_sigterm(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _take_back_sigterm(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _past_the_last_step()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # `moh validate`; a fit's validations come back to training
            _past_the_last_step()

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _past_the_last_step()

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _past_the_last_step()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._store is None or not collective_failed(exception):
            return
        rank = trainer.global_rank
        missing = missing_ranks(self._store, rank, trainer.world_size)
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
        tell_the_run(self._store, f"rank {rank}: a collective failed")
        if _WATCH is not None:
            _WATCH.end_within_grace_period()  # the teardown still runs, unless it blocks on the broken collective


def _past_the_last_step() -> None:
    """Rank 0 may now end and take the run's store with it while this rank still writes its logs and checkpoint: a
    store gone from here on is no lost rank 0 (a rank lost now fails the last checkpoint's collective instead)."""
    if _WATCH is not None:
        _WATCH.leaving = True


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
    _WATCH = Watch(trainer, shutdown.grace_period, launches_only=forks)
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


def _forget_the_watch() -> None:
    """In a process forked from a watched one (a forked rank, a loader worker): no watchdog thread came along, and
    the wakeup descriptor is the parent's. A loader worker keeps ``hear``, so Ctrl-C leaves it to its rank."""
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
    signal.signal(signal.SIGTERM, hear)
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
    _WATCH = Watch(trainer, grace_period, forwards=False)  # (its copy of the launcher lists the parent's ranks)
    try:
        return function(*args, **kwargs)
    except BaseException as exception:
        # Lightning's fork launcher runs fit without fit's exception handling: the callbacks' on_exception (the
        # checkpoint and exit code on SIGTERM, the missing ranks of a failed collective) would not run.
        compat.interrupt(trainer, exception)
        if exception is _said_for:
            raise SystemExit(1) from None
        raise
