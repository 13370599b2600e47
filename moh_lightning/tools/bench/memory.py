"""Peak memory on the CPU, measured in a fresh process: apart because each measurement's process runs this module
as a command of its own (``python -m moh_lightning.tools.bench.memory peak-memory ...``).

Peak memory is the resident-set growth of the fresh process (its high-water mark reset through
``/proc/self/clear_refs``) with glibc's mmap threshold fixed at 64 KiB, so every freed tensor returns to the OS:
torch's CPU allocator keeps no statistics, and tracemalloc does not see its allocations.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from moh_lightning.layers import pop_load_balance_loss
from moh_lightning.layers.moh_attention import checkpoint_blocks
from moh_lightning.tools.bench.model_step import model_step_parts
from moh_lightning.tools.bench.report import Report
from moh_lightning.tools.bench.shapes import BATCH, HEAD_DIM, HEADS, layer


def peak_mib(*args: str) -> float:
    """Peak memory in MiB of one measurement (the options of ``peak-memory``) in a fresh process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    command = [sys.executable, "-m", __spec__.name, "peak-memory", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def memory_section(report: Report, length: int) -> None:
    """Peak memory of the attention layers at ``length`` (each figure is a fresh process, about 5 s of imports)."""
    report.section("memory", length=length)
    rows = []
    for causal in (False, True):
        flags = ["--length", str(length)] + (["--causal"] if causal else [])
        mha = peak_mib(*flags, "--dense")
        materialised = peak_mib(*flags, "--dense", "--materialised") if length <= 4096 else float("nan")
        sparse = peak_mib(*flags, "--execution", "sparse")
        masked = peak_mib(*flags, "--execution", "masked")
        rows.append(["causal" if causal else "bidirectional", length, f"{mha:.0f}", f"{materialised:.0f}",
                     f"{sparse:.0f} ({sparse / mha:.2f}×, {sparse / materialised:.2f}×)",
                     f"{masked:.0f} ({masked / mha:.2f}×)"])
        if causal:
            report.target(f"causal layer peak memory, fwd+bwd, N = {length}, MoH 50% / MHA", "≤ 1.00×",
                          sparse / mha, sparse / mha <= 1.0)
    report.table(["attention", "N", "MHA MiB", "MHA, materialised MiB", "MoH 50% sparse (vs MHA, vs materialised)",
                  "MoH 50% dense-and-mask"], rows)


def _measure_peak(args: argparse.Namespace) -> float:
    """The fresh process's side of ``peak_mib``: memory growth in MiB of one forward + backward, of an attention
    layer or of a model's training step (``--model``). Only meaningful as the first measurement of a process
    started with ``peak_mib``'s malloc settings."""
    torch.set_num_threads(1)
    if args.model:
        model, inputs, loss_fn = model_step_parts(args.model, args.batch, torch.device("cpu"), args.seq_len)
        if args.checkpointing:
            checkpoint_blocks(model)

        def run(small: bool = False):  # a whole step to warm up too: freed memory leaves the process
            loss = loss_fn(model(*inputs))
            balance = pop_load_balance_loss(model)
            (loss if balance is None else loss + 0.01 * balance).backward()
        module = model
    else:
        module = layer(args.causal, args.dense, args.execution)
        x = torch.randn(BATCH, args.length, HEADS * HEAD_DIM, requires_grad=True)

        def run(small: bool = False):
            module(x[:, :64] if small else x).sum().backward()

    def backend():
        return sdpa_kernel(SDPBackend.MATH) if args.materialised else contextlib.nullcontext()

    with backend():
        run(small=True)  # lazy initialisation outside the measurement
    module.zero_grad(set_to_none=True)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    with backend():
        run()
    return (_status_kib("VmHWM") - before) / 1024


def _status_kib(key: str) -> int:
    """A KiB entry of ``/proc/self/status`` (VmRSS: resident now; VmHWM: resident high-water mark)."""
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _parse_peak(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name} peak-memory")
    parser.add_argument("--length", type=int, default=4096, help="Sequence length N of the layer.")
    parser.add_argument("--execution", choices=("auto", "masked", "sparse"), default="auto")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dense", action="store_true", help="Plain multi-head attention instead of MoH.")
    parser.add_argument("--materialised", action="store_true", help="Force SDPA's math backend.")
    parser.add_argument("--model", help="A shipped config: its network's training step instead of one layer.")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq_len", type=int, default=None, help="Tokens per sequence of a language model.")
    parser.add_argument("--checkpointing", action="store_true", help="Activation checkpointing per block.")
    return parser.parse_args(argv)


def _main(argv: list[str] | None = None) -> None:
    """``python -m moh_lightning.tools.bench.memory peak-memory ...``: one peak-memory measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "peak-memory":
        raise SystemExit(f"usage: python -m {__spec__.name} peak-memory [options] (see --help)")
    print(json.dumps(_measure_peak(_parse_peak(argv[1:]))))


if __name__ == "__main__":
    _main()
