"""How the CPU report times its variants, on ``torch.utils.benchmark``: apart because every section measures
through it, and the way it measures is why the CPU numbers can be trusted on a shared machine.

The variants of one measurement run interleaved, round by round (each round runs every variant once), so load from
other processes hits them alike; a speedup is the median of the per-round ratios of two variants, with their
quartiles, since a ratio of two medians would carry a slow spell of the machine that fell on one variant's runs.
Each timed run is one ``torch.utils.benchmark.Timer.timeit``: it synchronises an accelerator before reading the
clock, runs at the thread count the report was started with (the Timer's own default is one thread), and calls the
statement twice untimed before the timed call, on top of the warm-up rounds. With ``cpu_time`` the Timer reads
``time.process_time``: the work done, not the waiting for a core shared with other processes.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import benchmark


@dataclass
class Clock:
    """Where the runs are timed, and by which clock."""

    device: torch.device
    cpu_time: bool = False  # process CPU time instead of wall time (CPU only): steadier when the cores are shared

    def timer(self, fn: Callable[[], object]) -> benchmark.Timer:
        clock = {"timer": time.process_time} if self.cpu_time else {}
        return benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), **clock)

    def once_s(self, fn: Callable[[], object]) -> float:
        """Seconds of a single call with no warm-up: for what happens once, such as compiling on the first step."""
        now = time.process_time if self.cpu_time else benchmark.timer
        start = now()
        fn()
        return now() - start


def times_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, clock: Clock) -> dict[str, list]:
    """Every timed run of each function in ms, round by round; each round runs every function once."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    timers = {name: clock.timer(fn) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer.timeit(number=1).median * 1e3)
    return times


def median_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, clock: Clock) -> dict[str, float]:
    """Median time of each function; runs alternate between the functions."""
    return {name: statistics.median(t) for name, t in times_ms(fns, repeats, warmup, clock).items()}


def paired_ratio(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios ``times / base``: the two ran back to back in each round, so
    a slow spell of the machine hits both, where a ratio of the two medians would carry it."""
    ratios = sorted(t / b for t, b in zip(times, base, strict=True))
    # Inclusive: quartiles within the measured ratios (the default extrapolates past them for a few rounds).
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), quartiles[0], quartiles[2]
