"""`moh bench --steps true`: each task's MoH step against its dense config, as rows of steps.json."""
from __future__ import annotations

import json

from moh_lightning.cli import main

FIELDS = {"config", "baseline", "device", "compile", "tokens", "ratio", "mfu"}


def test_steps_rows_are_written_and_replaced_not_repeated(run_dir, capsys, monkeypatch):
    from moh_lightning.tools.bench import steps

    monkeypatch.setattr(steps, "CPU_PAIRS", [("vit_tiny_mnist_75", "vit_tiny_mnist_100", 2, None)])
    for _ in range(2):
        main(["bench", "--steps", "true", "--repeats", "1", "--warmup", "0", "--output", "out/steps.json"])
    (row,) = json.loads((run_dir / "out/steps.json").read_text())
    assert FIELDS <= set(row) and row["config"] == "vit_tiny_mnist_75" and row["baseline"] == "vit_tiny_mnist_100"
    assert row["device"] == "cpu" and row["compile"] is False and row["tokens"] == 17 and row["mfu"] is None
    assert row["ratio"] == row["moh_ms"] / row["baseline_ms"] > 0
    assert "| vit_tiny_mnist_75 | vit_tiny_mnist_100 | cpu |" in (run_dir / "out/steps.md").read_text()
    assert "ratio" in capsys.readouterr().out
