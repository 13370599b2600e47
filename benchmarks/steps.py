"""``python benchmarks/steps.py``: each task's MoH training step against its dense config, eager and compiled.

One row per (MoH config, compile): the step times of the MoH network and of the dense config's (same shapes, same
batch, bf16 autocast on a GPU), their ratio, the dense model's FLOPs per step over the step's time as a share of the
device's dense peak (MFU counted with the dense model's FLOPs for both, the convention that credits MoH with no
skipped work), and on CUDA the kernels one step launches and the share of the step's time the GPU is busy, which tell
a launch-bound step from a compute-bound one. Rows go to ``steps.json`` (a list of ``{"config", "baseline",
"device", "compile", "tokens", "ratio", "mfu", ...}``, a row of the same config, compile asked and device replaced)
and a Markdown page beside it.

Each row also says what ran: the library versions, the precision, and per network the graphs Dynamo compiled and its
recompiles (``torch._dynamo.utils``'s counters, cleared with ``torch._dynamo.reset()`` before each network, so one
network's compiles neither count for nor use up the recompile limit of the next). ``compile`` is true only where both
networks ran compiled: a compiled row whose network compiled no graph, or hit Dynamo's recompile limit (the frames past
it run eagerly), says ``compile: false`` and why (``not_compiled``), never a compiled time that was an eager one.
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo
from jsonargparse import CLI
from torch._dynamo.utils import counters, guard_failures
from torch.utils.flop_counter import FlopCounterMode

from moh_lightning.callbacks.throughput import peak_flops
from moh_lightning.layers.moh_attention import compile_blocks
from moh_lightning.tools.bench.model_step import model_step_parts, train_step

# (MoH config, dense config, batch, sequence length or None for the config's own): the GPU defaults of each task, and
# an LM at 1,024 and at 4,096 tokens, where attention dominates. The ViT last: each of its blocks has a drop-path rate
# of its own, which Dynamo guards, so its compiled networks recompile block after block up to the recompile limit,
# the longest compilation of the four; a call cut short loses that pair, not the others.
GPU_PAIRS = [("dit_s2_75", "dit_s2_100", 128, None), ("llm_s_75", "llm_s_100", 8, 1024),
             ("llm_s_50", "llm_s_100", 2, 4096), ("vit_s_75", "vit_s_100", 128, None)]
# The CPU defaults at small batches: the same table in seconds, for trying the command (no MFU: no CPU peak).
CPU_PAIRS = [("vit_tiny_mnist_75", "vit_tiny_mnist_100", 32, None), ("dit_mnist_75", "dit_mnist_100", 16, None),
             ("llm_stdlib_75", "llm_stdlib_100", 4, 256)]
# ``--quick true``: the CPU defaults at batch 2, the GPU call's dry run in CI (benchmarks/run.sh --dry-run).
QUICK_PAIRS = [(moh, dense, 2, seq_len and 64) for moh, dense, _, seq_len in CPU_PAIRS]
# The libraries a row's times depend on, as installed where it ran (a missing one is left out).
LIBRARIES = ("torch", "triton", "liger-kernel", "lightning", "timm")


def bench(device: str = "cpu", output: str = "results/gpu/steps.json", repeats: int = 5, warmup: int = 2,
          compiled: bool = True, compile_backend: str = "inductor", quick: bool = False,
          configs: list[str] | None = None) -> Path:
    """Each task's MoH training step against its dense config: eager, and on CUDA compiled too.

    Rows into ``output`` (a row of the same config, compile asked and device replaced) and a page beside it.

    Args:
        device: ``cpu`` (the CPU defaults at small batches) or ``cuda`` (the GPU defaults: ViT-S, DiT-S/2, an LM at
            1,024 and at 4,096 tokens, bf16 autocast, kernels per step and the GPU's busy share).
        output: The rows' JSON file; the page goes beside it as ``<stem>.md``.
        repeats: Timed steps per network (the median is reported).
        warmup: Untimed steps before them.
        compiled: Also the compiled rows, on CUDA or with ``quick`` (on the CPU they take minutes of compilation).
        compile_backend: ``torch.compile`` backend of the compiled rows (``aot_eager`` compiles in seconds).
        quick: The CPU defaults at batch 2, eager and compiled on any device: the GPU call's dry run
            (``benchmarks/run.sh --dry-run``).
        configs: Only the pairs of these MoH configs (the dry run's one pair); None: every pair of the set.
    """
    compiled = compiled and (torch.device(device).type == "cuda" or quick)
    pairs = None
    if configs is not None:
        run_on = torch.device(device).type
        pairs = [pair for pair in (QUICK_PAIRS if quick else GPU_PAIRS if run_on == "cuda" else CPU_PAIRS)
                 if pair[0] in configs]
        if len(pairs) != len(configs):
            raise SystemExit(f"benchmarks/steps.py: --configs {configs}: not all among the pairs' MoH configs.")
    return bench_steps(device, output, compiled, repeats, warmup, pairs, backend=compile_backend, quick=quick)


def bench_steps(device: str = "cuda", output: str = "results/gpu/steps.json", compiled: bool = True,
                repeats: int = 20, warmup: int = 3, pairs: list[tuple] | None = None, backend: str = "inductor",
                quick: bool = False) -> Path:
    """Times every pair's steps, prints each row as it is measured, and writes ``output`` and its ``.md`` page.

    ``backend``: ``torch.compile``'s backend for the compiled rows. ``quick``: ``QUICK_PAIRS`` unless ``pairs``.
    """
    run_on = torch.device(device)
    if run_on.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/steps.py: --device cuda, but torch sees no CUDA device here.")
    pairs = pairs or (QUICK_PAIRS if quick else GPU_PAIRS if run_on.type == "cuda" else CPU_PAIRS)
    path = Path(output)
    rows = json.loads(path.read_text()) if path.is_file() else []
    for compile_mode in ((False, True) if compiled else (False,)):
        for moh, dense, batch, seq_len in pairs:
            row = step_row(moh, dense, batch, seq_len, run_on, compile_mode, repeats, warmup, backend)
            rows = [r for r in rows if _key(r) != _key(row)] + [row]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rows, indent=1) + "\n")  # after every row: a lease that ends keeps them
            path.with_suffix(".md").write_text(page(rows))
            print(f"steps: {moh} / {dense}, compile {row['compile']}: ratio {row['ratio']:.3f} "
                  f"(MoH {row['moh_ms']:.2f} ms, dense {row['baseline_ms']:.2f} ms; graphs {row['moh_graphs']} / "
                  f"{row['baseline_graphs']}, recompiles {row['moh_recompiles']} / {row['baseline_recompiles']}) "
                  f"-> {path}", flush=True)
            if "not_compiled" in row:
                print(f"steps: {moh} / {dense}: NOT COMPILED, the row says compile false: {row['not_compiled']}",
                      flush=True)
    return path


def step_row(moh: str, dense: str, batch: int, seq_len: int | None, device: torch.device, compile_mode: bool,
             repeats: int, warmup: int, backend: str = "inductor") -> dict:
    """One row of ``steps.json``."""
    timings, flops, tokens, profile, dynamo = {}, None, 0, {}, {}
    for name in (dense, moh):
        torch._dynamo.reset()  # the previous network's graphs and recompiles are not this one's
        counters.clear()
        model, inputs, loss_fn = model_step_parts(name, batch, device, seq_len)
        if name == dense:  # before compiling: a no-grad pass through compiled blocks would compile untimed graphs
            tokens = _tokens(model, inputs)
        if compile_mode:
            compile_blocks(model, backend=backend)
        step = _autocast(train_step(model, inputs, loss_fn), device)
        if name == dense:
            flops = _step_flops(step)
        timings[name] = _median_seconds(step, device, repeats, warmup)
        if device.type == "cuda":
            profile[name] = _kernel_profile(step, timings[name])
        dynamo[name] = _dynamo_counts()
    peak = peak_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    not_compiled = _not_compiled(dynamo) if compile_mode else None
    row = {"config": moh, "baseline": dense, "device": _device_name(device),
           "compile": compile_mode and not_compiled is None, "asked_compile": compile_mode, "tokens": tokens,
           "batch": batch, "ratio": timings[moh] / timings[dense],
           "mfu": None if peak is None else flops / timings[moh] / peak,
           "baseline_mfu": None if peak is None else flops / timings[dense] / peak,
           "moh_ms": timings[moh] * 1e3, "baseline_ms": timings[dense] * 1e3,
           "precision": "bf16-mixed" if device.type == "cuda" else "32-true",
           "compile_backend": backend if compile_mode else None, "versions": _versions(),
           "moh_graphs": dynamo[moh]["graphs"], "baseline_graphs": dynamo[dense]["graphs"],
           "moh_recompiles": dynamo[moh]["recompiles"], "baseline_recompiles": dynamo[dense]["recompiles"]}
    if not_compiled:
        row["not_compiled"] = not_compiled
    if profile:
        row.update(moh_kernels=profile[moh][0], moh_gpu_busy=profile[moh][1],
                   baseline_kernels=profile[dense][0], baseline_gpu_busy=profile[dense][1])
    return row


def _key(row: dict) -> tuple:
    """What a new row replaces: the row of the same config, device and compile asked (older rows: compile)."""
    return row["config"], row.get("asked_compile", row["compile"]), row["device"]


def _dynamo_counts() -> dict:
    """Dynamo's counters since the last reset: graphs compiled, recompiles (each guard failure that asked for one)
    and the frames refused at the recompile limit, which then run eagerly."""
    return {"graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(len(reasons) for reasons in guard_failures.values()),
            "limit_hits": sum(n for message, n in counters["unimplemented"].items()
                              if "recompile limit exceeded" in message.lower())}


def _not_compiled(dynamo: dict[str, dict]) -> str | None:
    """Why a row asked to be compiled cannot say so, or None when every network ran compiled."""
    reasons = [f"{name}: Dynamo compiled no graph" if counts["graphs"] == 0 else
               f"{name}: {counts['limit_hits']} frame(s) hit the recompile limit and ran eagerly"
               for name, counts in dynamo.items() if counts["graphs"] == 0 or counts["limit_hits"]]
    return "; ".join(reasons) or None


def _versions() -> dict[str, str]:
    versions = {}
    for library in LIBRARIES:
        try:
            versions[library] = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _autocast(step, device: torch.device):
    if device.type != "cuda":
        return step

    def bf16_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step()
    return bf16_step


def _tokens(model, inputs) -> int:
    """Positions the first attention layer sees per sample: patches, latent patches or text tokens."""
    seen = []
    layer = next(m for m in model.modules() if type(m).__name__ == "MoHAttention")
    hook = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        model(*inputs)
    hook.remove()
    return seen[0]


def _step_flops(step) -> float:
    """FLOPs of one training step (forward and backward; the optimizer's elementwise work is not counted)."""
    with FlopCounterMode(display=False) as counter, torch.compiler.set_stance("force_eager"):
        step()
    return float(counter.get_total_flops())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(step, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernel_profile(step, seconds: float) -> tuple[int, float]:
    """(CUDA kernels one step launches, the share of the step's time they keep the GPU busy), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels)
    return len(kernels), min(1.0, busy_us * 1e-6 / seconds)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def page(rows: list[dict]) -> str:
    """``steps.json`` as a Markdown table, then the libraries each device's rows ran with."""
    lines = ["# Training steps: MoH against its dense config", "",
             "Ratio = MoH step time / the dense config's step time (same batch and shapes); MFU counts the dense "
             "model's FLOPs against the device's dense bf16 peak; kernels and GPU-busy share from the profiler "
             "(CUDA only); graphs and recompiles are Dynamo's counts per network (a compiled row whose network "
             "compiled nothing says compile false, and why below). Written by `python benchmarks/steps.py`.", "",
             "| config | baseline | device | compile | precision | tokens | batch | MoH ms | dense ms | ratio "
             "| MoH MFU | dense MFU | kernels MoH / dense | GPU busy MoH / dense | graphs MoH / dense "
             "| recompiles MoH / dense |", "|" + "---|" * 16]
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        base_mfu = "n/a" if r["baseline_mfu"] is None else f"{r['baseline_mfu']:.1%}"
        kernels = f"{r['moh_kernels']} / {r['baseline_kernels']}" if "moh_kernels" in r else "n/a"
        busy = f"{r['moh_gpu_busy']:.0%} / {r['baseline_gpu_busy']:.0%}" if "moh_gpu_busy" in r else "n/a"
        graphs = f"{r['moh_graphs']} / {r['baseline_graphs']}" if "moh_graphs" in r else "n/a"
        recompiles = f"{r['moh_recompiles']} / {r['baseline_recompiles']}" if "moh_recompiles" in r else "n/a"
        compiled = f"{r['compile']} (asked, not compiled)" if "not_compiled" in r else str(r["compile"])
        lines.append(f"| {r['config']} | {r['baseline']} | {r['device']} | {compiled} | {r.get('precision', 'n/a')} "
                     f"| {r['tokens']} | {r['batch']} | {r['moh_ms']:.2f} | {r['baseline_ms']:.2f} | {r['ratio']:.3f} "
                     f"| {mfu} | {base_mfu} | {kernels} | {busy} | {graphs} | {recompiles} |")
    lines += [""] + [f"- {r['config']} on {r['device']}, asked compiled: {r['not_compiled']}"
                     for r in rows if "not_compiled" in r]
    libraries = {}
    for r in rows:
        if "versions" in r:
            libraries.setdefault(r["device"], []).append(", ".join(f"{k} {v}" for k, v in r["versions"].items()))
    lines += [f"- {device}: {'; '.join(dict.fromkeys(sets))}" for device, sets in libraries.items()]
    return "\n".join(lines) + "\n"


def main(args: list[str] | None = None) -> Path:
    return CLI(bench, args=args, as_positional=False)


if __name__ == "__main__":
    main()
