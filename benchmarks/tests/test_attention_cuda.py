"""``benchmarks/attention_cuda.py``, the GPU report of the CUDA head-sparse backend: its harness on the CPU."""
from types import SimpleNamespace

import pytest
import torch

from benchmarks import attention_cuda


def _explained(layer):
    """``torch._dynamo.explain`` as far as the report reads it: the head-sparse layer's breaks as Dynamo gives them.
    Dynamo's capture of that layer and its breaks are test_speed_switches.py's (its sparse path); here, 8 s of it."""
    reason = SimpleNamespace(reason="Data dependent operator\n  Explanation: ...")
    return lambda x: SimpleNamespace(graph_break_count=3, break_reasons=[reason] * 3)


@pytest.mark.slow
def test_bench_cuda_quick_writes_every_table(tmp_path, monkeypatch):
    """The GPU report's harness, smoke-tested on the CPU (its head-sparse cells go through the CPU backend there), with
    heads of 8 channels instead of 64: the same tables, an eighth of the work."""
    monkeypatch.setattr(attention_cuda, "HEAD_DIM", 8)
    monkeypatch.setattr(torch._dynamo, "explain", _explained)
    text = attention_cuda.bench_cuda(str(tmp_path / "cuda.md"), dtype="float32", quick=True, device="cpu").read_text()
    for section in ("## Targets", "## Attention core", "## Whole MoH layer", "## Decoding one token",
                    "## torch.compile", "CUDA_SPARSE = {"):
        assert section in text
    assert "| 128 |" in text and "half the heads" in text and "16 heads of 8" in text
    assert "- causal head-sparse layer: 3 graph breaks (Data dependent operator)." in text


def test_bench_on_cuda_without_a_gpu_says_so(run_dir):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit, match="torch sees no CUDA device"):
        attention_cuda.main([])
