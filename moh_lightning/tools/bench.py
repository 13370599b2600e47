"""``moh bench``: MoH's head-sparse execution and whole MoH models against dense multi-head attention, timed here.

Writes a markdown report and a plot beside it. Every time is the median of repeated runs after warm-up, with
the compared variants interleaved run by run so that load from other processes hits them alike. On the CPU, peak
memory is the resident-set growth of a fresh process (its high-water mark reset through ``/proc/self/clear_refs``)
with glibc's mmap threshold fixed at 64 KiB, so every freed tensor returns to the OS: torch's CPU allocator keeps no
statistics, and tracemalloc does not see its allocations. On a GPU (``--device cuda``) the same tables are timed with
the device synchronised and peak memory is the CUDA allocator's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moh_lightning.configs import load_config
from moh_lightning.layers import KVCache, MoHAttention, MoHRouter, pop_load_balance_loss
from moh_lightning.layers.head_sparse_attention import _decode_batched, head_sparse_attention
from moh_lightning.layers.moh_attention import checkpoint_blocks

HEADS, HEAD_DIM, BATCH, SHARED = 8, 64, 4, 2
# Activated fraction -> routed top-k with 2 shared of 8 heads; 90% is not a whole number of 8 heads, so the
# nearest, 7 of 8, stands for it.
FRACTIONS = {"50%": 2, "75%": 4, "88%": 5}
LONG = 1024  # longer sequences get one warm-up run and no dense-and-mask column
# The speed targets for the attention core: (causal, N, fraction) -> minimum speedup over MHA.
CORE_TARGETS = {(True, 4096, "50%"): 1.8, (True, 1024, "50%"): 1.7, (True, 4096, "75%"): 1.25,
                (False, 1024, "50%"): 1.75}
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
# Whole-model training steps: (family, batch, per-family shape note, configs: dense baseline first, target ratio).
MODELS = [
    ("vit", 128, "MNIST, 28x28, 16 patches + class token",
     ["vit_tiny_mnist_100", "vit_tiny_mnist_75", "vit_tiny_mnist_50"], 1.05),
    ("dit", 16, "MNIST pixels 32x32, 64 tokens", ["dit_mnist_100", "dit_mnist_90", "dit_mnist_75"], None),
    ("llm", 16, "256 tokens", ["llm_stdlib_100", "llm_stdlib_75", "llm_stdlib_50"], 1.02),
    ("vit", 8, "224x224, 197 tokens", ["vit_s_100", "vit_s_75"], 1.02),
    ("dit", 8, "32x32x4 latents, 256 tokens", ["dit_s2_100", "dit_s2_90", "dit_s2_75"], None),
    ("llm", 1, "1,024 tokens (the configs train 2,048)", ["llm_s_100", "llm_s_75", "llm_s_50"], None),
]
CPU_DEFAULTS = MODELS[:3]


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    core: dict = field(default_factory=dict)     # (causal, backward, fraction) -> [(N, speedup)]
    decode: dict = field(default_factory=dict)   # fraction -> [(cache length, speedup)]
    targets: list[list[str]] = field(default_factory=list)

    def target(self, name: str, wanted: str, measured: float, met: bool, note: str = "") -> None:
        self.targets.append([name, wanted, f"{measured:.2f}", ("met" if met else "**missed**") + note])

    def table(self, header: list[str], rows: list[list]) -> None:
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.lines.append("")


@dataclass
class Clock:
    """Where and how the runs are timed: the device (synchronised before reading a GPU's clock) and the clock."""

    device: torch.device
    cpu_time: bool = False  # process CPU time instead of wall time (CPU only): steadier when the cores are shared

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.process_time() if self.cpu_time else time.perf_counter()


def bench(quick: bool = False, output: str | None = None, repeats: int = 5, warmup: int = 2,
          models: bool = True, compiled: bool = True, threads: int | None = None, device: str = "cpu",
          clock: str = "wall", compile_backend: str = "inductor") -> Path:
    """Benchmark MoH attention (head-sparse execution) and MoH models against dense multi-head attention.

    Args:
        quick: A small subset (N = 128, 50% heads, a 256-token cache, the MNIST ViT's step only) for smoke tests.
        output: Markdown report; the plot goes beside it as ``<stem>.png``. By default
            ``results/bench_attention.md``, on CUDA ``results/bench_attention_cuda.md``.
        repeats: Timed runs per measurement (the median is reported).
        warmup: Untimed runs before them.
        models: Include the whole-model tables (training steps of every shipped CPU default and of the ViT-S,
            DiT-S/2 and LLM-S shapes, activation-checkpointing memory, LLM-S decoding).
        compiled: Include the compiled-vs-eager table of the three CPU defaults (minutes of compilation).
        threads: torch's intra-op threads; its default (one per core) when None.
        device: ``cpu``, or ``cuda`` for the GPU report (``bench_cuda``: bf16, the CUDA head-sparse kernels against
            SDPA over all and over half of the heads; ``quick`` is the only other option it reads).
        clock: ``wall`` (elapsed time) or ``cpu`` (the process's CPU time: steadier on a shared machine; ratios
            between variants compare the work done, not the waiting).
        compile_backend: ``torch.compile`` backend of the compiled table (``aot_eager`` compiles in seconds).
    """
    if clock not in ("wall", "cpu"):
        raise SystemExit(f"moh bench: --clock {clock!r}: choose wall or cpu.")
    run_on = torch.device(device)
    if run_on.type == "cuda":
        from moh_lightning.tools.bench_cuda import bench_cuda

        return bench_cuda(output or "results/bench_attention_cuda.md", quick=quick, device=device)
    output = output or "results/bench_attention.md"
    if clock == "cpu" and run_on.type != "cpu":
        raise SystemExit("moh bench: --clock cpu times CPU work; on a GPU use the wall clock.")
    torch.manual_seed(0)
    if threads is not None:
        torch.set_num_threads(threads)
    if quick:
        repeats, warmup = 2, 1
    timer = Clock(run_on, clock == "cpu")
    lengths = (128,) if quick else (256, 1024, 4096)
    fractions = {"50%": 2} if quick else FRACTIONS
    caches = (256,) if quick else (1024, 2048, 4096, 8192)
    report = Report()
    load_before = os.getloadavg()
    started = time.time()
    _core_section(report, timer, lengths, fractions, repeats, warmup)
    _layer_section(report, timer, lengths[:1] if quick else (256, 1024), fractions, repeats, warmup)
    _memory_section(report, run_on, lengths[-1])
    _decode_section(report, timer, caches, fractions, repeats, warmup)
    if models or quick:
        _model_section(report, timer, MODELS[:1] if quick else MODELS, repeats, warmup, quick)
    if models and not quick:
        _checkpointing_section(report, timer, repeats, warmup)
        _decode_model_section(report, timer, repeats, warmup)
    if compiled and not quick:
        _compiled_section(report, timer, repeats, warmup, compile_backend)
    load_after = os.getloadavg()
    options = {"quick": quick, "repeats": repeats, "warmup": warmup, "models": models, "compiled": compiled,
               "threads": threads, "device": device, "clock": clock, "compile_backend": compile_backend}
    defaults = {"quick": False, "repeats": 5, "warmup": 2, "models": True, "compiled": True, "threads": None,
                "device": "cpu", "clock": "wall", "compile_backend": "inductor"}
    command = " ".join(["moh bench"] + [f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
                                        for k, v in options.items() if v != defaults[k] and k != "quick"])
    command = "moh bench --quick true" if quick else command
    header = _machine(load_before, load_after, time.time() - started, command, repeats, warmup, timer)
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = ["## Targets", ""]
    if report.targets:
        summary_report = Report()
        summary_report.table(["target", "wanted", "measured", ""], report.targets)
        summary += summary_report.lines
    summary += bounds_lines([name for name, _, _, status in report.targets if "missed" in status])
    path.write_text("\n".join(header + summary + report.lines))
    _plot(report, path.with_suffix(".png"))
    return path


def bounds_lines(missed: list[str]) -> list[str]:
    """What bounds each kind of missed target (``BOUNDS``), once per kind."""
    kinds = [kind for kind in BOUNDS if any(name.startswith(kind) for name in missed)]
    if not kinds:
        return []
    return ["### What bounds the missed targets", ""] + [f"- **{kind}**: {BOUNDS[kind]}" for kind in kinds] + [""]


def _times_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, timer: Clock) -> dict[str, list]:
    """Every timed run of each function in ms, round by round; each round runs every function once."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = timer.now()
            fn()
            times[name].append((timer.now() - start) * 1e3)
    return times


def _median_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, timer: Clock) -> dict[str, float]:
    """Median time of each function; runs alternate between the functions."""
    return {name: statistics.median(t) for name, t in _times_ms(fns, repeats, warmup, timer).items()}


def _paired_ratio(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios ``times / base``: the two ran back to back in each round, so
    a slow spell of the machine hits both, where a ratio of the two medians would carry it."""
    ratios = sorted(t / b for t, b in zip(times, base))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), quartiles[0], quartiles[2]


def _gates(length: int, top_k: int, device: torch.device, batch: int = BATCH, seed: int = 0) -> torch.Tensor:
    """Gates of a freshly initialised MoH router on random tokens: roughly balanced routing."""
    torch.manual_seed(seed)
    router = MoHRouter(HEADS * HEAD_DIM, HEADS, SHARED, top_k)
    with torch.no_grad():
        return router(torch.randn(batch, length, HEADS * HEAD_DIM)).gates.to(device)


def _core_fns(length: int, causal: bool, fractions: dict[str, int], backward: bool,
              device: torch.device) -> dict[str, Callable]:
    """The attention core, from q, k, v (and gates) to the (B, N, h * d) input of the output projection."""
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, device=device, requires_grad=backward) for _ in range(3))
    gates = {name: _gates(length, top_k, device).requires_grad_(backward) for name, top_k in fractions.items()}
    grad = torch.randn(BATCH, length, HEADS * HEAD_DIM, device=device)
    leaves = [q, k, v, *gates.values()]

    def run(out: torch.Tensor) -> None:
        if backward:
            out.backward(grad)
            for t in leaves:
                t.grad = None

    def dense() -> None:
        run(F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(grad.shape))

    def masked(g: torch.Tensor) -> Callable:
        return lambda: run((F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
                            * g[..., None]).reshape(grad.shape))

    def sparse(g: torch.Tensor) -> Callable:
        return lambda: run(head_sparse_attention(q, k, v, g, SHARED, causal=causal).reshape(grad.shape))

    fns = {"MHA": dense}
    if length <= LONG:
        fns["dense-and-mask"] = masked(next(iter(gates.values())))
    fns.update({name: sparse(g) for name, g in gates.items()})
    return fns


def _core_section(report: Report, timer: Clock, lengths, fractions, repeats, warmup) -> None:
    report.lines += [
        "## Attention core", "",
        f"h = {HEADS}, head_dim = {HEAD_DIM}, batch {BATCH}, fp32; {SHARED} shared heads, the rest routed "
        "(gates of a freshly initialised router on random tokens). Time in ms from q, k, v to the "
        "(B, N, h·d) input of the output projection; MoH columns give the median ms and the speedup over MHA "
        "(multi-head attention, PyTorch SDPA): the median over the rounds of MHA's time / MoH's in the same round "
        "(each round runs every column once). *dense-and-mask* is the authors' formulation (all heads, "
        f"gated), at the first fraction, up to N = {LONG} (it costs what MHA costs). Above N = {LONG} a run takes "
        "seconds: one warm-up run.", "",
    ]
    rows = []
    for causal in (False, True):
        for length in lengths:
            for backward in (False, True):
                runs = (repeats, warmup) if length <= LONG else (repeats, min(warmup, 1))
                times = _times_ms(_core_fns(length, causal, fractions, backward, timer.device), *runs, timer)
                ms = {name: statistics.median(t) for name, t in times.items()}
                masked = f"{ms['dense-and-mask']:.1f}" if "dense-and-mask" in ms else "—"
                row = ["causal" if causal else "bidirectional", length,
                       "fwd+bwd" if backward else "fwd", f"{ms['MHA']:.1f}", masked]
                for name, top_k in fractions.items():
                    speedup, low, high = _paired_ratio(times["MHA"], times[name])
                    ideal = HEADS / (SHARED + top_k)
                    row.append(f"{ms[name]:.1f} ({speedup:.2f}×, ideal {ideal:.2f}×)")
                    wanted = CORE_TARGETS.get((causal, length, name))
                    if wanted is not None:
                        report.target(f"{'causal' if causal else 'bidirectional'} core, N = {length}, "
                                      f"{'fwd+bwd' if backward else 'fwd'}, MoH {name}", f"≥ {wanted:.2f}×",
                                      speedup, speedup >= wanted, f" (rounds' quartiles {low:.2f}-{high:.2f})")
                    report.core.setdefault((causal, backward, name), []).append((length, speedup))
                rows.append(row)
    report.table(["attention", "N", "pass", "MHA ms", "dense-and-mask ms"] + [f"MoH {n}" for n in fractions], rows)


def _layer(causal: bool, dense: bool, execution: str = "auto", top_k: int = 2,
           device: torch.device | str = "cpu") -> MoHAttention:
    """The benchmarked layer: MHA (``dense``) or MoH with 2 shared heads and ``top_k`` routed ones."""
    torch.manual_seed(0)
    return MoHAttention(HEADS * HEAD_DIM, HEADS, num_shared_heads=0 if dense else SHARED,
                        top_k=None if dense else top_k, dense=dense, causal=causal, execution=execution,
                        device=device)


def _execution_layers(causal: bool, fractions: dict[str, int], device: torch.device) -> dict[str, MoHAttention]:
    """MHA, and for each fraction the MoH layer under each execution, named ``"<fraction> auto|sparse|masked"``."""
    layers = {"MHA": _layer(causal, True, device=device)}
    for name, top_k in fractions.items():
        for execution in ("auto", "sparse", "masked"):
            layers[f"{name} {execution}"] = _layer(causal, False, execution, top_k, device)
    return layers


def _execution_cells(ms: dict[str, float], name: str, auto: MoHAttention, num_queries: int, num_keys: int,
                     decoding: bool, digits: int) -> tuple[float, list[str]]:
    """One fraction of ``_execution_layers``' timings: auto's pick scored against dense-and-mask (the forced time of
    the path it picks / dense-and-mask's, 1.00 when it picks dense-and-mask, since timing one path twice differs
    by up to 9% here), and the dense-and-mask, sparse and auto cells with their speedups over MHA."""
    gates = torch.ones(1, device=next(auto.parameters()).device)
    picked = "sparse" if auto._head_sparse(gates, num_queries, num_keys, decoding, auto.causal) else "masked"
    cells = [f"{ms[f'{name} {e}']:.{digits}f} ({ms['MHA'] / ms[f'{name} {e}']:.2f}×{f', {picked}' * (e == 'auto')})"
             for e in ("masked", "sparse", "auto")]
    return ms[f"{name} {picked}"] / ms[f"{name} masked"], cells


def _layer_section(report: Report, timer: Clock, lengths, fractions, repeats, warmup) -> None:
    report.lines += [
        "## Whole attention layer: what `auto` picks", "",
        "qkv projection, router, attention core and output projection, forward + backward, batch 4. *auto* is the "
        "layer's own choice of execution (the path it took in brackets); *sparse* and *dense-and-mask* are forced. "
        "Target: auto never picks a path slower than dense-and-mask: the forced time of its pick / dense-and-mask's "
        "(1.00 when it picks dense-and-mask; within 5% for timing noise).", "",
    ]
    rows, worst = [], (0.0, "")
    for causal in (False, True):
        for length in lengths:
            x = torch.randn(BATCH, length, HEADS * HEAD_DIM, device=timer.device, requires_grad=True)
            layers = _execution_layers(causal, fractions, timer.device)
            fns = {name: (lambda layer=layer: layer(x).sum().backward()) for name, layer in layers.items()}
            ms = _median_ms(fns, repeats, warmup, timer)
            for name in fractions:
                ratio, cells = _execution_cells(ms, name, layers[f"{name} auto"], length, length, False, 1)
                label = f"{'causal' if causal else 'bidirectional'}, N = {length}, MoH {name}"
                worst = max(worst, (ratio, label))
                rows.append(["causal" if causal else "bidirectional", length, name, f"{ms['MHA']:.1f}", *cells])
    report.target(f"auto's pick / dense-and-mask layer time, worst cell ({worst[1]})", "≤ 1.05×", worst[0],
                  worst[0] <= 1.05)
    report.table(["attention", "N", "heads", "MHA ms", "dense-and-mask", "sparse", "auto"], rows)


def _peak_mib(device: torch.device, *args: str) -> float:
    """Peak memory in MiB of one measurement: a fresh process on the CPU (see the module docstring), the CUDA
    allocator's peak in this process on a GPU."""
    if device.type == "cuda":
        return _measure_peak(_parse_peak(list(args) + ["--device", str(device)]))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    command = [sys.executable, "-m", "moh_lightning.tools.bench", "peak-memory", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _measure_peak(args: argparse.Namespace) -> float:
    """The measurement's side of ``_peak_mib``: memory growth in MiB of one forward + backward, of an attention
    layer or of a model's training step (``--model``).

    On the CPU only meaningful as the first measurement of a fresh process started with ``_peak_mib``'s malloc
    settings.
    """
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.model:
        model, inputs, loss_fn = model_step_parts(args.model, args.batch, device, args.seq_len)
        if args.checkpointing:
            checkpoint_blocks(model)

        def run(small: bool = False):  # a whole step to warm up too: freed memory leaves the process
            loss = loss_fn(model(*inputs))
            balance = pop_load_balance_loss(model)
            (loss if balance is None else loss + 0.01 * balance).backward()
        module = model
    else:
        module = _layer(args.causal, args.dense, args.execution, device=device)
        x = torch.randn(BATCH, args.length, HEADS * HEAD_DIM, device=device, requires_grad=True)

        def run(small: bool = False):
            module(x[:, :64] if small else x).sum().backward()

    def backend():
        return sdpa_kernel(SDPBackend.MATH) if args.materialised else contextlib.nullcontext()

    with backend():
        run(small=True)  # lazy initialisation outside the measurement
    module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with backend():
            run()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    with backend():
        run()
    return (_status_kib("VmHWM") - before) / 1024


def _status_kib(key: str) -> int:
    """A KiB entry of ``/proc/self/status`` (VmRSS: resident now; VmHWM: resident high-water mark)."""
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _memory_section(report: Report, device: torch.device, length: int) -> None:
    report.lines += [
        "## Peak memory", "",
        f"Whole layer, forward + backward at N = {length}, batch {BATCH}, 50% heads: peak memory growth in MiB "
        "(method in the header). Target: causal MoH ≤ 1.0 × MHA. *MHA, materialised* forces SDPA's math "
        "backend, which stores the (B, h, N, N) attention matrix as the authors' code and timm's non-fused "
        "path do; PyTorch's default kernel (flash attention) needs no such matrix.", "",
    ]
    rows = []
    for causal in (False, True):
        flags = ["--length", str(length)] + (["--causal"] if causal else [])
        mha = _peak_mib(device, *flags, "--dense")
        materialised = _peak_mib(device, *flags, "--dense", "--materialised") if length <= 4096 else float("nan")
        sparse = _peak_mib(device, *flags, "--execution", "sparse")
        masked = _peak_mib(device, *flags, "--execution", "masked")
        rows.append(["causal" if causal else "bidirectional", length, f"{mha:.0f}", f"{materialised:.0f}",
                     f"{sparse:.0f} ({sparse / mha:.2f}×, {sparse / materialised:.2f}×)",
                     f"{masked:.0f} ({masked / mha:.2f}×)"])
        if causal:
            report.target(f"causal layer peak memory, fwd+bwd, N = {length}, MoH 50% / MHA", "≤ 1.00×",
                          sparse / mha, sparse / mha <= 1.0)
    report.table(["attention", "N", "MHA MiB", "MHA, materialised MiB", "MoH 50% sparse (vs MHA, vs materialised)",
                  "MoH 50% dense-and-mask"], rows)


def _decode_section(report: Report, timer: Clock, caches, fractions, repeats, warmup) -> None:
    device = timer.device
    report.lines += [
        "## KV-cache decoding", "",
        f"One new token per sequence (batch {BATCH}) against a cache of the given length. *core*: attention "
        "time per decoding step (q and the cache to the attention output); *layer*: the whole layer "
        "including qkv, router, cache write and projection, dense-and-mask and head-sparse forced, and *auto*'s "
        "choice (the path it took in brackets; speedups over the MHA layer). Tokens/s = batch / step time. *batched* "
        "is the path for devices other than the CPU (the selected heads' queries and cache rows gathered into one "
        "SDPA call, no loop and no host read); on the CPU the layer decodes per (sequence, head) pair. "
        "Targets: core at 4096 with 50% heads ≥ 1.5× faster than MHA; auto never picks a path slower than "
        "dense-and-mask (the forced time of its pick / dense-and-mask's).", "",
    ]
    rows, worst = [], (0.0, "")
    steps = repeats * 10  # a decoding step is short: time more of them
    for length in caches:
        q = torch.randn(BATCH, HEADS, 1, HEAD_DIM, device=device)
        gates = {"MHA": None, "all heads": torch.ones(BATCH, 1, HEADS, device=device)}
        gates.update({name: _gates(1, top_k, device, seed=length) for name, top_k in fractions.items()})
        first = next(iter(fractions))
        gates[f"{first} batched"] = gates[first]
        fns = {}
        for name, g in gates.items():
            # Each variant reads its own cache, as a decoder's layers do: one variant's reads must not leave
            # the next one's cache rows in the CPU's last-level cache.
            k, v = (torch.randn(BATCH, HEADS, length + 1, HEAD_DIM, device=device)[:, :, :length] for _ in range(2))
            if g is None:
                fns[name] = lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v)
            elif name.endswith("batched"):
                fns[name] = lambda k=k, v=v, g=g: _decode_batched(q, k, v, g, 1, None, SHARED + fractions[first])
            else:
                # "all heads": every head through the sparse decoding, which separates its kernel from the
                # skipped heads.
                shared = HEADS if name == "all heads" else SHARED
                active = HEADS if name == "all heads" else SHARED + fractions[name]
                fns[name] = lambda k=k, v=v, g=g, shared=shared, active=active: head_sparse_attention(
                    q, k, v, g, shared, causal=True, offset=length - 1, active_heads=active)
        with torch.no_grad():
            core = _median_ms(fns, steps, warmup, timer)
        x = torch.randn(BATCH, 1, HEADS * HEAD_DIM, device=device)
        layers = _execution_layers(True, fractions, device)
        layer_fns = {}
        for name, layer in layers.items():
            cache = KVCache(BATCH, HEADS, length + 1, HEAD_DIM, device=device)
            cache.k.normal_(), cache.v.normal_()

            def step(layer=layer.eval(), cache=cache):
                cache.length = length - 1
                layer(x, kv_cache=cache)
            layer_fns[name] = step
        with torch.no_grad():
            whole = _median_ms(layer_fns, steps, warmup, timer)
        for name in core:
            label = {"MHA": "MHA", "all heads": "MHA, sparse decoding of every head"}.get(name, f"MoH {name}")
            layer_cells = ["—"] * 4
            if name == "MHA":
                layer_cells = [f"{whole['MHA']:.3f}", "—", "—", f"{BATCH / whole['MHA'] * 1e3:.0f}"]
            elif name in fractions:
                ratio, layer_cells = _execution_cells(whole, name, layers[f"{name} auto"], 1, length, True, 3)
                worst = max(worst, (ratio, f"cache {length}, MoH {name}"))
                layer_cells.append(f"{BATCH / whole[f'{name} auto'] * 1e3:.0f}")
            rows.append([length, label, f"{core[name]:.3f} ({core['MHA'] / core[name]:.2f}×)",
                         f"{BATCH / core[name] * 1e3:.0f}", *layer_cells])
            if name in fractions:
                report.decode.setdefault(name, []).append((length, core["MHA"] / core[name]))
        if length == 4096 and "50%" in core:
            speedup = core["MHA"] / core["50%"]
            report.target("KV-cache decode core, cache 4096, MoH 50%", "≥ 1.50×", speedup, speedup >= 1.5)
    report.target(f"auto's pick / dense-and-mask decoding layer time, worst cell ({worst[1]})", "≤ 1.05×", worst[0],
                  worst[0] <= 1.05)
    report.table(["cache", "attention", "core ms/step (speedup)", "core tokens/s", "layer ms/step: MHA, dense-and-mask",
                  "layer, sparse", "layer, auto", "layer tokens/s (auto)"], rows)


def _shipped_arch(name: str) -> dict:
    """``model.init_args.arch`` of a shipped config with everything it ``extends`` deep-merged under it."""
    config = load_config(f"{name}.yaml")
    return ((config.get("model") or {}).get("init_args") or {}).get("arch") or {}


def model_step_parts(name: str, batch: int, device: torch.device, seq_len: int | None = None):
    """(model in training mode, inputs, loss of the output) of one training step of a shipped config's network."""
    from moh_lightning.models.dit import DiT, DiTConfig
    from moh_lightning.models.llama import LlamaConfig, MoHLlama
    from moh_lightning.models.vit import ViTConfig, create_vit

    arch = _shipped_arch(name)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name.startswith("vit"):
        config = ViTConfig(**arch)
        model = create_vit(config)
        images = torch.randn(batch, config.in_chans, config.img_size, config.img_size, generator=generator)
        labels = torch.randint(0, config.num_classes, (batch,), generator=generator)
        inputs, target = (images.to(device),), labels.to(device)

        def loss_fn(out):
            return F.cross_entropy(out, target)
    elif name.startswith("dit"):
        config = DiTConfig(**arch)
        model = DiT(config)
        x = torch.randn(batch, config.in_chans, config.input_size, config.input_size, generator=generator)
        t = torch.randint(0, 1000, (batch,), generator=generator)
        y = torch.randint(0, config.num_classes, (batch,), generator=generator)
        noise = torch.randn(x.shape, generator=generator).to(device)
        inputs = (x.to(device), t.to(device), y.to(device))

        def loss_fn(out):  # DiT's eps-MSE (the variance term is a few more elementwise operations)
            return F.mse_loss(out[:, :config.in_chans], noise)
    else:
        config = LlamaConfig(**arch)
        model = MoHLlama(config)
        length = seq_len or config.block_size
        tokens = torch.randint(0, config.vocab_size, (batch, length + 1), generator=generator).to(device)
        inputs = (tokens[:, :-1],)

        def loss_fn(out):
            return F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten())
    return model.to(device).train(), inputs, loss_fn


def _train_step(model, inputs, loss_fn) -> Callable[[], None]:
    """One training step as the tasks run it: loss plus 0.01 x the load-balance loss, backward, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs))
        balance = pop_load_balance_loss(model)
        (loss if balance is None else loss + 0.01 * balance).backward()
        optimizer.step()
    return step


def _seq_len(family: str, batch: int) -> int | None:
    return 1024 if family == "llm" and batch == 1 else None


def _model_section(report: Report, timer: Clock, models, repeats: int, warmup: int, quick: bool) -> None:
    report.lines += [
        "## Whole models: training step, MoH / dense", "",
        "One training step of each shipped config's network (forward, loss + 0.01 × load-balance loss, backward, "
        "AdamW), fp32, the MoH layers in the configs' execution mode (*auto* unless the config says otherwise); "
        "random inputs of the recipe's shape. Each round times every config of a row once, back to back; ratio = "
        "the median over the rounds of MoH step time / the dense config's in the same round, with the quartiles "
        "of those ratios (15 rounds for the CPU defaults, 3 for the large shapes). Targets: MNIST MoH-ViT "
        "≤ 1.05×, embedded LM ≤ 1.02×, MoH-ViT-S ≤ 1.02×. The large shapes use small batches to fit a CPU.", "",
    ]
    rows = []
    for family, batch, shape, names, wanted in models:
        if quick:
            names = names[:2]
        steps = {name: _train_step(*model_step_parts(name, batch, timer.device, _seq_len(family, batch)))
                 for name in names}
        heavy = family == "llm" and batch == 1 or names[0] in ("vit_s_100", "dit_s2_100")
        # The CPU defaults' targets are a few percent: three times the rounds.
        runs = (3 * repeats, warmup) if not heavy else (max(3, (repeats + 1) // 2), 1)
        times = _times_ms(steps, *runs, timer)
        for name in names:
            ratio, low, high = _paired_ratio(times[name], times[names[0]])
            rows.append([name, f"batch {batch}, {shape}", f"{statistics.median(times[name]):.1f}",
                         f"{ratio:.3f}× [{low:.3f}, {high:.3f}]"])
            if name == names[1] and wanted is not None:
                report.target(f"{name} / {names[0]} training step", f"≤ {wanted:.2f}×", ratio, ratio <= wanted,
                              f" (rounds' quartiles {low:.2f}-{high:.2f})")
    report.table(["config", "input", "step ms", "vs dense (median of the rounds' ratios [quartiles])"], rows)


def _checkpointing_section(report: Report, timer: Clock, repeats: int, warmup: int) -> None:
    report.lines += [
        "## Activation checkpointing", "",
        "`--model.init_args.activation_checkpointing true` (every block recomputed in backward): peak memory of one "
        "training step's forward + backward (method in the header) and the step time, without and with. MoH "
        "configs.", "",
    ]
    rows = []
    cases = [(family, batch, names[1]) for family, batch, _, names, _ in MODELS if names[0] != "llm_s_100"]
    for family, batch, name in cases:
        args = ["--model", name, "--batch", str(batch)]
        seq_len = _seq_len(family, batch)
        if seq_len:
            args += ["--seq_len", str(seq_len)]
        plain, saved = _peak_mib(timer.device, *args), _peak_mib(timer.device, *args, "--checkpointing")
        model, inputs, loss_fn = model_step_parts(name, batch, timer.device, seq_len)
        checkpointed = model_step_parts(name, batch, timer.device, seq_len)
        checkpoint_blocks(checkpointed[0])
        heavy = name in ("vit_s_75", "dit_s2_90")
        ms = _median_ms({"plain": _train_step(model, inputs, loss_fn), "checkpointed": _train_step(*checkpointed)},
                        *((repeats, warmup) if not heavy else (max(3, (repeats + 1) // 2), 1)), timer)
        rows.append([name, batch, f"{plain:.0f}", f"{saved:.0f}", f"{1 - saved / plain:.0%}",
                     f"{ms['plain']:.1f}", f"{ms['checkpointed']:.1f} ({ms['checkpointed'] / ms['plain']:.2f}×)"])
    report.table(["config", "batch", "peak MiB", "checkpointed peak MiB", "memory saved", "step ms",
                  "checkpointed step ms"], rows)


def _compiled_section(report: Report, timer: Clock, repeats: int, warmup: int, backend: str) -> None:
    report.lines += [
        "## Compiled vs eager (the CPU defaults)", "",
        f"`--model.init_args.compile true`: the network compiled in place with `torch.compile` (backend {backend}), "
        "the same training step as above. *compile s*: the first compiled step, compilation included; then "
        "medians of the steady steps. Dense and MoH configs alike.", "",
    ]
    rows = []
    for family, batch, shape, names, _ in CPU_DEFAULTS:
        for name in names[:2]:
            torch._dynamo.reset()
            eager = _train_step(*model_step_parts(name, batch, timer.device))
            model, inputs, loss_fn = model_step_parts(name, batch, timer.device)
            model.compile(backend=backend)
            compiled = _train_step(model, inputs, loss_fn)
            start = timer.now()
            compiled()
            compile_s = timer.now() - start
            ms = _median_ms({"eager": eager, "compiled": compiled}, repeats, warmup, timer)
            rows.append([name, f"batch {batch}, {shape}", f"{compile_s:.0f}", f"{ms['eager']:.1f}",
                         f"{ms['compiled']:.1f} ({ms['eager'] / ms['compiled']:.2f}× faster)"])
    report.table(["config", "input", "compile s", "eager step ms", "compiled step ms"], rows)


def _decode_model_section(report: Report, timer: Clock, repeats: int, warmup: int) -> None:
    from moh_lightning.layers.moh_config import MoHConfig
    from moh_lightning.models.llama import LlamaConfig, MoHLlama

    llm_s = {"llm_s_100": None, "llm_s_75": MoHConfig(6, 3), "llm_s_50": MoHConfig(3, 3)}
    report.lines += [
        "## LLM-S decoding", "",
        f"LLM-S shape (12 layers, hidden 768, 12 heads of 64, vocab 65,536), batch {BATCH}: one decoding "
        "step through the KV cache of the given length (caches filled with random keys and values instead of "
        "a prefill), lm_head included; MoH in *auto* mode.", "",
    ]
    rows = []
    for length in (1024, 4096):
        fns = {}
        for name in llm_s:
            torch.manual_seed(0)
            model = MoHLlama(LlamaConfig(block_size=length + 1, moh=llm_s[name])).to(timer.device).eval()
            caches = model.init_kv_caches(BATCH, length + 1)
            for cache in caches:
                cache.k.normal_(), cache.v.normal_()
            token = torch.randint(0, model.config.vocab_size, (BATCH, 1), device=timer.device)

            def step(model=model, caches=caches, token=token):
                for cache in caches:
                    cache.length = length
                model(token, caches)
            fns[name] = step
        with torch.no_grad():
            ms = _median_ms(fns, repeats, warmup, timer)
        rows += [[length, name, f"{ms[name]:.1f}", f"{BATCH / ms[name] * 1e3:.1f}",
                  f"{ms['llm_s_100'] / ms[name]:.2f}×"] for name in fns]
    report.table(["cache", "model", "ms/step", "tokens/s", "speedup"], rows)


def _machine(load_before, load_after, seconds: float, command: str, repeats: int, warmup: int,
             timer: Clock) -> list[str]:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        cpu = found.group(1) if found else cpu
    if timer.device.type == "cuda":
        where = f"GPU {torch.cuda.get_device_name(timer.device)}"
    else:
        where = "CPU only"
    quiet = max(load_before[0], load_after[0]) < 1.5 * torch.get_num_threads()
    clock = ("process CPU time (the work done; waiting for a core shared with other processes is not counted)"
             if timer.cpu_time else "wall time")
    return [
        "# MoH attention: head-sparse execution vs multi-head attention", "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"in {seconds / 60:.1f} min. Machine: {cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads, {where}, fp32. Medians of {repeats} runs after {warmup} "
        f"warm-up runs, variants interleaved; {clock}.",
        f"Load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}, after: "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} — "
        f"{'quiet' if quiet else 'shared with other work: timings are noisy'}.",
        "Peak memory: " + ("the CUDA allocator's peak during one forward + backward." if timer.device.type == "cuda"
                           else "resident-set growth of a fresh single-thread process during one forward + backward "
                           "(VmHWM after resetting it via /proc/self/clear_refs, minus VmRSS before), glibc mmap "
                           "threshold fixed at 64 KiB so freed tensors leave the process."), "",
    ]


def _plot(report: Report, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    panels = [(False, False), (False, True), (True, False), (True, True)]
    for ax, (causal, backward) in zip(axes, panels):
        for (c, b, name), points in report.core.items():
            if (c, b) != (causal, backward):
                continue
            xs, ys = zip(*points)
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
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=f"MoH {name}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title("KV-cache decode core")
    ax.set_xlabel("cache length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_peak(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m moh_lightning.tools.bench peak-memory")
    parser.add_argument("--length", type=int, default=4096, help="Sequence length N of the layer.")
    parser.add_argument("--execution", choices=("auto", "masked", "sparse"), default="auto")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dense", action="store_true", help="Plain multi-head attention instead of MoH.")
    parser.add_argument("--materialised", action="store_true", help="Force SDPA's math backend.")
    parser.add_argument("--model", help="A shipped config: its network's training step instead of one layer.")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq_len", type=int, default=None, help="Tokens per sequence of a language model.")
    parser.add_argument("--checkpointing", action="store_true", help="Activation checkpointing per block.")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def _main(argv: list[str] | None = None) -> None:
    """``python -m moh_lightning.tools.bench peak-memory ...``: the fresh process of one peak-memory measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "peak-memory":
        raise SystemExit("usage: python -m moh_lightning.tools.bench peak-memory [options] (see --help)")
    print(json.dumps(_measure_peak(_parse_peak(argv[1:]))))


if __name__ == "__main__":
    _main()
