"""``moh bench``: MoH's head-sparse execution and whole MoH models against dense multi-head attention, timed here.

This module is the command: its options, which sections run, the page they make. Each section measures in a module
of its own (``core``, ``layer``, ``memory``, ``decode``, ``models``), all timed the same way (``timing``), and
``report`` holds what the page says. The developer's benchmarks (the GPU report, each task's step, the image loader,
``moh fit`` against a bare loop) are scripts beside the package, in ``benchmarks/``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt

from moh_lightning.outputs import check_output_file
from moh_lightning.tools.bench.core import core_section
from moh_lightning.tools.bench.decode import decode_section
from moh_lightning.tools.bench.layer import layer_section
from moh_lightning.tools.bench.memory import memory_section
from moh_lightning.tools.bench.models import (
    MODELS,
    checkpointing_section,
    compiled_section,
    decode_model_section,
    model_section,
)
from moh_lightning.tools.bench.op_count import op_count_section
from moh_lightning.tools.bench.report import Report, header, shared_machine
from moh_lightning.tools.bench.shapes import BATCH, FRACTIONS
from moh_lightning.tools.bench.timing import Clock

DEFAULTS = {"quick": False, "repeats": 5, "warmup": 2, "models": True, "compiled": True, "threads": None,
            "clock": "wall", "compile_backend": "inductor"}


def default_output(name: str) -> Path:
    """``bench/<date>_<time>/<name>``: each run's pages in a folder of its own, never over the shipped ``results/``."""
    return Path("bench") / time.strftime("%Y-%m-%d_%H%M%S") / name


def bench(quick: bool = False, output: str | None = None, repeats: PositiveInt = 5, warmup: NonNegativeInt = 2,
          models: bool = True, compiled: bool = True, threads: PositiveInt | None = None, clock: str = "wall",
          compile_backend: str = "inductor", overwrite: bool = False) -> Path:
    """Benchmark MoH attention (head-sparse execution) and MoH models against dense multi-head attention.

    Prints each section as it starts and ends, rewrites the page after each (a stopped bench leaves what it
    measured), and ends the page and the terminal with a verdict: where MoH was faster on this machine, by how much.

    Args:
        quick: A subset in about a minute: batch 1 at N = 128 and 1,024 (where the CPU's head-sparse path is
            expected to win), 50% heads, caches of 256 and 4,096 tokens, the MNIST ViT's step at batch 16.
        output: Markdown report; the plot goes beside it as ``<stem>.png``. By default a folder of this run's own,
            ``bench/<date>_<time>/bench_attention.md``; a page or plot that exists (a shipped one in ``results/``)
            is rewritten only with ``overwrite``.
        repeats: Timed runs per measurement (the median is reported).
        warmup: Untimed rounds before them (each timed run also makes the two untimed calls of
            ``torch.utils.benchmark``'s ``Timer.timeit`` just before it).
        models: Include the whole-model tables (training steps of every shipped CPU default and of the ViT-S,
            DiT-S/2 and LLM-S shapes, activation-checkpointing memory, LLM-S decoding).
        compiled: Include the compiled-vs-eager table of the three CPU defaults (minutes of compilation).
        threads: torch's intra-op threads; its default (one per core) when None.
        clock: ``wall`` (elapsed time) or ``cpu`` (the process's CPU time: steadier on a shared machine; ratios
            between variants compare the work done, not the waiting).
        compile_backend: ``torch.compile`` backend of the compiled table (``aot_eager`` compiles in seconds).
        overwrite: Replace a page (and its plot) that exists, such as a shipped one in ``results/``.
    """
    if clock not in ("wall", "cpu"):
        raise SystemExit(f"moh bench: --clock {clock!r}: choose wall or cpu.")
    path = Path(output) if output else default_output("bench_attention.md")
    for page in (path, path.with_suffix(".png")):
        check_output_file(page, "--output", overwrite)
    torch.manual_seed(0)
    if threads is not None:
        torch.set_num_threads(threads)
    if quick:  # each timed run's two untimed calls warm it up
        repeats, warmup = 2, 0
    timer = Clock(torch.device("cpu"), clock == "cpu")
    # Quick: one sequence a batch (a quarter of the work), a short length and 1,024 tokens, where the CPU's
    # head-sparse path is expected to win, and the same for the cache; neither the dense-and-mask reference of the
    # core table nor the fresh-process memory measurements.
    batch = 1 if quick else BATCH
    lengths = (128, 1024) if quick else (256, 1024, 4096)
    fractions = {"50%": 2} if quick else FRACTIONS
    caches = (256, 4096) if quick else (1024, 2048, 4096, 8192)
    report = Report()
    sections = {
        "operation counts": lambda: op_count_section(report),
        "attention core": lambda: core_section(report, timer, lengths, fractions, repeats, warmup, batch,
                                               masked_column=not quick),
        "whole attention layer": lambda: layer_section(report, timer, lengths[-1:] if quick else (256, 1024),
                                                       fractions, repeats, warmup, batch),
    }
    if not quick:
        sections["peak memory"] = lambda: memory_section(report, lengths[-1])
    sections["KV-cache decoding"] = lambda: decode_section(report, timer, caches, fractions, repeats, warmup, batch)
    if models or quick:
        sections["whole models' training steps"] = lambda: model_section(report, timer, MODELS[:1] if quick
                                                                         else MODELS, repeats, warmup, quick)
    if models and not quick:
        sections["activation checkpointing"] = lambda: checkpointing_section(report, timer, repeats, warmup)
        sections["LLM-S decoding"] = lambda: decode_model_section(report, timer, repeats, warmup)
    if compiled and not quick:
        sections["compiled vs eager"] = lambda: compiled_section(report, timer, repeats, warmup, compile_backend)
    options = {"quick": quick, "repeats": repeats, "warmup": warmup, "models": models, "compiled": compiled,
               "threads": threads, "clock": clock, "compile_backend": compile_backend}
    command = " ".join(["moh bench"] + [f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
                                        for k, v in options.items() if v != DEFAULTS[k] and k != "quick"])
    command = "moh bench --quick true" if quick else command
    load_before, started = os.getloadavg(), time.time()
    print(f"moh bench: {len(sections)} sections, each written to {path} as it finishes", flush=True)
    # One thread's CPU time is what a busy machine cannot disturb; anything else it can.
    disturbed = not (timer.cpu_time and torch.get_num_threads() == 1)
    busy = shared_machine(load_before, load_before)
    if busy and disturbed:
        print(f"moh bench: {busy}; its timings will be noisy, and `--threads 1 --clock "
              f"cpu` measures one thread's work instead.", flush=True)
    for done, (name, measure) in enumerate(sections.items(), 1):
        print(f"moh bench: [{done}/{len(sections)}] {name} ...", flush=True)
        section_started = time.time()
        measure()
        load_after = os.getloadavg()
        report.shared_machine = shared_machine(load_before, load_after) if disturbed else ""
        page_header = header(load_before, load_after, time.time() - started, command, repeats, warmup,
                             timer.cpu_time)
        report.write(path, page_header, still_to_measure=list(sections)[done:])
        print(f"moh bench: [{done}/{len(sections)}] {name}: {time.time() - section_started:.0f} s", flush=True)
    print("\n".join(report.verdict()), flush=True)
    print(f"moh bench: wrote {path} and {path.with_suffix('.png')} in {(time.time() - started) / 60:.1f} min",
          flush=True)
    return path
