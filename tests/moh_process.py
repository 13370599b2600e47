"""`moh <args>` as a process of its own, forked from the test process, which has imported torch and Lightning already:
a fresh interpreter imports them again, 5-10 s each time (a minute on a loaded machine).

Where the process boundary is the promise (signals sent from outside, exit codes, a node lost, no process left), the
child is made to look like a fresh ``moh`` in what ``moh`` and Lightning read: a session of its own (``setsid``), its
working folder and environment, stdout and stderr on the given files, the stop signals at Python's defaults, the
warning filters and hooks as the interpreter started them (pytest's filters and recorders are gone), and logging as
Lightning sets it up when imported with no root handlers (its own ``lightning.pytorch`` handler on stderr; pytest's
capturing handlers are gone). It exits as ``python -m moh_lightning.cli`` does: with the code of its ``SystemExit``,
1 for an uncaught exception (its traceback on stderr), killed by a signal as a negative ``returncode``.

One thread: the test process may have run a pool of OpenMP threads, and GNU OpenMP hangs in a forked child that
starts another.
"""
from __future__ import annotations

import _warnings
import faulthandler
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from conftest import CPYTHON_GC_THRESHOLDS
from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

_FORK = multiprocessing.get_context("fork")


class MohProcess:
    """What a test uses of ``subprocess.Popen``, for a forked ``moh``."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: Sequence[str]) -> None:
        self._process, self.args, self.pid = process, list(args), process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # reaped with waitpid(WNOHANG); -N when signal N ended it

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        # Not the process's sentinel pipe: the ranks and loader workers it forked hold it open after it has ended.
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_moh(args: Sequence[str], cwd: Path, env: Mapping[str, str], stdout: Path, stderr: Path) -> MohProcess:
    """``moh <args>`` in ``cwd`` with the environment ``env``, writing to the files ``stdout`` and ``stderr``."""
    return start(lambda: _moh(args), cwd, env, stdout, stderr, name=f"moh {' '.join(args[:1])}")


def start(function: Callable[[], object], cwd: Path, env: Mapping[str, str], stdout: Path, stderr: Path,
          name: str = "forked") -> MohProcess:
    """``function()`` in a forked child set up as ``start_moh``'s; its ``SystemExit`` code is the exit code."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):  # nothing of this process's is repeated
        if stream is not None:
            stream.flush()
    if torch.cuda.is_initialized():  # its forked child could not use CUDA (see _as_a_fresh_process)
        raise RuntimeError("a process that has used CUDA cannot fork a fresh `moh`")
    files = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for path in (stdout, stderr)]
    try:
        process = _FORK.Process(target=_as_a_fresh_process, args=(function, Path(cwd), dict(env), *files), name=name)
        process.start()
    finally:
        for file in files:
            os.close(file)
    return MohProcess(process, [name])


def _moh(args: Sequence[str]) -> None:
    from moh_lightning.cli import main

    sys.argv = [str(Path(sys.executable).with_name("moh")), *args]
    main()  # reads sys.argv, as the `moh` script does


def _as_a_fresh_process(function: Callable[[], object], cwd: Path, env: dict[str, str], stdout: int,
                        stderr: int) -> None:
    os.setsid()
    captured = (sys.stdout, sys.stderr)
    for fd, file in ((1, stdout), (2, stderr)):
        os.dup2(file, fd)
        os.close(file)
    # Block-buffered stdout and line-buffered stderr, as Python opens them on files.
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # Once a process has asked CUDA how many devices there are (torch.cuda.is_available() does; so does importing
    # diffusers), torch marks each process forked from it as one that cannot use CUDA, and Lightning's fork launcher
    # (`ddp_fork`) then refuses to start ranks. A fresh `moh` has no such parent, and this one no CUDA context.
    torch.cuda._is_in_bad_fork = lambda: False
    rank_zero_only.rank = _get_rank() or 0  # as Lightning sets it on import, from the environment
    gc.set_threshold(*CPYTHON_GC_THRESHOLDS)  # tests/conftest.py raises them for the test process
    _default_signals()
    _fresh_logging(captured)
    _fresh_warnings()
    sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    try:
        function()
    except SystemExit:
        raise
    except BaseException as error:  # printed as Python prints what is left uncaught, without multiprocessing's header
        traceback.print_exception(error)
        if isinstance(error, KeyboardInterrupt):  # Python then ends by the signal itself
            multiprocessing.util._exit_function()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None


def _default_signals() -> None:
    """Python's own handling of every signal: pytest's handlers (a test's timeout) and its fault handler go."""
    faulthandler.disable()
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _fresh_logging(captured: tuple[object, object]) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):  # pytest's capturing handlers
        root.removeHandler(handler)
    for logger in [root, *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler and handler.stream in captured:
                handler.setStream(sys.stdout if handler.stream is captured[0] else sys.stderr)
    # Lightning's own set-up when imported with no root handlers (lightning/pytorch/__init__.py); under pytest, which
    # had root handlers then, its loggers propagate to the root instead.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        if logger.propagate:
            logger.addHandler(logging.StreamHandler())
            logger.propagate = False


def _fresh_warnings() -> None:
    """The filters as the interpreter started (pytest applies its own to a copy while it runs a test), and warnings
    printed to stderr again, not recorded."""
    warnings.filters = list(_warnings.filters)
    warnings._filters_mutated()
    warnings.showwarning = warnings._showwarning_orig
    warnings._showwarnmsg_impl = _print_warning


def _print_warning(message: warnings.WarningMessage) -> None:
    """Python's own way to show a warning (``warnings._showwarnmsg_impl``, which pytest's recorder replaced)."""
    file = message.file or sys.stderr
    file.write(warnings._formatwarnmsg(message))
