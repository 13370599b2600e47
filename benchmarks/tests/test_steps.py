"""`benchmarks/steps.py`: each task's MoH step against its dense config, as rows of steps.json."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import steps

FIELDS = {"config", "baseline", "device", "compile", "asked_compile", "tokens", "ratio", "mfu", "precision",
          "compile_backend", "versions", "moh_graphs", "baseline_graphs", "moh_recompiles", "baseline_recompiles"}


@pytest.mark.slow
def test_steps_rows_are_written_and_replaced_not_repeated(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(steps, "CPU_PAIRS", [("vit_tiny_mnist_75", "vit_tiny_mnist_100", 2, None)])
    for _ in range(2):
        steps.main(["--repeats", "1", "--warmup", "0", "--output", "out/steps.json"])
    (row,) = json.loads((run_dir / "out/steps.json").read_text())
    assert FIELDS <= set(row) and row["config"] == "vit_tiny_mnist_75" and row["baseline"] == "vit_tiny_mnist_100"
    assert row["device"] == "cpu" and row["compile"] is False and row["tokens"] == 17 and row["mfu"] is None
    assert row["precision"] == "32-true" and {"torch", "lightning", "timm"} <= set(row["versions"])
    assert row["moh_graphs"] == row["baseline_graphs"] == 0 and "not_compiled" not in row
    assert row["ratio"] == row["moh_ms"] / row["baseline_ms"] > 0
    assert "| vit_tiny_mnist_75 | vit_tiny_mnist_100 | cpu |" in (run_dir / "out/steps.md").read_text()
    assert "ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_a_row_whose_networks_compiled_no_graph_says_compile_false_and_why(monkeypatch, capsys):
    """The issue's ViT rows: asked compiled, run eagerly, labelled compiled. Here compile_blocks compiles nothing."""
    monkeypatch.setattr(steps, "compile_blocks", lambda model, **kwargs: 0)
    row = steps.step_row("vit_tiny_mnist_75", "vit_tiny_mnist_100", 2, None, torch.device("cpu"), True, 1, 0,
                         "aot_eager")
    assert row["asked_compile"] is True and row["compile"] is False
    assert row["moh_graphs"] == row["baseline_graphs"] == 0
    assert row["not_compiled"] == "vit_tiny_mnist_100: Dynamo compiled no graph; vit_tiny_mnist_75: Dynamo compiled " \
                                  "no graph"
    page = steps.page([row])
    assert "| False (asked, not compiled) |" in page and "asked compiled: vit_tiny_mnist_100: Dynamo" in page


@pytest.mark.slow
def test_a_network_past_the_recompile_limit_is_not_labelled_compiled():
    """The MNIST DiT's blocks have 3 distinct head budgets, so 3 graphs; with a recompile limit of 1 the blocks past
    it run eagerly, and the row says so instead of `compile: true`. Graphs and recompiles are Dynamo's: its ``eager``
    backend counts them as any other, without AOT autograd's tracing (the dry run's compiled rows go through it:
    test_gpu_call.py)."""
    with torch._dynamo.config.patch(recompile_limit=1):  # a config entry: monkeypatch would delete it afterwards
        row = steps.step_row("dit_mnist_75", "dit_mnist_100", 2, None, torch.device("cpu"), True, 1, 1, "eager")
    assert row["asked_compile"] is True and row["compile"] is False and row["moh_graphs"] > 0
    assert "hit the recompile limit and ran eagerly" in row["not_compiled"]


@pytest.mark.slow
def test_compiled_rows_count_each_networks_own_graphs_from_a_reset(monkeypatch):
    """Both networks compile graphs of their own (counters cleared between them), and the token count's no-grad pass
    runs before compiling, so it compiles nothing that is not timed."""
    tokens, graphs_after_tokens = steps._tokens, []

    def counted_tokens(model, inputs):
        seen = tokens(model, inputs)
        graphs_after_tokens.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return seen

    monkeypatch.setattr(steps, "_tokens", counted_tokens)
    row = steps.step_row("llm_stdlib_75", "llm_stdlib_100", 2, 16, torch.device("cpu"), True, 1, 1, "eager")
    assert graphs_after_tokens == [0] and row["tokens"] == 16
    assert row["compile"] is True and "not_compiled" not in row and row["compile_backend"] == "eager"
    assert row["moh_graphs"] >= 1 and row["baseline_graphs"] >= 1


@pytest.mark.parametrize("pair", steps.GPU_PAIRS, ids=lambda pair: pair[0])
def test_every_gpu_pair_names_shipped_configs_of_one_family(pair):
    """The GPU pairs run only on a GPU: their names are checked here, where a typo costs nothing."""
    from moh_lightning.models.dit import DiTConfig
    from moh_lightning.models.llama import LlamaConfig
    from moh_lightning.models.vit import ViTConfig
    from moh_lightning.tools.bench.model_step import _shipped_arch

    moh, dense, _, _ = pair
    family = {"vit": ViTConfig, "dit": DiTConfig, "llm": LlamaConfig}[moh.split("_")[0]]
    assert dense.split("_")[0] == moh.split("_")[0]
    for name in (moh, dense):
        family(**_shipped_arch(name))
