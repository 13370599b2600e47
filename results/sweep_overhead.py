"""Writes results/sweep_overhead.md: what a `moh sweep` trial costs beyond its own `moh fit`, with a fresh Ray worker
process per trial (`--reuse_workers false`, the default) and with one worker reused (`--reuse_workers true`).

    OMP_NUM_THREADS=1 PYTHONPATH=. python results/sweep_overhead.py [work folder]

Sweeps of 1 and of 4 trials of the tests' tiny LM (tests/tools/test_sweep.py's overlay, 5 steps each) are timed as
whole `moh sweep` processes; the slope between them is one trial's cost in a sweep, and a trial's own fit (the time
between its run folder's first file and its result, read from the trial folders) is subtracted from it. The sweep's
fixed cost (Ray's start and end, the report) is the rest of the 1-trial sweep.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from test_sweep import FIT_CONFIG, tiny_overlay  # noqa: E402


def timed_sweep(work: Path, trials: int, reuse: bool) -> tuple[float, list[float]]:
    """Wall seconds of one `moh sweep` process, and each trial's own fit seconds."""
    out = work / f"sweep_{trials}_{reuse}"
    seeds = list(range(trials))
    args = [sys.executable, "-m", "moh_lightning.cli", "sweep", "--fit_config", FIT_CONFIG,
            "--seeds", json.dumps(seeds), "--out", str(out), "--cpus_per_trial", "1",
            "--reuse_workers", str(reuse).lower(),
            "--extra_args", json.dumps(["--config", str(work / "tiny.yaml")])]
    start = time.perf_counter()
    subprocess.run(args, cwd=work, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    fits = []
    for trial in (out / "runs").iterdir():
        files = [path.stat().st_mtime for path in (trial / "version_0").rglob("*") if path.is_file()]
        fits.append((trial / "sweep_result.json").stat().st_mtime - min(files))
    return wall, fits


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="sweep-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "tiny.yaml").write_text(yaml.safe_dump(tiny_overlay(work)))
    rows = []
    for reuse in (False, True):
        one, one_fits = timed_sweep(work, 1, reuse)
        four, four_fits = timed_sweep(work, 4, reuse)
        per_trial = (four - one) / 3
        fit = statistics.median(one_fits + four_fits)
        rows.append((reuse, one, four, per_trial, fit, per_trial - fit, one - fit))
    load = os.getloadavg()[0]
    lines = ["# What a sweep trial costs beyond its own fit", "",
             "Measured by `OMP_NUM_THREADS=1 PYTHONPATH=. python results/sweep_overhead.py` "
             f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, load {load:.1f} at the end), one run each: the "
             "tests' tiny LM (5 steps a trial, one trial at a time, 1 CPU a trial).", "",
             "| workers | 1-trial sweep (s) | 4-trial sweep (s) | per trial in a sweep (s) | its own fit (s) | "
             "overhead per trial (s) | fixed cost of a sweep (s) |", "|---|---|---|---|---|---|---|"]
    for reuse, one, four, per_trial, fit, overhead, fixed in rows:
        name = "one reused (`--reuse_workers true`)" if reuse else "a fresh process per trial (default)"
        lines.append(f"| {name} | {one:.1f} | {four:.1f} | {per_trial:.1f} | {fit:.1f} | {overhead:.1f} | "
                     f"{fixed:.1f} |")
    (ROOT / "results" / "sweep_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
