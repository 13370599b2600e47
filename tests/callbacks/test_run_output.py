"""What a person reads from ``moh fit``: no third-party noise, a model summary that counts FLOPs, and a closing summary
saying where the run went and how it did. (A run without a run folder, ``fast_dev_run``, writes nothing in the working
folder: test_lean_imports.py, on its fresh process's fit.)"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from moh_lightning.cli import quiet_third_party

pytestmark = pytest.mark.slow

# Two blocks: the end of training draws a head-load card per routed layer, and what is read does not depend on depth.
SMOKE = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
         "--data.init_args.batch_size=32", "--model.init_args.arch.depth=2"]


def _moh(folder: Path, *args: str) -> tuple[str, str]:
    """``moh <args>`` run as a user runs it, in ``folder``; its stdout and its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", "from moh_lightning.cli import main; main()", *args], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def test_a_first_fit_reads_cleanly_and_ends_with_a_summary(tmp_path):
    stdout, stderr = _moh(tmp_path, "fit", "--config", "vit_tiny_mnist_75.yaml", *SMOKE)
    out = stdout + stderr
    for noise in ("set_vital", "LeafSpec", "litlogger"):
        assert noise not in out
    flops = re.search(r"Total FLOPs: ([\d.]+) ?(\w?)", out)
    assert flops and float(flops.group(1)) > 0, "the model summary ran no example input"
    summary = out[out.index("moh fit finished"):]
    assert "run folder:  runs/vit_tiny_mnist_75/version_0" in summary
    best = re.search(r"val/acc1: final [\d.]+, best [\d.]+ \((\S+\.ckpt)\)", summary)
    assert best and (tmp_path / best.group(1)).is_file()
    # the budget of a MoH model (a dense one's: test_dashboards_events.py, on its baseline's fit)
    assert "head budget: 75.0% of heads active per token, 2 routed layers; collapsed heads: none" in summary
    # every run of the save folder, so the run opens beside the ones it is compared with
    board, link = stdout.rstrip().splitlines()[-2:]
    assert board.endswith("dashboards:  tensorboard --logdir runs"), "the summary comes last"
    # the loss and the monitored metric above the head-load cards, unsmoothed
    query = parse_qs(urlparse(link.split()[1]).query)
    assert json.loads(query["pinnedCards"][0]) == [{"plugin": "scalars", "tag": "train/loss"},
                                                   {"plugin": "scalars", "tag": "val/acc1"}]
    assert query["smoothing"] == ["0"] and link.endswith("(train/loss, val/acc1 pinned, unsmoothed)")
    assert "v_num" not in out


def test_only_the_named_third_party_messages_are_silenced():
    quiet_third_party()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_third_party()  # after a reset of the filters: the suite's own filters come back on top
        warnings.warn_explicit("'set_vital' is deprecated", UserWarning, "x.py", 1,
                               module="torchdata.stateful_dataloader.stateful_dataloader")
        warnings.warn_explicit("'set_vital' is deprecated", UserWarning, "x.py", 1, module="my_code")
        warnings.warn_explicit("another torchdata warning", UserWarning, "x.py", 1,
                               module="torchdata.stateful_dataloader.stateful_dataloader")
    assert [str(w.message) for w in caught] == ["'set_vital' is deprecated", "another torchdata warning"]
