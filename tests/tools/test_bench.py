"""``moh bench`` for a user: it says what it measures and where it writes, writes into a folder of its own, rewrites
its page as each section finishes, and ends the page and the terminal with a verdict in words."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moh_lightning.tools.bench as bench_module
from moh_lightning.tools.bench import bench


@pytest.mark.slow
def test_bench_quick_prints_progress_its_page_and_a_verdict(run_dir, capsys, monkeypatch):
    # The same code at a fraction of the work: the core table at 128 and 256 tokens where the quick bench asks for 128
    # and 1,024 (what it asks is asserted), the layer and decoding tables at their shortest length and cache only.
    core_section, layer_section, decode_section = (bench_module.core_section, bench_module.layer_section,
                                                   bench_module.decode_section)
    asked = []

    def shorter_core(report, timer, lengths, *args, **kwargs):
        asked.append(lengths)
        core_section(report, timer, (lengths[0], 256), *args, **kwargs)
    monkeypatch.setattr(bench_module, "core_section", shorter_core)
    monkeypatch.setattr(bench_module, "layer_section",
                        lambda report, timer, lengths, *args: layer_section(report, timer, (128,), *args))
    monkeypatch.setattr(bench_module, "decode_section",
                        lambda report, timer, caches, *args: decode_section(report, timer, caches[:1], *args))
    threads = torch.get_num_threads()
    try:
        path = bench(quick=True, threads=1)
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert path.parent.parent == Path("bench") and path.name == "bench_attention.md"  # never over results/
    assert "moh bench: [5/5] whole models' training steps ..." in printed and f"moh bench: wrote {path}" in printed
    text = path.read_text()
    assert asked == [(128, 1024)]  # 1,024: a length where the CPU's head-sparse path may win
    assert "| bidirectional | 256 | fwd |" in text and "## KV-cache decoding" in text and "## Targets" in text
    verdict = text[text.index("## Verdict"):]
    assert "attention core at N = 256 with 50% of heads" in verdict
    assert "training step of vit_tiny_mnist_75 (dense: vit_tiny_mnist_100)" in verdict
    assert verdict.strip() in printed  # the terminal ends with the page's verdict
    assert path.with_suffix(".png").is_file()


def _core(report, *args, **kwargs) -> None:
    report.section("core")
    report.table(["attention", "N"], [["causal", 1024]])
    report.finding("attention core at", "N = 1024", "50%", "causal fwd", (1.5, 1.4, 1.6))
    report.finding("attention core at", "N = 1024", "50%", "causal fwd+bwd", (1.25, 1.2, 1.3))
    report.finding("attention core at", "N = 128", "50%", "causal fwd", (0.8, 0.7, 0.9))


def _stopped(*args, **kwargs) -> None:
    raise KeyboardInterrupt


def test_a_stopped_bench_leaves_the_sections_it_measured_with_their_verdict(run_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_module, "op_count_section", lambda report: None)
    monkeypatch.setattr(bench_module, "core_section", _core)
    monkeypatch.setattr(bench_module, "layer_section", _stopped)
    with pytest.raises(KeyboardInterrupt):
        bench(quick=True, output="page.md")
    assert "moh bench: 5 sections, each written to page.md as it finishes" in capsys.readouterr().out
    text = Path("page.md").read_text()
    assert ("**Not measured yet:** whole attention layer, KV-cache decoding, whole models' training steps (the bench "
            "is still running, or was stopped before them).") in text
    assert "| causal | 1024 |" in text
    assert "**MoH was faster on this machine** for: attention core at N = 1024 with 50% of heads (1.25–1.50×)." in text
    assert "**It was not faster** for: attention core at N = 128 with 50% of heads (0.80×)." in text
    assert ("- attention core at N = 1024 with 50% of heads: faster, 1.25–1.50× (rounds' quartiles 1.20–1.60×) over "
            "causal fwd, causal fwd+bwd.") in text
    assert "- attention core at N = 128 with 50% of heads: slower, 0.80× (rounds' quartiles 0.70–0.90×)." in text
