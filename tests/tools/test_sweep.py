"""``moh sweep`` without Ray: the table's statistics and words, the report's files, the trial names, and a trial's
return after a sweep was killed. The sweep on Ray itself: test_sweep_local.py (a local Ray, stopped, continued, a
failed trial) and test_sweep_cluster.py (two nodes, one lost).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import scipy.stats
import yaml
from sweep_cases import read_csv

from moh_lightning.sweep import ray_tune
from moh_lightning.sweep.grid import baseline_index, cli_value, grid_cells, trial_names
from moh_lightning.sweep.report import STATUS_FAILED, STATUS_FINISHED, TrialResult, cell_stats, write_report


def test_the_report_tables_each_cell_over_its_finished_seeds_and_names_the_failed_trials(tmp_path: Path) -> None:
    cells = [{"model.init_args.lr": 2e-3}, {"model.init_args.lr": 1e-2}]
    runs = tmp_path / "runs"
    trials = [TrialResult(name, cell, seed, STATUS_FINISHED, {"val/loss": val, "train/loss": train},
                          run_dir=str(runs / name / "version_0"), node="127.0.0.1")
              for name, cell, seed, val, train in [("lr=0.002-seed=0", 0, 0, 2.0, 2.5),
                                                   ("lr=0.002-seed=1", 0, 1, 2.2, 2.4),
                                                   ("lr=0.01-seed=0", 1, 0, 1.5, 1.9)]]
    error = "NotADirectoryError: [Errno 20] Not a directory: 'runs/lr=0.01-seed=1' | x"
    trials.append(TrialResult("lr=0.01-seed=1", 1, 1, STATUS_FAILED, error=error,
                              traceback=str(tmp_path / "tune" / "lr=0.01-seed=1" / "error.txt")))
    write_report(tmp_path, trials, cells, [0, 1], "val/loss", "min", 0, "llm_stdlib_75.yaml")
    rows = read_csv(tmp_path / "trials.csv")
    assert [(r["trial"], r["model.init_args.lr"], r["seed"], r["status"]) for r in rows] == [
        ("lr=0.002-seed=0", "0.002", "0", "finished"), ("lr=0.002-seed=1", "0.002", "1", "finished"),
        ("lr=0.01-seed=0", "0.01", "0", "finished"), ("lr=0.01-seed=1", "0.01", "1", "failed")]
    assert [float(r["val/loss"]) for r in rows[:3]] == [2.0, 2.2, 1.5] and rows[3]["val/loss"] == ""
    assert [Path(r["run_dir"]) for r in rows[:3]] == [runs / r["trial"] / "version_0" for r in rows[:3]]
    assert rows[3]["error"] == error and rows[3]["traceback"] == trials[3].traceback
    # One row per cell over its finished seeds; Welch's comparison needs n >= 2 on both sides.
    cells_csv = read_csv(tmp_path / "results.csv")
    assert [(c["cell"], c["baseline"], c["val/loss n"], c["train/loss n"]) for c in cells_csv] == [
        ("lr=0.002", "True", "2", "2"), ("lr=0.01", "False", "1", "1")]
    assert float(cells_csv[0]["val/loss mean"]) == pytest.approx(2.1)
    assert float(cells_csv[0]["val/loss std"]) == pytest.approx(statistics.stdev([2.0, 2.2]))
    assert float(cells_csv[1]["val/loss diff"]) == pytest.approx(1.5 - 2.1) and cells_csv[1]["val/loss p"] == ""
    markdown = (tmp_path / "results.md").read_text()
    assert "| 0.002 (baseline) | 2 | 2.1 ± 0.141 | — | — |" in markdown
    assert "| 0.01 | 1 | **1.5** | -0.6 | n/a |" in markdown  # the best cell in bold
    assert "## Failed trials" in markdown
    assert f"| `lr=0.01-seed=1` | {error.replace('|', chr(92) + '|')} | `tune/lr=0.01-seed=1/error.txt` |" in markdown
    assert (tmp_path / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_trial_that_finished_before_its_sweep_was_killed_reports_its_saved_result_without_training_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Killed after a trial finished but before Tune saved its state, a sweep restored runs that trial again: its
    # trainable finds the result its fit saved and reports it as it was.
    runs, name = tmp_path / "runs", "lr=0.002-seed=0"
    saved = {"metrics": {"val/loss": 2.0}, "run_dir": str(runs / name / "version_0"), "global_step": 5,
             "node": "127.0.0.1"}
    (runs / name).mkdir(parents=True)
    (runs / name / ray_tune.DONE_FILE).write_text(json.dumps(saved))
    reported = []
    monkeypatch.setattr(ray_tune.tune, "report", reported.append)
    monkeypatch.setattr(ray_tune, "main", lambda args: pytest.fail(f"trained again: moh {' '.join(args)}"))
    ray_tune._trainable({"trial": {"name": name, "cell": 0, "seed": 0, "overrides": {}}}, fit_config="x.yaml",
                        runs=str(runs), stop_file=str(tmp_path / "stop"), cwd=str(tmp_path), extra_args=[], threads=1)
    assert reported == [saved]


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
    values = {0: [0.70, 0.72, 0.71], 1: [0.71, 0.69, 0.73], 2: [0.80, 0.81, 0.82]}  # same as baseline; clearly better
    trials = [TrialResult(f"c{cell}-s{seed}", cell, seed, STATUS_FINISHED, {"val/acc1": v})
              for cell, vs in values.items() for seed, v in enumerate(vs)]
    cells = [{"model.init_args.arch.moh": name} for name in ("dense", "moh-75", "moh-50")]
    write_report(tmp_path, trials, cells, [0, 1, 2], "val/acc1", "max", 0, "test")
    text = (tmp_path / "results.md").read_text()
    assert "- moh=moh-75: val/acc1 +0 against moh=dense, within the seeds' spread (p = 1.00" in text
    assert "no difference shown with these seeds" in text
    assert "- moh=moh-50: better than moh=dense by 0.1 val/acc1 (p = " in text
