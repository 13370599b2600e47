"""``moh bench``: MoH's head-sparse execution and whole MoH models against dense multi-head attention, timed here.

This module is the command: its options, which sections run, the page they make. Each section measures in a module
of its own (``core``, ``layer``, ``memory``, ``decode``, ``models``), all timed the same way (``timing``), and
``report`` holds what the page says; ``--device cuda`` runs the GPU report (``cuda``) instead.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from moh_lightning.tools.bench.core import core_section
from moh_lightning.tools.bench.cuda import bench_cuda
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
from moh_lightning.tools.bench.report import Report, header
from moh_lightning.tools.bench.shapes import FRACTIONS
from moh_lightning.tools.bench.steps import bench_steps
from moh_lightning.tools.bench.timing import Clock

DEFAULTS = {"quick": False, "repeats": 5, "warmup": 2, "models": True, "compiled": True, "threads": None,
            "device": "cpu", "clock": "wall", "compile_backend": "inductor", "steps": False}


def bench(quick: bool = False, output: str | None = None, repeats: int = 5, warmup: int = 2,
          models: bool = True, compiled: bool = True, threads: int | None = None, device: str = "cpu",
          clock: str = "wall", compile_backend: str = "inductor", steps: bool = False) -> Path:
    """Benchmark MoH attention (head-sparse execution) and MoH models against dense multi-head attention.

    Args:
        quick: A small subset (N = 128, 50% heads, a 256-token cache, the MNIST ViT's step only) for smoke tests.
        output: Markdown report; the plot goes beside it as ``<stem>.png``. By default
            ``results/bench_attention.md``, on CUDA ``results/bench_attention_cuda.md``.
        repeats: Timed runs per measurement (the median is reported).
        warmup: Untimed rounds before them (each timed run also makes the two untimed calls of
            ``torch.utils.benchmark``'s ``Timer.timeit`` just before it).
        models: Include the whole-model tables (training steps of every shipped CPU default and of the ViT-S,
            DiT-S/2 and LLM-S shapes, activation-checkpointing memory, LLM-S decoding).
        compiled: Include the compiled-vs-eager table of the three CPU defaults (minutes of compilation).
        threads: torch's intra-op threads; its default (one per core) when None.
        device: ``cpu``, or ``cuda`` for the GPU report (``bench.cuda``: bf16, the CUDA head-sparse kernels against
            SDPA over all and over half of the heads; ``quick`` is the only other option it reads).
        clock: ``wall`` (elapsed time) or ``cpu`` (the process's CPU time: steadier on a shared machine; ratios
            between variants compare the work done, not the waiting).
        compile_backend: ``torch.compile`` backend of the compiled table (``aot_eager`` compiles in seconds).
        steps: Only each task's MoH training step against its dense config (``bench.steps``): eager, and on CUDA
            compiled too; rows into ``output`` (``results/gpu/steps.json`` by default) and a page beside it.
    """
    if clock not in ("wall", "cpu"):
        raise SystemExit(f"moh bench: --clock {clock!r}: choose wall or cpu.")
    run_on = torch.device(device)
    if steps:
        return bench_steps(device, output or "results/gpu/steps.json", compiled=compiled and run_on.type == "cuda",
                           repeats=repeats, warmup=warmup)
    if run_on.type == "cuda":
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
    op_count_section(report)
    core_section(report, timer, lengths, fractions, repeats, warmup)
    layer_section(report, timer, lengths[:1] if quick else (256, 1024), fractions, repeats, warmup)
    memory_section(report, lengths[-1], quick)
    decode_section(report, timer, caches, fractions, repeats, warmup)
    if models or quick:
        model_section(report, timer, MODELS[:1] if quick else MODELS, repeats, warmup, quick)
    if models and not quick:
        checkpointing_section(report, timer, repeats, warmup)
        decode_model_section(report, timer, repeats, warmup)
    if compiled and not quick:
        compiled_section(report, timer, repeats, warmup, compile_backend)
    load_after = os.getloadavg()
    options = {"quick": quick, "repeats": repeats, "warmup": warmup, "models": models, "compiled": compiled,
               "threads": threads, "device": device, "clock": clock, "compile_backend": compile_backend}
    command = " ".join(["moh bench"] + [f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
                                        for k, v in options.items() if v != DEFAULTS[k] and k != "quick"])
    command = "moh bench --quick true" if quick else command
    path = Path(output)
    report.write(path, header(load_before, load_after, time.time() - started, command, repeats, warmup,
                              timer.cpu_time))
    return path
