"""The whole-model tables: shipped configs' training steps MoH against dense, activation checkpointing, LLM-S
decoding and compiled against eager. Apart because they time networks, not one attention, with rows per config."""
from __future__ import annotations

import statistics

import torch

from moh_lightning.layers.moh_attention import checkpoint_blocks
from moh_lightning.tools.bench.memory import peak_mib
from moh_lightning.tools.bench.model_step import model_step_parts, train_step
from moh_lightning.tools.bench.report import Report
from moh_lightning.tools.bench.shapes import BATCH
from moh_lightning.tools.bench.timing import Clock, median_ms, paired_ratio, times_ms

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


def _seq_len(family: str, batch: int) -> int | None:
    return 1024 if family == "llm" and batch == 1 else None


def model_section(report: Report, clock: Clock, models, repeats: int, warmup: int, quick: bool) -> None:
    report.section("models")
    rows = []
    for family, batch, shape, names, wanted in models:
        if quick:  # the dense config and the first MoH one, an eighth of the batch
            names, batch = names[:2], batch // 8
        steps = {name: train_step(*model_step_parts(name, batch, clock.device, _seq_len(family, batch)))
                 for name in names}
        heavy = family == "llm" and batch == 1 or names[0] in ("vit_s_100", "dit_s2_100")
        # The CPU defaults' targets are a few percent: three times the rounds, unless quick.
        runs = ((repeats if quick else 3 * repeats), warmup) if not heavy else (max(3, (repeats + 1) // 2), 1)
        times = times_ms(steps, *runs, clock)
        for name in names:
            ratio, low, high = paired_ratio(times[name], times[names[0]])
            rows.append([name, f"batch {batch}, {shape}", f"{statistics.median(times[name]):.1f}",
                         f"{ratio:.3f}× [{low:.3f}, {high:.3f}]"])
            if name != names[0]:
                report.finding("training step of", f"{name} (dense: {names[0]})", "", "",
                               paired_ratio(times[names[0]], times[name]))
            if name == names[1] and wanted is not None:
                report.target(f"{name} / {names[0]} training step", f"≤ {wanted:.2f}×", ratio, ratio <= wanted,
                              f" (rounds' quartiles {low:.2f}-{high:.2f})")
    report.table(["config", "input", "step ms", "vs dense (median of the rounds' ratios [quartiles])"], rows)


def checkpointing_section(report: Report, clock: Clock, repeats: int, warmup: int) -> None:
    report.section("checkpointing")
    rows = []
    cases = [(family, batch, names[1]) for family, batch, _, names, _ in MODELS if names[0] != "llm_s_100"]
    for family, batch, name in cases:
        args = ["--model", name, "--batch", str(batch)]
        seq_len = _seq_len(family, batch)
        if seq_len:
            args += ["--seq_len", str(seq_len)]
        plain, saved = peak_mib(*args), peak_mib(*args, "--checkpointing")
        model, inputs, loss_fn = model_step_parts(name, batch, clock.device, seq_len)
        checkpointed = model_step_parts(name, batch, clock.device, seq_len)
        checkpoint_blocks(checkpointed[0])
        heavy = name in ("vit_s_75", "dit_s2_90")
        ms = median_ms({"plain": train_step(model, inputs, loss_fn), "checkpointed": train_step(*checkpointed)},
                       *((repeats, warmup) if not heavy else (max(3, (repeats + 1) // 2), 1)), clock)
        rows.append([name, batch, f"{plain:.0f}", f"{saved:.0f}", f"{1 - saved / plain:.0%}",
                     f"{ms['plain']:.1f}", f"{ms['checkpointed']:.1f} ({ms['checkpointed'] / ms['plain']:.2f}×)"])
    report.table(["config", "batch", "peak MiB", "checkpointed peak MiB", "memory saved", "step ms",
                  "checkpointed step ms"], rows)


def decode_model_section(report: Report, clock: Clock, repeats: int, warmup: int) -> None:
    from moh_lightning.layers.moh_config import MoHConfig
    from moh_lightning.models.llama import LlamaConfig, MoHLlama

    llm_s = {"llm_s_100": None, "llm_s_75": MoHConfig(6, 3), "llm_s_50": MoHConfig(3, 3)}
    report.section("decode_model")
    rows = []
    for length in (1024, 4096):
        fns = {}
        for name in llm_s:
            torch.manual_seed(0)
            model = MoHLlama(LlamaConfig(block_size=length + 1, moh=llm_s[name])).to(clock.device).eval()
            caches = model.init_kv_caches(BATCH, length + 1)
            for cache in caches:
                cache.k.normal_(), cache.v.normal_()
            token = torch.randint(0, model.config.vocab_size, (BATCH, 1), device=clock.device)

            def step(model=model, caches=caches, token=token, length=length):
                for cache in caches:
                    cache.length = length
                model(token, caches)
            fns[name] = step
        with torch.no_grad():
            ms = median_ms(fns, repeats, warmup, clock)
        rows += [[length, name, f"{ms[name]:.1f}", f"{BATCH / ms[name] * 1e3:.1f}",
                  f"{ms['llm_s_100'] / ms[name]:.2f}×"] for name in fns]
    report.table(["cache", "model", "ms/step", "tokens/s", "speedup"], rows)


def compiled_section(report: Report, clock: Clock, repeats: int, warmup: int, backend: str) -> None:
    report.section("compiled", backend=backend)
    rows = []
    for _family, batch, shape, names, _ in CPU_DEFAULTS:
        for name in names[:2]:
            torch._dynamo.reset()
            eager = train_step(*model_step_parts(name, batch, clock.device))
            model, inputs, loss_fn = model_step_parts(name, batch, clock.device)
            model.compile(backend=backend)
            compiled = train_step(model, inputs, loss_fn)
            compile_s = clock.once_s(compiled)
            ms = median_ms({"eager": eager, "compiled": compiled}, repeats, warmup, clock)
            rows.append([name, f"batch {batch}, {shape}", f"{compile_s:.0f}", f"{ms['eager']:.1f}",
                         f"{ms['compiled']:.1f} ({ms['eager'] / ms['compiled']:.2f}× faster)"])
    report.table(["config", "input", "compile s", "eager step ms", "compiled step ms"], rows)
