"""`benchmarks/parity.py`: `moh fit`'s step against a bare loop of the same network, as rows of parity.json and a
page; what each part of the gap is from the profiler's actions. No timing is asserted, only that the pieces fit."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import parity
from moh_lightning import cli


def _here(run):
    """``subprocess.run`` that runs parity's fresh processes in this one: the same command lines, working folder and
    import path, through the same entry points. A fresh process's start (seconds of imports) is what parity keeps out
    of its timings, and none of what this test checks; anything else goes to ``run``."""
    def fake(command, cwd=None, env=None, **kwargs):
        script = Path(command[1]) if len(command) > 1 else None
        if command[0] != sys.executable or (command[1:3] != ["-m", "moh_lightning.cli"]
                                            and script != parity.ROOT / "benchmarks/parity.py"):
            return run(command, cwd=cwd, env=env, **kwargs)
        assert str(parity.ROOT) in env["PYTHONPATH"].split(os.pathsep)  # where `benchmarks.parity` is imported from
        with contextlib.chdir(cwd):
            if script == parity.ROOT / "benchmarks/parity.py":
                parity.main(command[2:])
            else:
                cli.main(command[3:])
        return subprocess.CompletedProcess(command, 0, "", "")
    return fake


@pytest.mark.slow
def test_quick_parity_rows_and_page(run_dir, capsys, monkeypatch):
    # One short repeat of the MNIST ViT: a `moh fit` of 4 steps (profiled: quick) and its two bare loops.
    monkeypatch.setitem(parity.QUICK, "steps", 2)
    monkeypatch.setitem(parity.QUICK, "warmup", 1)
    monkeypatch.setattr(subprocess, "run", _here(subprocess.run))
    parity.main(["--quick", "true", "--configs", "[vit_tiny_mnist_75]", "--output", "out/parity.json"])
    (row,) = json.loads((run_dir / "out/parity.json").read_text())
    assert row["config"] == "vit_tiny_mnist_75" and row["task"] == "ImageClassifier"
    assert row["batch"] == row["bare_batch"] == 128 and row["threads"] == row["bare_threads"]
    assert (row["first"], row["steps"], row["late_start"], len(row["repeats"])) == (1, 2, 0, 1)
    assert row["fit_ms"] > 0 and row["bare_ms"] > 0 and row["ratio"] == row["ratio_min"] == row["ratio_max"] > 0
    assert row["loader_ms"] > 0 and row["loop_ratio"] * row["data_ratio"] == pytest.approx(row["ratio"])
    profile = row["profile"]
    parts = {"data", "training_step", "backward", "optimizer", "rest"}
    assert set(profile["parts"]) == set(profile["bare_parts"]) == set(profile["loader_parts"]) == parts
    # The profiler's actions were found: the parts the bare loops also have took time in each; loading, where it
    # happens (the in-memory loop's "data" is reading the clock).
    assert all(p[name] > 0 for p in (profile["parts"], profile["bare_parts"], profile["loader_parts"])
               for name in ("training_step", "backward"))
    assert profile["parts"]["data"] > 0 and profile["loader_parts"]["data"] > 100 * profile["bare_parts"]["data"]
    assert "HeadLoadCallback" in profile["callbacks"] and "StepClock" not in profile["callbacks"]
    total = sum(profile["parts"].values()) + sum(c["ms"] for c in profile["callbacks"].values())
    assert total == pytest.approx(profile["period_ms"]) and profile["period"] == [1, 2]
    text = (run_dir / "out/parity.md").read_text()
    assert f"| vit_tiny_mnist_75 | ImageClassifier | 128 | {row['threads']} | 1-2 |" in text
    assert "## Where the gap is: vit_tiny_mnist_75" in text and "callback `HeadLoadCallback`" in text
    assert "python benchmarks/parity.py --quick true --configs ['vit_tiny_mnist_75'] --output out/parity.json" in text
    assert "moh fit / bare loop =" in capsys.readouterr().out
    assert not list(run_dir.glob("runs")) and not list(run_dir.glob("**/*.ckpt"))  # the runs' folders are gone


def test_breakdown_takes_nested_hooks_out_of_their_parts():
    # (seconds in the window, calls, longest call) per SimpleProfiler action over 10 steps.
    profile = {"[_TrainingEpochLoop].train_dataloader_next": [0.05, 10, 0.01],
               "[Strategy]SingleDeviceStrategy.batch_to_device": [0.01, 10, 0.001],
               "[LightningModule]Task.optimizer_step": [1.0, 10, 0.1],
               "[Strategy]SingleDeviceStrategy.training_step": [0.3, 10, 0.03],
               "[Strategy]SingleDeviceStrategy.backward": [0.5, 10, 0.05],
               "[Callback]Guard.on_before_backward": [0.02, 10, 0.002],  # inside backward
               "[Callback]Guard.on_before_optimizer_step": [0.01, 10, 0.001],  # inside the optimizer step
               "[LightningModule]Task.lr_scheduler_step": [0.005, 10, 0.001],
               "[Callback]Heads{'a': 1}.on_train_batch_end": [0.2, 10, 0.19],
               "[Callback]StepClock.on_train_batch_start": [0.001, 10, 0.0001]}
    split = parity.breakdown(profile, steps=10, period_ms=130.0)
    parts = split["parts"]
    assert parts["data"] == pytest.approx(6.0) and parts["training_step"] == pytest.approx(30.0)
    assert parts["backward"] == pytest.approx(48.0)  # 50 less the hook inside it
    assert parts["optimizer"] == pytest.approx(100 - 30 - 50 - 1 + 0.5)
    assert split["callbacks"]["Heads"] == {"ms": pytest.approx(20.0), "hook": "on_train_batch_end", "calls": 10,
                                           "longest_ms": pytest.approx(190.0), "hook_ms": pytest.approx(20.0)}
    assert split["callbacks"]["Guard"]["ms"] == pytest.approx(3.0) and "StepClock" not in split["callbacks"]
    assert parts["rest"] == pytest.approx(130 - 6 - 30 - 48 - 19.5 - 20 - 3)


def test_step_is_the_fastest_logging_period_so_a_spell_of_load_falls_out():
    wall = [0.0]
    for step in range(40):
        slower = 0.01 if step < 10 else 2.0 if step == 15 else 0.0
        wall.append(wall[-1] + (0.3 if step % 10 == 9 else 0.1) + slower)
    # Every 10th step logs (0.3 s); other work slowed the first period a little and one step of the second by 2 s.
    record = {"wall": wall, "cpu": [t / 2 for t in wall]}
    bounds = parity.periods(0, 40, 10)
    assert bounds == [0, 10, 20, 30, 40] and parity.periods(5, 3, 10) == [5, 8]
    assert parity.period_means(wall, bounds) == pytest.approx([0.13, 0.32, 0.12, 0.12])
    timed = parity.timings(record, bounds)
    assert timed["ms"] == pytest.approx(120.0) and timed["cpu_ms"] == pytest.approx(60.0)
    assert timed["median_ms"] == pytest.approx(100.0) and timed["mean_ms"] == pytest.approx(172.5)


def test_late_start_is_the_ema_start_of_the_dit_recipe():
    assert parity.late_start("dit_mnist_90") == 400
    assert parity.late_start("vit_tiny_mnist_75") == parity.late_start("llm_stdlib_75") == 0
