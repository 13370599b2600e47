"""``python benchmarks/attention_cuda.py``: MoH's head-sparse execution on a GPU against SDPA over all heads, in
bf16. A report of its own, apart from ``moh bench``'s CPU sections: other shapes and dtype, the CUDA kernels, and on a
GPU no other process's load to pair rounds against.

Timed with ``torch.utils.benchmark`` (``Timer.blocked_autorange``: CUDA synchronised, enough runs per block to
outlast the timer's resolution, the median over blocks). Every table has the dense baselines side by side: SDPA over
all heads (MHA) and over half of them (the FLOP-matched baseline for 50% of heads), and MoH both ways, dense-and-mask
(every head computed, unselected ones zeroed) and head-sparse (``layers/head_sparse_cuda.py``). The router's choices
are random; each MoH cell is timed under three routing seeds and shows the median with the seeds' range.

The report ends with the ``CUDA_SPARSE`` table that ``auto`` reads: where the head-sparse layer beat dense-and-mask.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from jsonargparse import CLI
from torch.utils import benchmark

from moh_lightning.layers import KVCache, MoHAttention, MoHRouter, pop_load_balance_loss
from moh_lightning.layers.execution import attend
from moh_lightning.tools.bench import default_output
from moh_lightning.tools.bench.model_step import model_step_parts

HEADS, HEAD_DIM, SHARED = 16, 64, 4
FRACTIONS = {"50%": 4, "75%": 8}            # routed top-k of 12 with 4 shared of 16 heads
TOKENS_PER_BATCH = 16384
SEEDS = (0, 1, 2)
# (what, N or cache, fraction) -> the targets: minimum speedup of head-sparse MoH over MHA.
TARGETS = {("core forward", 4096, "50%"): 1.6, ("core forward + backward", 4096, "50%"): 1.4,
           ("layer forward + backward", 4096, "50%"): 1.2, ("decode", 8192, "50%"): 1.3}
# Whole-model training steps at the short sequence lengths: (MoH config, dense config, batch, target ratio).
SHORT_MODELS = [("vit_s_75", "vit_s_100", 128, 1.03), ("dit_s2_75", "dit_s2_100", 128, 1.03)]


def bench(quick: bool = False, output: str | None = None, device: str = "cuda") -> Path:
    """The GPU report: MoH's head-sparse execution against SDPA over all and over half of the heads, in bf16.

    The page ends with the ``CUDA_SPARSE`` table that ``auto`` reads.

    Args:
        quick: One small shape of each table: a smoke test.
        output: The Markdown report; by default a folder of this run's own,
            ``bench/<date>_<time>/bench_attention_cuda.md`` (``results/bench_attention_cuda.md`` is rewritten only
            when named here).
        device: The CUDA device.
    """
    path = Path(output) if output else default_output("bench_attention_cuda.md")
    print(f"attention_cuda: writing {path} (rewritten after each table)", flush=True)
    bench_cuda(str(path), quick=quick, device=device)
    print(f"attention_cuda: wrote {path}", flush=True)
    return path


def bench_cuda(output: str = "results/bench_attention_cuda.md", dtype: str = "bfloat16", quick: bool = False,
               device: str = "cuda", min_run_time: float = 0.5) -> Path:
    """Write the GPU report to ``output``; ``quick`` times one small shape of each table (a smoke test, which also
    runs on the CPU through the CPU backend)."""
    run_on = torch.device(device)
    if run_on.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_cuda.py: torch sees no CUDA device here.")
    kind = getattr(torch, dtype)
    lengths = (128,) if quick else (256, 1024, 4096)
    caches = (256,) if quick else (2048, 8192, 32768)
    fractions = dict(list(FRACTIONS.items())[:1]) if quick else FRACTIONS
    seeds = SEEDS[:1] if quick else SEEDS
    clock = _Clock(min_run_time=0.01 if quick else min_run_time, tokens=512 if quick else TOKENS_PER_BATCH)
    started = time.time()
    lines, targets, wins = [], [], {}
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = [partial(_core_tables, clock, run_on, kind, lengths, fractions, seeds, targets),
                partial(_layer_table, clock, run_on, kind, lengths, fractions, seeds, targets, wins),
                partial(_decode_table, clock, run_on, kind, caches, fractions, seeds, targets, wins)]
    if not quick:
        sections.append(partial(_short_model_table, clock, run_on, kind, targets))
    sections.append(partial(_compile_lines, run_on, kind, lengths[-1]))
    if not quick:
        sections.append(partial(_compiled_layer_table, clock, run_on, kind, lengths[-1]))
    # The page is rewritten after every section: a GPU lease that ends mid-run still leaves the tables measured.
    for section in sections:
        lines += section()
        header = _header(run_on, dtype, quick, time.time() - started, min_run_time)
        target_lines = ["## Targets", "", "| target | wanted | measured (seeds' range) | |", "|---|---|---|---|"]
        target_lines += [f"| {name} | ≥ {wanted:.2f}× | {measured} | {'met' if met else '**missed**'} |"
                         for name, wanted, measured, met in targets] + [""]
        path.write_text("\n".join(header + target_lines + lines + _auto_table(wins)))
    return path


class _Clock:
    """Median seconds of a function by ``torch.utils.benchmark``."""

    def __init__(self, min_run_time: float, tokens: int) -> None:
        self.min_run_time = min_run_time
        self.tokens = tokens                     # batch = tokens / N, so every length times about as many tokens

    def __call__(self, fn: Callable[[], object]) -> float:
        timer = benchmark.Timer("fn()", globals={"fn": fn})
        # Warm-up (and compilation) inside the Timer: it sets torch's thread count while it runs, which torch.compile
        # guards on, so a warm-up outside it would compile a graph that the timed runs then recompile.
        timer.timeit(1)
        return timer.blocked_autorange(min_run_time=self.min_run_time).median


def _gates(batch: int, length: int, top_k: int, device, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    router = MoHRouter(HEADS * HEAD_DIM, HEADS, SHARED, top_k)
    with torch.no_grad():
        x = torch.randn(batch, length, HEADS * HEAD_DIM, generator=generator)
        return router(x).gates.to(device, dtype)


def _run(fn: Callable[[], torch.Tensor], backward: bool) -> Callable[[], None]:
    if not backward:
        def forward() -> None:
            with torch.no_grad():
                fn()
        return forward
    return lambda: fn().float().sum().backward()


def _speedup_cell(base: float, times: list[float]) -> str:
    ratios = sorted(base / t for t in times)
    spread = f" ({ratios[0]:.2f}–{ratios[-1]:.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(times) * 1e3:.3f} ms, {statistics.median(ratios):.2f}×{spread}"


def _target(targets: list, what: str, length: int, fraction: str, base: float, times: list[float],
            kind: str = "") -> None:
    wanted = TARGETS.get((what, length, fraction))
    if wanted is not None:
        ratios = sorted(base / t for t in times)
        median = statistics.median(ratios)
        targets.append((f"{what}{f' ({kind})' if kind else ''}, N = {length}, MoH {fraction}", wanted,
                        f"{median:.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})", median >= wanted))


def _core_tables(clock, device, dtype, lengths, fractions, seeds, targets) -> list[str]:
    lines = ["## Attention core", "",
             f"q, k, v of {HEADS} heads of {HEAD_DIM} (MHA), {HEADS // 2} heads (half), batch × N = "
             f"{clock.tokens} tokens; MoH: {SHARED} shared heads, the rest routed. Time, speedup over MHA.", ""]
    for causal in (False, True):
        for backward in (False, True):
            what = "core forward + backward" if backward else "core forward"
            lines += [f"### {'Causal' if causal else 'Bidirectional'}, {what.removeprefix('core ')}", "",
                      "| N | MHA | half the heads | MoH | dense-and-mask | head-sparse |", "|---|---|---|---|---|---|"]
            for length in lengths:
                batch = max(1, clock.tokens // length)
                full, half = (_qkv(batch, heads, length, length, device, dtype, backward)
                              for heads in (HEADS, HEADS // 2))
                mha = clock(_run(partial(F.scaled_dot_product_attention, *full, is_causal=causal), backward))
                halved = clock(_run(partial(F.scaled_dot_product_attention, *half, is_causal=causal), backward))
                for name, top_k in fractions.items():
                    cells = {head_sparse: [clock(_run(partial(
                        attend, *full, _gates(batch, length, top_k, device, dtype, seed).requires_grad_(backward),
                        head_sparse=head_sparse, num_shared_heads=SHARED, active_heads=SHARED + top_k, causal=causal),
                        backward)) for seed in seeds] for head_sparse in (False, True)}
                    lines.append(f"| {length} | {mha * 1e3:.3f} ms | {_speedup_cell(mha, [halved])} | {name} | "
                                 f"{_speedup_cell(mha, cells[False])} | {_speedup_cell(mha, cells[True])} |")
                    _target(targets, what, length, name, mha, cells[True], "causal" if causal else "bidirectional")
            lines.append("")
    return lines


def _qkv(batch: int, heads: int, queries: int, keys: int, device, dtype, requires_grad: bool = False) -> list:
    shapes = ((batch, heads, queries, HEAD_DIM), *(2 * ((batch, heads, keys, HEAD_DIM),)))
    return [torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad) for shape in shapes]


def _layer_step(layer: MoHAttention, x: torch.Tensor) -> Callable[[], None]:
    """Forward, loss + 0.01 x the load-balance loss, backward."""
    def run() -> None:
        out = layer(x).float().square().mean()
        balance = pop_load_balance_loss(layer)
        (out if balance is None else out + 0.01 * balance).backward()
    return run


def _decode_step(layer: MoHAttention, x: torch.Tensor, cached: int) -> Callable[[], None]:
    """One token ``x`` (B, 1, C) decoded after ``cached`` positions of a KV cache."""
    cache = KVCache(x.shape[0], layer.num_kv_heads, cached + 1, layer.head_dim, device=x.device, dtype=x.dtype)

    def run() -> None:
        cache.length = cached
        with torch.no_grad():
            layer(x, kv_cache=cache)
    return run


def _layer(causal: bool, top_k: int | None, execution: str, device, dtype, num_heads: int = HEADS,
           seed: int = 0) -> MoHAttention:
    """A layer of width 1024; its router's random weights (``seed``) pick the heads."""
    torch.manual_seed(seed)
    moh = {"dense": True} if top_k is None else {"num_shared_heads": SHARED, "top_k": top_k}
    return MoHAttention(HEADS * HEAD_DIM, num_heads, attn_head_dim=HEAD_DIM, causal=causal, execution=execution,
                        **moh).to(device, dtype)


def _layer_table(clock, device, dtype, lengths, fractions, seeds, targets, wins) -> list[str]:
    lines = ["## Whole MoH layer, forward + backward", "",
             "Projections, router (and its load-balance loss) and attention; width 1024. Speedup over the MHA "
             "layer; the half-heads layer has half the attention width.", "",
             "| kind | N | MHA | half the heads | MoH | dense-and-mask | head-sparse |", "|---" * 7 + "|"]
    for causal in (False, True):
        kind = "causal" if causal else "bidirectional"
        for length in lengths:
            batch = max(1, clock.tokens // length)
            x = torch.randn(batch, length, HEADS * HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
            mha = clock(_layer_step(_layer(causal, None, "masked", device, dtype), x))
            halved = clock(_layer_step(_layer(causal, None, "masked", device, dtype, num_heads=HEADS // 2), x))
            for name, top_k in fractions.items():
                cells = {label: [clock(_layer_step(_layer(causal, top_k, label, device, dtype, seed=seed), x))
                                 for seed in seeds] for label in ("masked", "sparse")}
                lines.append(f"| {kind} | {length} | {mha * 1e3:.3f} ms | {_speedup_cell(mha, [halved])} | {name} | "
                             f"{_speedup_cell(mha, cells['masked'])} | {_speedup_cell(mha, cells['sparse'])} |")
                _target(targets, "layer forward + backward", length, name, mha, cells["sparse"], kind)
                if statistics.median(cells["sparse"]) < statistics.median(cells["masked"]):
                    wins.setdefault((kind, name), []).append(length)
    return lines + [""]


def _decode_table(clock, device, dtype, caches, fractions, seeds, targets, wins) -> list[str]:
    lines = ["## Decoding one token from a KV cache", "",
             "Batch 8, one query per sequence over the cache; the core alone (SDPA over the cache) and the whole "
             "layer (projections, router, cache write).", "",
             "| cache | MHA core | half the heads | MoH | dense-and-mask | head-sparse | layer: MHA | "
             "dense-and-mask | head-sparse |", "|---|---|---|---|---|---|---|---|---|"]
    batch = 8
    for length in caches:
        full, half = (_qkv(batch, heads, 1, length, device, dtype) for heads in (HEADS, HEADS // 2))
        mha = clock(_run(partial(F.scaled_dot_product_attention, *full), False))
        halved = clock(_run(partial(F.scaled_dot_product_attention, *half), False))
        x = torch.randn(batch, 1, HEADS * HEAD_DIM, device=device, dtype=dtype)
        layer_mha = clock(_decode_step(_layer(True, None, "masked", device, dtype).eval(), x, length))
        for name, top_k in fractions.items():
            core, layer_times = {}, {}
            for head_sparse in (False, True):
                core[head_sparse] = [clock(_run(partial(
                    attend, *full, _gates(batch, 1, top_k, device, dtype, seed), head_sparse=head_sparse,
                    num_shared_heads=SHARED, active_heads=SHARED + top_k, causal=True, offset=length - 1), False))
                    for seed in seeds]
                layer = _layer(True, top_k, "sparse" if head_sparse else "masked", device, dtype).eval()
                layer_times[head_sparse] = [clock(_decode_step(layer, x, length))]
            lines.append(f"| {length} | {mha * 1e3:.3f} ms | {_speedup_cell(mha, [halved])} | {name} | "
                         f"{_speedup_cell(mha, core[False])} | {_speedup_cell(mha, core[True])} | "
                         f"{layer_mha * 1e3:.3f} ms | {_speedup_cell(layer_mha, layer_times[False])} | "
                         f"{_speedup_cell(layer_mha, layer_times[True])} |")
            _target(targets, "decode", length, name, mha, core[True])
            if layer_times[True][0] < layer_times[False][0]:
                wins.setdefault(("decode", name), []).append(length)
    return lines + [""]


def _short_model_table(clock, device, dtype, targets) -> list[str]:
    lines = ["## Whole models at short sequences: one training step, bf16 autocast", "",
             "Forward, loss + 0.01 × load-balance loss, backward, AdamW; MoH in the config's execution (auto) and "
             "forced head-sparse. Ratio = MoH step time / the dense config's.", "",
             "| MoH config | dense config | batch | dense | MoH auto | MoH head-sparse |", "|---|---|---|---|---|---|"]
    for moh, dense, batch, wanted in SHORT_MODELS:
        times = {}
        for name, execution in ((dense, None), (moh, None), (moh, "sparse")):
            model, inputs, loss_fn = model_step_parts(name, batch, device)
            if execution:
                for layer in model.modules():
                    if isinstance(layer, MoHAttention):
                        layer.execution = execution
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model=model, inputs=inputs, loss_fn=loss_fn, optimizer=optimizer) -> None:
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=dtype):
                    loss = loss_fn(model(*inputs))
                    balance = pop_load_balance_loss(model)
                (loss if balance is None else loss + 0.01 * balance).float().backward()
                optimizer.step()
            times[(name, execution)] = clock(step)
        base = times[(dense, None)]
        auto, sparse = times[(moh, None)] / base, times[(moh, "sparse")] / base
        lines.append(f"| {moh} | {dense} | {batch} | {base * 1e3:.2f} ms | {auto:.3f}× | {sparse:.3f}× |")
        targets.append((f"{moh} training step / {dense} (auto)", 1 / wanted, f"{1 / auto:.2f}× speed", auto <= wanted))
    return lines + [""]


def _compile_lines(device, dtype, length: int) -> list[str]:
    """Graph breaks of the head-sparse layer under ``torch.compile`` (``torch._dynamo.explain``)."""
    lines = ["## torch.compile", ""]
    for causal in (False, True):
        layer = _layer(causal, FRACTIONS["50%"], "sparse", device, dtype)
        x = torch.randn(2, length, HEADS * HEAD_DIM, device=device, dtype=dtype)
        try:
            explained = torch._dynamo.explain(layer)(x)
            reasons = "; ".join(sorted({str(b.reason).splitlines()[0] for b in explained.break_reasons})) or "none"
            lines.append(f"- {'causal' if causal else 'bidirectional'} head-sparse layer: "
                         f"{explained.graph_break_count} graph breaks ({reasons}).")
        except Exception as error:                                       # reported, not fatal: the tables stand
            lines.append(f"- {'causal' if causal else 'bidirectional'}: explain failed: "
                         f"{type(error).__name__}: {str(error).splitlines()[0]}")
    return lines + [""]


def _compiled_layer_table(clock, device, dtype, length: int) -> list[str]:
    """The whole layer as a GPU user trains it, under ``torch.compile``: in eager mode the router's and the
    head-sparse layout's many small kernels are bound by their launches at these sizes."""
    lines = ["## Whole MoH layer under torch.compile, forward + backward", "",
             f"N = {length}, batch × N = {clock.tokens} tokens, width 1024, MoH 50% (routing seed 0); each layer "
             "compiled once (default mode). Speedup over the compiled MHA layer.", "",
             "| kind | MHA | half the heads | dense-and-mask | head-sparse |", "|---|---|---|---|---|"]
    batch = max(1, clock.tokens // length)
    x = torch.randn(batch, length, HEADS * HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    for causal in (False, True):
        variants = {"mha": _layer(causal, None, "masked", device, dtype),
                    "half": _layer(causal, None, "masked", device, dtype, num_heads=HEADS // 2),
                    "masked": _layer(causal, FRACTIONS["50%"], "masked", device, dtype),
                    "sparse": _layer(causal, FRACTIONS["50%"], "sparse", device, dtype)}
        times = {name: clock(_layer_step(torch.compile(layer), x)) for name, layer in variants.items()}
        mha = times["mha"]
        lines.append(f"| {'causal' if causal else 'bidirectional'} | {mha * 1e3:.3f} ms | "
                     + " | ".join(_speedup_cell(mha, [times[name]]) for name in ("half", "masked", "sparse")) + " |")
    return lines + [""]


def _auto_table(wins: dict) -> list[str]:
    """The ``CUDA_SPARSE`` entries these tables support: per kind, from the shortest length at which the head-sparse
    layer beat dense-and-mask (and every longer one measured), up to the largest fraction that did."""
    table = {}
    for kind in ("bidirectional", "causal", "decode"):
        for name in sorted(FRACTIONS, key=lambda n: FRACTIONS[n], reverse=True):
            if wins.get((kind, name)):
                table[kind] = (min(wins[(kind, name)]), (SHARED + FRACTIONS[name]) / HEADS)
                break
    return ["## What `auto` should pick on this GPU", "",
            "Paste into `moh_lightning/layers/head_sparse_cuda.py` (a kind missing here stays dense-and-mask):", "",
            "```python", f"CUDA_SPARSE = {table!r}", "```", ""]


def _header(device, dtype: str, quick: bool, seconds: float, min_run_time: float) -> list[str]:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test: CPU backend)"
    command = "python benchmarks/attention_cuda.py" + (" --quick true" if quick else "")
    return ["# MoH attention on a GPU: head-sparse execution vs SDPA over all heads", "",
            f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {seconds / 60:.1f} "
            f"min. Device: {where}; torch {torch.__version__}, CUDA {torch.version.cuda}; {dtype}; head_dim "
            f"{HEAD_DIM}. Times: `torch.utils.benchmark` medians, at least {min_run_time} s of runs per cell.", ""]


def main(args: list[str] | None = None) -> Path:
    return CLI(bench, args=args, as_positional=False)


if __name__ == "__main__":
    main()
