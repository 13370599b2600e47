"""Each process's watchdog thread: it hears the stop signals, forwards them to the ranks, and ends the process when the
run must end (``shutdown``'s docstring says when)."""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from contextlib import suppress
from typing import Any

import psutil
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from moh_lightning import lightning_compat as compat
from moh_lightning.callbacks.run_store import NoAnswerYet, ended_elsewhere, store_client, tell_the_run

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A stop signal this soon after the first is the same request: a terminal's Ctrl-C reaches every process of the run,
# which also gets the copy its launcher forwards.
_SAME_REQUEST_S = 1.0
# The launching process of forked ranks waits this much longer than they do: they end themselves and say why.
_LAUNCHER_MARGIN_S = 5.0
_POLL_S = 5.0  # how often a rank's watchdog asks the store whether the run ended elsewhere


def newest_checkpoint(trainer: Trainer) -> str:
    """The newest ``last`` checkpoint the run wrote (or resumed from), for a line on how to continue."""
    written = [callback for callback in trainer.checkpoint_callbacks
               if isinstance(callback, ModelCheckpoint) and callback.last_model_path]
    if not written:
        return "none yet (the same command starts afresh)"
    callback = max(written, key=compat.last_saved_step)
    step = compat.last_saved_step(callback)
    return f"{callback.last_model_path} (step {step})" if step else callback.last_model_path


class Watch:
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
        self.leaving = False  # past the run's last step (``RunShutdown`` says when)
        self._closing = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        # Python's own C-level handler writes each signal's number to the wakeup descriptor at once, whatever the
        # main thread does; the Python-level handler only has to exist (the default would kill the process or raise
        # KeyboardInterrupt in the middle of a step). A signal ignored by whoever started `moh` stays ignored (a
        # shell script's `moh ... &` ignores Ctrl-C), as Python itself leaves it.
        self.handlers = {signum: signal.signal(signum, hear) for signum in STOP_SIGNALS
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
                    self._elsewhere = ended_elsewhere(self.store, self.leaving or self.trainer.interrupted)
                except NoAnswerYet:
                    with suppress(RuntimeError):  # (refused: the next poll finds the store gone)
                        self.store = store_client()  # a client whose request timed out may read that late answer next
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
            tell_the_run(self.store, f"rank {self.trainer.global_rank} was ended: {why}")
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


def hear(signum: int, frame: Any) -> None:
    """The Python-level handler of the stop signals: the watchdog thread does the work (see ``Watch``)."""


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those that still run: a zombie has ended, only its exit status waits for its parent."""
    alive = []
    for process in processes:
        with suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive
