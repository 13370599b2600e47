"""The CPU report's page: its tables, targets, header, prose and plot. Apart from the sections so that what the
page says (each section's introduction, what bounds a missed target) reads in one place, and the sections only
measure."""
from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moh_lightning.tools.bench.shapes import BATCH, FRACTIONS, HEAD_DIM, HEADS, LONG, SHARED

# Why a target can be missed on a CPU, by the target's first words; printed under the targets for each one missed.
BOUNDS = {
    "bidirectional core": (
        "The two shared heads run full SDPA, so only the six routed heads can save work; those pay a gather, a "
        "scatter and padding to the largest selected count over (sequence, head), costs linear in N that matter "
        "less as N grows (compare N = 4096 in the core table)."),
    "causal core": (
        "MHA's causal flash kernel already skips the upper triangle, while gathered queries cannot use `is_causal` "
        "(a slot is not a position). The slots come in blocks of 512 positions: the keys before a block take one "
        "unmasked call, the staircase inside it runs in 64-row chunks with a float mask. Profiled at N = 4096, 50%, "
        "2 threads (forward): the masked staircase is about 14% of the routed heads' attention work but takes twice "
        "the unmasked calls' time per score (40 of 170 ms), padding each block to its largest count over (sequence, "
        "head) adds about 12% rows, and gathering, merging and scattering take most of the rest. A kernel that "
        "takes per-row causal limits (SDPA has no such option) would remove the mask and the padding."),
    "causal layer peak memory": (
        "Flash attention stores only O(N·d) per head for backward, as the sparse path does. The router's gates and "
        "the gated outputs it keeps for their gradient cost what the dense-and-mask column shows (no head skipped); "
        "the sparse path adds its slot positions and the per-part outputs and log-sum-exps it merges."),
    "KV-cache decode core": (
        "A decoding token's selected heads are read as matrix-vector products per (sequence, head) on views of the "
        "cache: gathering the selected rows into one call would copy more than dense attention reads. With one "
        "thread that halves the bytes read; with more, SDPA splits its reads over the cores while the per-pair "
        "products barely do, so with two threads `auto` decodes head-sparse only up to 50% of heads, and with more "
        "(unmeasured) not at all."),
    "llm_stdlib_75": (
        "At 256 tokens the config runs dense-and-mask (every head, gated), which cannot cost less than MHA; the "
        "remainder is the router (one fused projection, softmaxes, top-k, the load-balance statistics), a few "
        "small kernels per layer whose launch cost eager mode cannot hide; `compile: true` fuses them (compare the "
        "compiled table below)."),
    "vit_tiny_mnist_75": (
        "At 17 tokens the router's small kernels are a visible share of a layer whose attention is tiny; nothing is "
        "saved by skipping heads."),
    "vit_s_75": "As for the MNIST ViT: the router's kernels against a 197-token layer.",
}
# Each section's title and introduction; {heads}, {head_dim}, {batch}, {shared} and {long} are the shapes', other
# fields the section's own.
SECTIONS = {
    "op_count": ("Operations per layer step (the CPU proxy of launch cost)", (
        "ATen operations one training step of one layer dispatches (forward, load-balance loss, backward), counted "
        "with `TorchDispatchMode` at width 384, 6 heads, 2 x 64 tokens; MoH has 2 shared + top-2 of 4 routed heads "
        "and the learned router, whose gates and statistics are one registered op each way (`moh::route`), so they "
        "count once, as they launch once on a GPU. At ViT-S / DiT-S sizes a GPU runs about one kernel per "
        "operation, so this count bounds a launch-bound step. The same table is a test "
        "(`tests/layers/test_op_count.py`).")),
    "core": ("Attention core", (
        "h = {heads}, head_dim = {head_dim}, batch {batch}, fp32; {shared} shared heads, the rest routed "
        "(gates of a freshly initialised router on random tokens). Time in ms from q, k, v to the "
        "(B, N, h·d) input of the output projection; MoH columns give the median ms and the speedup over MHA "
        "(multi-head attention, PyTorch SDPA): the median over the rounds of MHA's time / MoH's in the same round "
        "(each round runs every column once). *dense-and-mask* is the authors' formulation (all heads, "
        "gated), at the first fraction, up to N = {long} (it costs what MHA costs). Above N = {long} a run takes "
        "seconds: one warm-up run.")),
    "layer": ("Whole attention layer: what `auto` picks", (
        "qkv projection, router, attention core and output projection, forward + backward, batch {batch}. *auto* is "
        "the layer's own choice of execution (the path it took in brackets); *sparse* and *dense-and-mask* are forced. "
        "Target: auto never picks a path slower than dense-and-mask: the forced time of its pick / dense-and-mask's "
        "(1.00 when it picks dense-and-mask; within 5% for timing noise).")),
    "memory": ("Peak memory", (
        "Whole layer, forward + backward at N = {length}, batch {batch}, 50% heads: peak memory growth in MiB "
        "(method in the header). Target: causal MoH ≤ 1.0 × MHA. *MHA, materialised* forces SDPA's math "
        "backend, which stores the (B, h, N, N) attention matrix as the authors' code and timm's non-fused "
        "path do; PyTorch's default kernel (flash attention) needs no such matrix.")),
    "decode": ("KV-cache decoding", (
        "One new token per sequence (batch {batch}) against a cache of the given length. *core*: attention "
        "time per decoding step (q and the cache to the attention output); *layer*: the whole layer "
        "including qkv, router, cache write and projection, dense-and-mask and head-sparse forced, and *auto*'s "
        "choice (the path it took in brackets; speedups over the MHA layer). Tokens/s = batch / step time. *batched* "
        "is the path for devices other than the CPU (the selected heads' queries and cache rows gathered into one "
        "SDPA call, no loop and no host read); on the CPU the layer decodes per (sequence, head) pair. "
        "Targets: core at 4096 with 50% heads ≥ 1.5× faster than MHA; auto never picks a path slower than "
        "dense-and-mask (the forced time of its pick / dense-and-mask's).")),
    "models": ("Whole models: training step, MoH / dense", (
        "One training step of each shipped config's network (forward, loss + 0.01 × load-balance loss, backward, "
        "AdamW), fp32, the MoH layers in the configs' execution mode (*auto* unless the config says otherwise); "
        "random inputs of the recipe's shape. Each round times every config of a row once, back to back; ratio = "
        "the median over the rounds of MoH step time / the dense config's in the same round, with the quartiles "
        "of those ratios (15 rounds for the CPU defaults, 3 for the large shapes). Targets: MNIST MoH-ViT "
        "≤ 1.05×, embedded LM ≤ 1.02×, MoH-ViT-S ≤ 1.02×. The large shapes use small batches to fit a CPU.")),
    "checkpointing": ("Activation checkpointing", (
        "`--model.init_args.activation_checkpointing true` (every block recomputed in backward): peak memory of one "
        "training step's forward + backward (method in the header) and the step time, without and with. MoH "
        "configs.")),
    "decode_model": ("LLM-S decoding", (
        "LLM-S shape (12 layers, hidden 768, 12 heads of 64, vocab 65,536), batch {batch}: one decoding "
        "step through the KV cache of the given length (caches filled with random keys and values instead of "
        "a prefill), lm_head included; MoH in *auto* mode.")),
    "compiled": ("Compiled vs eager (the CPU defaults)", (
        "`--model.init_args.compile true`: the network compiled in place with `torch.compile` (backend {backend}), "
        "the same training step as above. *compile s*: the first compiled step, compilation included; then "
        "medians of the steady steps. Dense and MoH configs alike.")),
}


@dataclass
class Finding:
    """One measurement of MoH against multi-head attention, for the verdict: ``speedup`` is MHA's time / MoH's (above 1
    MoH is faster), the median over the paired rounds, with the rounds' quartiles ``low`` and ``high``."""

    section: str   # what was timed, leading into ``size``: "attention core at", "training step of", ...
    size: str      # "N = 1024", "a cache of 4096 tokens", a config's name
    heads: str     # the share of heads MoH runs ("50%"), or "" where the size names it
    variant: str   # which of the section's variants ("causal fwd+bwd"), or ""
    speedup: float
    low: float
    high: float


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    core: dict = field(default_factory=dict)     # (causal, backward, fraction) -> [(N, speedup)]
    decode: dict = field(default_factory=dict)   # fraction -> [(cache length, speedup)]
    targets: list[list[str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    shared_machine: str = ""  # how loaded the machine was, when other work shared it (the verdict says so first)

    def finding(self, section: str, size: str, heads: str, variant: str, ratio: tuple[float, float, float]) -> None:
        """Records MHA's time / MoH's (``timing.paired_ratio``'s median and quartiles) for the verdict."""
        self.findings.append(Finding(section, size, heads, variant, *ratio))

    def section(self, key: str, **fields) -> None:
        title, intro = SECTIONS[key]
        text = intro.format(**{"heads": HEADS, "head_dim": HEAD_DIM, "batch": BATCH, "shared": SHARED, "long": LONG,
                               **fields})
        self.lines += [f"## {title}", "", text, ""]

    def target(self, name: str, wanted: str, measured: float, met: bool, note: str = "") -> None:
        self.targets.append([name, wanted, f"{measured:.2f}", ("met" if met else "**missed**") + note])

    def table(self, header: list[str], rows: list[list]) -> None:
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.lines.append("")

    def write(self, path: Path, header: list[str], still_to_measure: list[str] = ()) -> None:
        """The page: ``header``, the targets and what bounds the missed ones, the sections, the verdict; the plot
        beside it. A page written before the sections ``still_to_measure`` says so under its header."""
        summary = Report(lines=["## Targets", ""])
        if self.targets:
            summary.table(["target", "wanted", "measured", ""], self.targets)
        summary.lines += bounds_lines([name for name, _, _, status in self.targets if "missed" in status])
        partial = [f"**Not measured yet:** {', '.join(still_to_measure)} (the bench is still running, or was stopped "
                   f"before them).", ""] if still_to_measure else []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(header + partial + summary.lines + self.lines + self.verdict()) + "\n")
        if self.core or self.decode:
            plot(self, path.with_suffix(".png"))

    def verdict(self) -> list[str]:
        """Where MoH was faster than multi-head attention on this machine, by how much, and where it was not."""
        lines = ["## Verdict", ""]
        groups: dict[tuple[str, str, str], list[Finding]] = {}
        for found in self.findings:
            groups.setdefault((found.section, found.size, found.heads), []).append(found)
        if self.shared_machine:
            lines += [f"{self.shared_machine}: these timings are noisy. Rerun on a quiet machine, or with `--threads 1 "
                      f"--clock cpu` (one thread's work, not the waiting for a core), before trusting them.", ""]
        if not groups:
            return lines + ["Nothing has been timed against multi-head attention yet.", ""]
        faster, other, details = [], [], []
        for (section, size, heads), found in groups.items():
            where = f"{section} {size}" + (f" with {heads} of heads" if heads else "")
            speedups = [f.speedup for f in found]
            span = _span(min(speedups), max(speedups))
            (faster if min(speedups) > 1 else other).append(f"{where} ({span})")
            if min(speedups) > 1:
                word = "faster"
            elif max(speedups) < 1:
                word = "slower"
            else:
                word = "faster only for " + ", ".join(f.variant for f in found if f.speedup > 1)
            spread = _span(min(f.low for f in found), max(f.high for f in found))
            variants = f" over {', '.join(f.variant for f in found)}" if len(found) > 1 else ""
            details.append(f"- {where}: {word}, {span} (rounds' quartiles {spread}){variants}.")
        return lines + [
            "Speedup = multi-head attention's time ÷ MoH's (above 1: MoH is faster), the median of the paired rounds; "
            "a range spans the variants measured (attention kind, pass).", "",
            f"**MoH was faster on this machine** for: {'; '.join(faster) or 'nothing measured'}.", "",
            f"**It was not faster** for: {'; '.join(other) or 'nothing measured'}.", "", *details, ""]


def _span(low: float, high: float) -> str:
    return f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}×"


def bounds_lines(missed: list[str]) -> list[str]:
    """What bounds each kind of missed target (``BOUNDS``), once per kind."""
    kinds = [kind for kind in BOUNDS if any(name.startswith(kind) for name in missed)]
    if not kinds:
        return []
    return ["### What bounds the missed targets", ""] + [f"- **{kind}**: {BOUNDS[kind]}" for kind in kinds] + [""]


def shared_machine(load_before, load_after, threshold: float | None = None) -> str:
    """How loaded the machine was while the bench ran, when other work shared its cores; "" when it was quiet.

    Quiet is a 1-minute load average under ``threshold``: by default 1.5 x torch's threads (the bench's own load).
    """
    load = max(load_before[0], load_after[0])
    if load < (1.5 * torch.get_num_threads() if threshold is None else threshold):
        return ""
    return f"Other work shared this machine (load average up to {load:.1f} on {os.cpu_count()} cores)"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        if found:
            return found.group(1)
    return platform.processor() or platform.machine()


def header(load_before, load_after, seconds: float, command: str, repeats: int, warmup: int,
           cpu_time: bool) -> list[str]:
    """The page's first lines: the command, the machine and how loaded it was, how times and memory were taken."""
    cpu = cpu_name()
    clock = ("process CPU time (the work done; waiting for a core shared with other processes is not counted)"
             if cpu_time else "wall time")
    return [
        "# MoH attention: head-sparse execution vs multi-head attention", "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"in {seconds / 60:.1f} min. Machine: {cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads, CPU only, fp32. Medians of {repeats} runs after {warmup} "
        f"warm-up runs, variants interleaved, each run a `torch.utils.benchmark` `Timer.timeit` (two untimed calls "
        f"before it); {clock}.",
        f"Load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}, after: "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} — "
        f"{'shared with other work: timings are noisy' if shared_machine(load_before, load_after) else 'quiet'}.",
        "Peak memory: resident-set growth of a fresh single-thread process during one forward + backward (VmHWM "
        "after resetting it via /proc/self/clear_refs, minus VmRSS before), glibc mmap threshold fixed at 64 KiB so "
        "freed tensors leave the process.", "",
    ]


def plot(report: Report, path: Path) -> None:
    """Core speedup against N for each attention and pass, and the decode core's against the cache length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    panels = [(False, False), (False, True), (True, False), (True, True)]
    for ax, (causal, backward) in zip(axes, panels, strict=False):
        for (c, b, name), points in report.core.items():
            if (c, b) != (causal, backward):
                continue
            xs, ys = zip(*points, strict=True)
            ideal = HEADS / (SHARED + FRACTIONS[name])
            line, = ax.plot(xs, ys, marker="o", label=f"MoH {name} (ideal {ideal:.2f}×, dashed)")
            ax.axhline(ideal, color=line.get_color(), ls="--", lw=0.8)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{'causal' if causal else 'bidirectional'} core, {'fwd+bwd' if backward else 'fwd'}")
        ax.set_xlabel("N")
        ax.set_ylabel("speedup over MHA")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for name, points in report.decode.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=f"MoH {name}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title("KV-cache decode core")
    ax.set_xlabel("cache length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
