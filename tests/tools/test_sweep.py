"""``moh sweep``: a 2-cell × 2-seed grid on a local Ray Tune, with one failing trial and a restart mid-way.

Three calls of the same command on the same folder (each starts and stops its own local Ray):
1. interrupted by a Tune callback that raises as soon as the first trial finished, the way a killed sweep
   leaves Tune's state behind;
2. the same command again: continues without training the finished trial again; one trial fails (its run
   folder is blocked by a file) and is reported with its error while the others finish, and the sweep exits 1;
3. the same command with ``--retry_failed false`` and another metric: runs nothing and rewrites the report.
The table's statistics and the trial names are checked without Ray.
"""
from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import scipy.stats
import torch
import yaml
from conftest import ctrl_c_restored
from ray.tune import Callback
from sweep_cases import FIT_CONFIG, read_csv, run_state, tiny_overlay

from moh_lightning import cli
from moh_lightning.sweep import ray_tune
from moh_lightning.sweep.grid import baseline_index, cli_value, grid_cells, trial_names
from moh_lightning.sweep.report import STATUS_FAILED, STATUS_FINISHED, TrialResult, cell_stats

# Ray clusters run one at a time (one worker under pytest-xdist), as they did in one process; the unit tests of the
# statistics, names and report below start none.
RAY = pytest.mark.xdist_group("ray")

GRID = {"model.init_args.lr": [2e-3, 1e-2]}
SEEDS = [0, 1]


INTERRUPT = "MOH_TEST_INTERRUPT_SWEEP"


class Interrupted(Exception):
    pass


class InterruptAfterFirstTrial(Callback):
    """Ends the sweep's driver with an error at Tune's next step once a trial finished, while ``INTERRUPT`` is set.

    Raised from ``on_step_end``, the error leaves Tune's loop at once, without the final save of its state: what
    Tune finds on a restart is its last periodic save, as after the sweep was killed. (Tune restores a run's
    callbacks with it, hence the switch in the environment.)
    """

    def __init__(self) -> None:
        self.finished = 0

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.finished += 1

    def on_step_end(self, iteration, trials, **info) -> None:
        if self.finished and os.environ.get(INTERRUPT):
            raise Interrupted("the test interrupts the sweep")


def ray_processes(before: set[int]) -> list[str]:
    """The test process's live children that the sweep started (``before``: those earlier tests left, e.g. wandb's)."""
    time.sleep(0.5)
    deadline = time.time() + 15
    while True:
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
        if not children or time.time() > deadline:
            return [" ".join(p.cmdline()[:2]) for p in children]
        time.sleep(0.5)


@pytest.mark.server
@RAY
def test_sweep_fails_one_trial_and_restarts(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # run_dir: tmp, and the working folder, so nothing a trial writes lands in the checkout.
    overlay = run_dir / "tiny.yaml"
    overlay.write_text(yaml.safe_dump(tiny_overlay(run_dir)))
    out = run_dir / "sweep"
    args = ["sweep", "--fit_config", FIT_CONFIG, "--grid", json.dumps(GRID), "--seeds", json.dumps(SEEDS),
            "--out", str(out), "--cpus_per_trial", "1", "--reuse_workers", "true",
            "--extra_args", json.dumps(["--config", str(overlay)])]
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    names = ["lr=0.002-seed=0", "lr=0.002-seed=1", "lr=0.01-seed=0", "lr=0.01-seed=1"]
    runs = out / "runs"
    # The last trial fails: a file stands where its run folder goes.
    runs.mkdir(parents=True)
    blocked = runs / names[3]
    blocked.write_text("not a folder")

    # 1. Interrupted once the first trial finished.
    monkeypatch.setattr(ray_tune, "tune_callbacks", lambda: [InterruptAfterFirstTrial()])
    monkeypatch.setenv(INTERRUPT, "1")
    monkeypatch.setenv("MOH_DEBUG", "1")  # the error as raised, not moh's line for a bug
    with pytest.raises(Interrupted, match="interrupts the sweep"):
        cli.main(args)
    assert ray_processes(before) == []
    assert not (out / "results.md").exists()
    first = run_state(runs / names[0])
    assert first["versions"] == ["version_0"] and "version_0/config.yaml" in first["files"]
    assert any(name.endswith("last.ckpt") for name in first["files"])
    assert not (runs / names[1]).exists()

    # 2. The same command: the finished trial is not trained again; the blocked one fails, the others finish, and the
    # sweep says so by its exit.
    monkeypatch.delenv(INTERRUPT)
    monkeypatch.delenv("MOH_DEBUG")
    with pytest.raises(SystemExit, match=r"^moh sweep: 1 of 4 trials failed; .* the same command runs only the failed"):
        cli.main(args)
    assert ray_processes(before) == []
    assert run_state(runs / names[0]) == first
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert list(trials) == names
    assert [trials[n]["status"] for n in names] == ["finished", "finished", "finished", "failed"]
    error = trials[names[3]]["error"]
    assert names[3] in error and "Error" in error
    for name in names[:3]:
        assert Path(trials[name]["run_dir"]) == runs / name / "version_0"
        assert math.isfinite(float(trials[name]["val/loss"]))
    cells = read_csv(out / "results.csv")
    assert [(c["cell"], c["baseline"], c["val/loss n"]) for c in cells] == [("lr=0.002", "True", "2"),
                                                                           ("lr=0.01", "False", "1")]
    assert float(cells[0]["val/loss std"]) >= 0 and cells[1]["val/loss p"] == ""  # Welch needs n >= 2
    markdown = (out / "results.md").read_text()
    assert "| 0.002 (baseline) | 2 |" in markdown and " ± " in markdown
    assert "## Failed trials" in markdown and f"`{names[3]}`" in markdown
    plot = out / "val_loss.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A different sweep in the same folder is refused before Ray starts.
    with pytest.raises(SystemExit, match="different sweep"):
        cli.main(args[:4] + [json.dumps({"model.init_args.lr": [2e-3]})] + args[5:])

    # 3. The same command without retrying failures, reporting another metric: nothing runs, the report is rewritten.
    done = {name: run_state(runs / name) for name in names}
    with pytest.raises(SystemExit, match="1 of 4 trials failed; .* the same command with --retry_failed true runs"):
        cli.main(args + ["--retry_failed", "false", "--metric", "train/loss", "--mode", "min"])
    assert ray_processes(before) == []
    assert {name: run_state(runs / name) for name in names} == done
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert [trials[n]["status"] for n in names] == ["finished", "finished", "finished", "failed"]
    assert [c["train/loss n"] for c in read_csv(out / "results.csv")] == ["2", "1"]
    assert "## train/loss" in (out / "results.md").read_text()
    assert (out / "train_loss.png").is_file()


def _checkpoints(run: Path) -> list[Path]:
    return [path for path in run.glob("version_*/checkpoints/*.ckpt") if path.name != "last.ckpt"]


@pytest.mark.server
@RAY
def test_a_stopped_sweep_saves_its_trials_exits_130_and_continues_exactly_leaving_nothing_outside(tmp_path: Path):
    # Two trials that train the same (the grid's key only changes how many checkpoints are kept), in a fresh HOME
    # and TMPDIR; Ctrl-C (SIGINT to the sweep's process group) during the second.
    home, tmp = tmp_path / "home", Path(tempfile.mkdtemp(dir="/tmp"))  # (a short TMPDIR: Ray's sockets go below)
    home.mkdir()
    overlay = tmp_path / "tiny.yaml"
    settings = tiny_overlay(tmp_path)
    settings["model"]["init_args"]["max_tokens"] = 20 * 4 * 32  # 20 steps, a checkpoint every 5
    overlay.write_text(yaml.safe_dump(settings))
    out = tmp_path / "sweep"
    args = ["sweep", "--fit_config", FIT_CONFIG, "--grid", json.dumps({"checkpoint.keep": [3, 4]}), "--seeds", "[0]",
            "--out", str(out), "--cpus_per_trial", "1", "--reuse_workers", "true",
            "--extra_args", json.dumps(["--config", str(overlay)])]
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    ray_sessions = set(Path("/tmp/ray").glob("session_*"))
    first, second = out / "runs" / "keep=3-seed=0", out / "runs" / "keep=4-seed=0"

    sweep = subprocess.Popen([sys.executable, "-m", "moh_lightning.cli", *args], cwd=tmp_path, env=env,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=ctrl_c_restored)
    deadline = time.monotonic() + 300
    while not _checkpoints(second) and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sweep.poll() is None, sweep.communicate()[1][-3000:]
    os.killpg(sweep.pid, signal.SIGINT)
    _, err = sweep.communicate(timeout=120)
    said = [line for line in err.splitlines() if line.startswith("moh sweep:")]
    assert sweep.returncode == 130, err[-3000:]
    assert said[-1].startswith("moh sweep: stopped by SIGINT: 1 of 2 trials finished, the running ones saved at a "
                               "step boundary;") and said[-1].endswith("Continue with the same command: `moh sweep` "
                                                                      "with the same arguments"), said
    stopped_at = torch.load(second / "version_0/checkpoints/last.ckpt", weights_only=False)["global_step"]
    assert 5 <= stopped_at < 20
    assert not (out / "stop").exists()

    again = subprocess.run([sys.executable, "-m", "moh_lightning.cli", *args], cwd=tmp_path, env=env,
                           stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_restored, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = {row["trial"]: row for row in read_csv(out / "trials.csv")}
    assert [row["status"] for row in trials.values()] == ["finished", "finished"]
    # The stopped and continued trial ends where the uninterrupted one did.
    uninterrupted, resumed = (json.loads((run / "sweep_result.json").read_text()) for run in (first, second))
    assert resumed["global_step"] == uninterrupted["global_step"] == 20
    assert {key: resumed["metrics"][key] for key in ("train/loss", "val/loss")} == \
        {key: uninterrupted["metrics"][key] for key in ("train/loss", "val/loss")}

    # Nothing left outside the sweep folder: no Ray session under /tmp/ray, no token file, no temporary folder; in
    # HOME only matplotlib's font cache and config folder, as any `moh fit` that draws (the docs name them).
    assert set(Path("/tmp/ray").glob("session_*")) == ray_sessions
    left = [path.relative_to(home) for path in home.rglob("*") if path.is_file()]
    assert all(path.parts[:2] in ((".cache", "matplotlib"), (".config", "matplotlib")) for path in left), left
    assert list(tmp.iterdir()) == []
    tmp.rmdir()


def test_welch_comparison_with_the_baseline() -> None:
    a, b, c = [1.0, 1.2, 1.1], [2.0, 2.4], [5.0]
    trials = [TrialResult(f"t{i}", cell, i, STATUS_FINISHED, {"m": v})
              for i, (cell, v) in enumerate([(0, x) for x in a] + [(1, x) for x in b] + [(2, x) for x in c])]
    trials.append(TrialResult("failed", 1, 9, STATUS_FAILED, {"m": 100.0}, error="boom"))  # not counted
    base, second, single = cell_stats(trials, 3, "m", baseline=0)
    assert (base.n, second.n, single.n) == (3, 2, 1)
    assert base.mean == pytest.approx(1.1) and base.std == pytest.approx(statistics.stdev(a))
    assert math.isnan(base.p) and math.isnan(base.diff)
    welch = scipy.stats.ttest_ind(b, a, equal_var=False)
    ci = welch.confidence_interval(0.95)
    assert second.diff == pytest.approx(statistics.mean(b) - statistics.mean(a))
    assert (second.p, second.ci_low, second.ci_high) == pytest.approx((welch.pvalue, ci.low, ci.high))
    assert math.isnan(single.std) and math.isnan(single.p) and single.diff == pytest.approx(5.0 - 1.1)


def test_trial_names_and_override_values() -> None:
    cells = [{"model.init_args.lr": 1e-5, "data.init_args.batch_size": 8, "model.init_args.arch.moh.top_k": 2}]
    assert trial_names(cells, [3]) == {(0, 0): "lr=1e-05-batch_size=8-top_k=2-seed=3"}
    clash = [{"model.init_args.name": "a/b"}, {"model.init_args.name": "a b"}]
    assert trial_names(clash, [0]) == {(0, 0): "cell0-name=a_b-seed=0", (1, 0): "cell1-name=a_b-seed=0"}
    assert [yaml.safe_load(cli_value(v)) for v in (1e-5, 2.0e-3, 3, True, None, [1, 2], "x")] == \
        [1e-5, 2.0e-3, 3, True, None, [1, 2], "x"]


def test_named_grid_values_label_trials_and_rows_but_override_with_their_values() -> None:
    moh75 = {"num_shared_heads": 4, "top_k": 2}
    cells, shown = grid_cells({"model.init_args.arch.moh": {"dense": None, "75%": moh75}, "model.init_args.lr": [1e-3]})
    assert cells == [{"model.init_args.arch.moh": None, "model.init_args.lr": 1e-3},
                     {"model.init_args.arch.moh": moh75, "model.init_args.lr": 1e-3}]
    assert [c["model.init_args.arch.moh"] for c in shown] == ["dense", "75%"]
    assert trial_names(shown, [0])[1, 0] == "moh=75_-lr=0.001-seed=0"
    assert baseline_index(cells, shown, {"model.init_args.arch.moh": "75%"}) == 1
    assert baseline_index(cells, shown, {"model.init_args.arch.moh": moh75}) == 1


def test_the_report_says_in_words_what_differs_and_what_is_within_noise(tmp_path: Path) -> None:
    from moh_lightning.sweep.report import write_report

    values = {0: [0.70, 0.72, 0.71], 1: [0.71, 0.69, 0.73], 2: [0.80, 0.81, 0.82]}  # same as baseline; clearly better
    trials = [TrialResult(f"c{cell}-s{seed}", cell, seed, STATUS_FINISHED, {"val/acc1": v})
              for cell, vs in values.items() for seed, v in enumerate(vs)]
    cells = [{"model.init_args.arch.moh": name} for name in ("dense", "moh-75", "moh-50")]
    write_report(tmp_path, trials, cells, [0, 1, 2], "val/acc1", "max", 0, "test")
    text = (tmp_path / "results.md").read_text()
    assert "- moh=moh-75: val/acc1 +0 against moh=dense, within the seeds' spread (p = 1.00" in text
    assert "no difference shown with these seeds" in text
    assert "- moh=moh-50: better than moh=dense by 0.1 val/acc1 (p = " in text
