"""How a sweep stops as a run does: SIGTERM or Ctrl-C stops every running trial at a step boundary with its checkpoint.

A trial runs in a thread of a Ray worker, which hears no signal of its own, so the sweep's driver hears the signal
(``StopSignals``) and writes ``<out>/stop``; each trial's ``StopWhenAsked`` reads it after every step and stops its fit
there, then the trial says so (``runs/<trial>/stopped``) and waits (``wait_for_the_end``) until Tune's loop ends, which
``ray_tune.EndOnceSaved`` brings about once every running trial has. A second signal ends the sweep at once
(``EndNow``).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from moh_lightning import lightning_compat as compat

STOP_FILE = "stop"            # in <out> while a stop signal asks the trials to stop
STOPPED_FILE = "stopped"      # in runs/<trial>/: the trial saved at a step boundary and waits for the sweep to end
_SAME_REQUEST_S = 1.0         # a second signal this soon is the same Ctrl-C reaching the process again


class StopSignals:
    """The sweep's handlers of SIGTERM and Ctrl-C while it runs (the main thread's, restored afterwards).

    The first signal writes ``<out>/stop``, which every trial's ``StopWhenAsked`` reads after each step;
    ``EndOnceSaved`` then ends Tune's loop. A second one, a second or more later, ends the sweep at once.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / STOP_FILE
        self.signum: int | None = None
        self.heard_at = 0.0
        self._kept: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
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
            raise EndNow(signum)


class EndNow(BaseException):
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


def wait_for_the_end(run_root: Path) -> None:
    """Says that this trial has stopped (``EndOnceSaved`` waits for every running trial's word), then waits for
    Tune to end the sweep: ending the trial here would make it finished or failed, not unfinished."""
    run_root.mkdir(parents=True, exist_ok=True)
    (run_root / STOPPED_FILE).touch()
    while True:
        time.sleep(1)
