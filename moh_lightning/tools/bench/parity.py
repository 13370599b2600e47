"""``moh bench --parity true``: ``moh fit``'s steady-state training step against a bare PyTorch loop of the same
network, batch, optimizer and loss, for each task's embedded CPU default; Lightning's parity benchmark
(``tests/parity_pytorch``) holds its loop to the same.

``moh fit`` runs as a user runs it, a process of its own (``python -m moh_lightning.cli fit``), with validation and
the progress bar off, on the CPU, and one callback more: ``StepClock`` notes when each training batch starts. The
window is ``steps`` batches after ``WARMUP`` (and after any callback that starts late: the DiT recipe's EMA from step
400); the step is the median, over the window's logging periods (``log_every_n_steps`` batches, each holding one
logging window), of their mean time between batch starts (``step_ms``): what comes every logging window counts, and
a spell of load from other work on the machine falls in a period or two, not in the median. The bare loop runs in a
fresh process too (``python -m moh_lightning.tools.bench.parity bare``): the task and data module that run saved in
its last checkpoint, the optimizer and scheduler of the task's ``configure_optimizers`` (a Lightning ``fit`` of no steps
builds them), one batch of the real loader kept in memory, and per step the task's ``training_step`` (its loss and
the load-balance term; ``self.log`` a no-op), ``zero_grad``, ``backward``, the run's gradient clipping,
``optimizer.step`` and the scheduler's step, in the run's precision. A repeat is one ``moh fit`` and then one bare
loop; its ratio is fit / bare, and the page gives the median over the repeats and their range.

One more ``moh fit`` per config runs with Lightning's ``SimpleProfiler`` over the same window (``quick``: the timed
run itself), which splits its step into the data, ``training_step``, ``backward``, the optimizer, each callback and
the rest (Lightning's loop and the logging outside ``training_step``), beside the bare loop's own parts. Rows go to
``parity.json`` (one per config, a later row of the same config replacing it) and the page ``parity.md`` beside it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.profilers import SimpleProfiler

from moh_lightning.configs import load_config
from moh_lightning.serialization import load_file
from moh_lightning.tools.bench.report import cpu_name, shared_machine

# Each task's embedded CPU default, as the README names them.
CONFIGS = ["vit_tiny_mnist_75", "dit_mnist_90", "llm_stdlib_75"]
WARMUP = 10  # steps before the window: the allocator's, the first logging window's and the loader's first costs
QUICK = {"repeats": 1, "steps": 10, "warmup": 3}
TARGET = 1.10
# Lightning's SimpleProfiler actions (2.x) of the parts of a training step.
DATA = ("[_TrainingEpochLoop].train_dataloader_next", "batch_to_device")
BACKWARD_HOOKS = ("on_before_backward", "on_after_backward")  # called inside the strategy's backward
OPTIMIZER_HOOKS = ("on_before_zero_grad", "on_before_optimizer_step")  # inside the optimizer step, outside backward


class StepClock(Callback):
    """Notes when each training batch starts (wall and process CPU clocks), the checkpoints and epochs, and with a
    ``SimpleProfiler`` each action's calls between batch ``first`` and batch ``last``; writes them to ``path`` when
    training ends, with the trainer settings the bare loop repeats. What ``moh bench --parity true`` times by.

    Args:
        path: The JSON file to write.
        first: The batch (counted from 0 in this run) whose start opens the profiled window.
        last: The batch whose start closes it.
    """

    def __init__(self, path: str, first: int = 0, last: int = 0) -> None:
        super().__init__()
        self.path, self.first, self.last = Path(path), first, last
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.checkpoints: list[int] = []
        self.epochs: list[int] = []
        self.batch = 0
        self._counts: dict[str, int] = {}
        self.profile: dict[str, list[float]] = {}

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epochs.append(len(self.wall))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        index = len(self.wall)  # batch_idx starts again at each epoch
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if index == 0:
            self.batch = batch_size(batch)
        if isinstance(trainer.profiler, SimpleProfiler) and index in (self.first, self.last):
            recorded = trainer.profiler.recorded_durations
            if index == self.first:
                self._counts = {name: len(durations) for name, durations in recorded.items()}
            else:  # each action's (seconds, calls, longest call) in the window
                since = {name: durations[self._counts.get(name, 0):] for name, durations in recorded.items()}
                self.profile = {name: [sum(d), len(d), max(d)] for name, d in since.items() if d}

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self.checkpoints.append(len(self.wall) - 1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        settings = {"gradient_clip_val": trainer.gradient_clip_val,
                    "gradient_clip_algorithm": trainer.gradient_clip_algorithm, "precision": str(trainer.precision),
                    "accumulate_grad_batches": trainer.accumulate_grad_batches, "max_epochs": trainer.max_epochs,
                    "log_every_n_steps": trainer.log_every_n_steps}
        self.path.write_text(json.dumps({
            "wall": self.wall, "cpu": self.cpu, "checkpoints": self.checkpoints, "epochs": self.epochs,
            "batch": self.batch, "task": type(pl_module).__name__, "threads": torch.get_num_threads(),
            "settings": settings, "profile": self.profile}))


def batch_size(batch) -> int:
    """Samples in a batch: the length of its first tensor (images, or a dict's token windows)."""
    return len(batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())))


def late_start(config: str) -> int:
    """The step from which every callback of ``config`` does its per-step work: a weight average's
    ``update_starting_at_step`` (the DiT recipe's EMA starts at 400), else 0."""
    callbacks = (load_config(f"{config}.yaml").get("trainer") or {}).get("callbacks") or []
    starts = [(c.get("init_args") or {}).get("update_starting_at_step") or 0 for c in callbacks if isinstance(c, dict)]
    return max(starts, default=0)


def fit_run(config: str, folder: Path, first: int, steps: int, profile: bool) -> dict:
    """``moh fit --config <config>`` for ``first + steps + 1`` steps in ``folder``: its ``StepClock`` record, and the
    path of its last checkpoint."""
    folder = folder.resolve()  # the run's own working folder
    clock = folder / "clock.json"
    command = [sys.executable, "-m", "moh_lightning.cli", "fit", "--config", config,
               "--trainer.max_steps", str(first + steps + 1), "--trainer.limit_val_batches", "0",
               "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
               f"--trainer.callbacks+={__spec__.name}.StepClock", "--trainer.callbacks.init_args.path", str(clock),
               "--trainer.callbacks.init_args.first", str(first),
               "--trainer.callbacks.init_args.last", str(first + steps)]
    _run(command + (["--trainer.profiler", "simple"] if profile else []), folder, f"moh fit --config {config}")
    record = json.loads(clock.read_text())
    record["checkpoint"] = str(next(folder.glob("runs/*/version_*/checkpoints/last.ckpt")))
    return record


def bare_run(checkpoint: str, settings: dict, first: int, steps: int, folder: Path) -> dict:
    """The bare loop of ``checkpoint``'s task, in a fresh process (``bare_loop``)."""
    out = folder.resolve() / "bare.json"
    command = [sys.executable, "-m", __spec__.name, "bare", "--checkpoint", checkpoint, "--settings",
               json.dumps(settings), "--first", str(first), "--steps", str(steps), "--out", str(out)]
    _run(command, folder, "the bare loop")
    return json.loads(out.read_text())


def _run(command: list[str], folder: Path, what: str) -> None:
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"moh bench: parity: {what} failed (exit {done.returncode}): {' '.join(last)}")


@contextmanager
def logging_off(task: LightningModule) -> Iterator[None]:
    """The task's ``self.log`` and ``self.log_dict`` as no-ops: outside Lightning's loop nothing collects them, and
    what logging costs is the loop's share of the gap."""
    task.log = task.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del task.log, task.log_dict


def bare_loop(checkpoint: str, settings: dict, first: int, steps: int) -> dict:
    """``first + steps + 1`` bare steps of ``checkpoint``'s task on one batch of its loader: when each step starts
    (wall and CPU clocks) and the seconds of its parts in the window."""
    if settings["accumulate_grad_batches"] != 1:
        raise SystemExit("moh bench: parity: the bare loop steps the optimizer every batch; the run accumulates "
                         f"{settings['accumulate_grad_batches']} batches.")
    raw = load_file(checkpoint, map_location="cpu")
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):  # Lightning loads only classes already imported
        module = raw[key]["_class_path"].rpartition(".")[0]
        if module.startswith("moh_lightning."):
            importlib.import_module(module)
    task = LightningModule.load_from_checkpoint(checkpoint, map_location="cpu")
    data = LightningDataModule.load_from_checkpoint(checkpoint)
    # A fit of no steps: the task's configure_optimizers, with a trainer to read, and the data module set up.
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=0, max_epochs=settings["max_epochs"],
                      precision=settings["precision"], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=data)
    (optimizer,) = trainer.optimizers
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip, by_value = settings["gradient_clip_val"], settings["gradient_clip_algorithm"] == "value"
    batch = next(iter(data.train_dataloader()))
    task.train()
    wall, cpu = [], []
    parts = {"data": 0.0, "training_step": 0.0, "backward": 0.0, "optimizer": 0.0}  # data: the batch is in memory
    with logging_off(task):
        for i in range(first + steps + 1):
            wall.append(time.perf_counter())
            cpu.append(time.process_time())
            with trainer.precision_plugin.train_step_context():
                loss = task.training_step(batch, i)
            forward = time.perf_counter()
            optimizer.zero_grad()
            zeroed = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            if clip and by_value:
                torch.nn.utils.clip_grad_value_(params, clip)
            elif clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            for scheduler in schedulers:
                task.lr_scheduler_step(scheduler, None)
            if first <= i < first + steps:
                parts["training_step"] += forward - wall[-1]
                parts["backward"] += backward - zeroed
                parts["optimizer"] += zeroed - forward + time.perf_counter() - backward
    return {"wall": wall, "cpu": cpu, "parts": parts, "threads": torch.get_num_threads(), "batch": batch_size(batch)}


def window(stamps: list[float], first: int, steps: int) -> list[float]:
    """The ``steps`` periods between batch starts from batch ``first`` on."""
    return [b - a for a, b in zip(stamps[first:first + steps], stamps[first + 1:first + steps + 1], strict=True)]


def breakdown(profile: dict[str, list[float]], steps: int, period_ms: float) -> dict:
    """A profiled fit's window in ms per step: the parts of its step that the bare loop also has, and each callback
    (its costliest hook: name, calls, longest call); ``rest``, the period less all of them, is Lightning's loop and
    the logging outside ``training_step``."""
    def ms(names) -> float:
        return sum(profile[n][0] for n in names) * 1e3 / steps

    def hook(name: str) -> str:
        return name.rpartition(".")[2]

    def named(prefix: str, suffix: str) -> list[str]:
        return [n for n in profile if n.startswith(prefix) and n.endswith(suffix)]

    nested = [n for n in profile if n.startswith(("[Callback]", "[LightningModule]"))]
    callbacks: dict[str, dict] = {}
    for name in profile:
        if name.startswith("[Callback]") and not name.startswith("[Callback]StepClock"):
            owner = name.removeprefix("[Callback]").rpartition(".")[0].split("{")[0]
            entry = callbacks.setdefault(owner, {"ms": 0.0, "hook": "", "calls": 0, "longest_ms": 0.0})
            entry["ms"] += profile[name][0] * 1e3 / steps
            if profile[name][0] * 1e3 / steps > entry.get("_hook_ms", 0.0):
                entry.update(_hook_ms=profile[name][0] * 1e3 / steps, hook=hook(name), calls=profile[name][1],
                             longest_ms=profile[name][2] * 1e3)
    for entry in callbacks.values():
        del entry["_hook_ms"]
    backward = ms(named("[Strategy]", ".backward")) - ms(n for n in nested if hook(n) in BACKWARD_HOOKS)
    training_step = ms(named("[Strategy]", ".training_step"))
    optimizer = (ms(named("[LightningModule]", ".optimizer_step")) - training_step
                 - ms(named("[Strategy]", ".backward")) - ms(n for n in nested if hook(n) in OPTIMIZER_HOOKS)
                 + ms(named("[LightningModule]", ".lr_scheduler_step")))
    parts = {"data": ms(n for n in profile if n.endswith(DATA)), "training_step": training_step,
             "backward": backward, "optimizer": optimizer}
    parts["rest"] = period_ms - sum(parts.values()) - sum(entry["ms"] for entry in callbacks.values())
    return {"parts": parts, "callbacks": dict(sorted(callbacks.items(), key=lambda kv: -kv[1]["ms"]))}


def step_ms(stamps: list[float], first: int, steps: int, block: int) -> float:
    """The step in ms: the median, over the window's blocks of ``block`` steps (a logging period each), of their mean
    step. Each block holds one logging window; a spell of load from other work falls in a block or two, not in the
    median."""
    periods = window(stamps, first, steps)
    blocks = [periods[i:i + block] for i in range(0, len(periods) - block + 1, block)] or [periods]
    return statistics.median(statistics.mean(b) for b in blocks) * 1e3


def timings(record: dict, first: int, steps: int, block: int) -> dict[str, float]:
    """One run's step in ms by each clock: ``step_ms`` of the wall and of the process CPU clock, and the plain median
    and mean of the window's steps."""
    periods = window(record["wall"], first, steps)
    return {"ms": step_ms(record["wall"], first, steps, block), "cpu_ms": step_ms(record["cpu"], first, steps, block),
            "median_ms": statistics.median(periods) * 1e3, "mean_ms": statistics.mean(periods) * 1e3}


def parity_row(config: str, repeats: list[tuple[dict, dict, list[float]]], profiled: dict | None, first: int,
               steps: int, late: int) -> dict:
    """One row of ``parity.json`` from the repeats' (fit record, bare record, load) and the profiled fit's record."""
    block = repeats[0][0]["settings"]["log_every_n_steps"]
    runs = []
    for fit, bare, load in repeats:
        ours, theirs = timings(fit, first, steps, block), timings(bare, first, steps, block)
        runs.append({"fit": ours, "bare": theirs, "ratio": ours["ms"] / theirs["ms"],
                     "cpu_ratio": ours["cpu_ms"] / theirs["cpu_ms"],
                     "median_ratio": ours["median_ms"] / theirs["median_ms"], "load": load,
                     "checkpoints": [b for b in fit["checkpoints"] if first <= b < first + steps],
                     "epoch_ends": [b - 1 for b in fit["epochs"] if first < b <= first + steps]})
    ratios = [r["ratio"] for r in runs]
    fit, bare, _ = repeats[0]
    row = {"config": config, "task": fit["task"], "batch": fit["batch"], "bare_batch": bare["batch"], "device": "cpu",
           "cpu": cpu_name(), "cores": os.cpu_count(), "threads": fit["threads"], "bare_threads": bare["threads"],
           "first": first, "steps": steps, "late_start": late, "log_every_n_steps": block,
           "fit_ms": statistics.median(r["fit"]["ms"] for r in runs),
           "bare_ms": statistics.median(r["bare"]["ms"] for r in runs),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "cpu_ratio": statistics.median(r["cpu_ratio"] for r in runs),
           "median_ratio": statistics.median(r["median_ratio"] for r in runs), "repeats": runs,
           "torch": torch.__version__, "lightning": lightning.__version__,
           "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if profiled is not None:  # means of the window's steps, as the profiler's sums are: the bare run of median mean
        period = statistics.mean(window(profiled["wall"], first, steps)) * 1e3
        _, bare, _ = sorted(repeats, key=lambda r: statistics.mean(window(r[1]["wall"], first, steps)))[
            (len(repeats) - 1) // 2]
        bare_parts = {name: seconds * 1e3 / steps for name, seconds in bare["parts"].items()}
        bare_parts["rest"] = statistics.mean(window(bare["wall"], first, steps)) * 1e3 - sum(bare_parts.values())
        row["profile"] = {"period_ms": period, "bare_ms": sum(bare_parts.values()),
                          **breakdown(profiled["profile"], steps, period), "bare_parts": bare_parts}
    return row


def bench_parity(output: str = "results/parity.json", configs: list[str] | None = None, repeats: int = 3,
                 steps: int = 40, profile: bool = True, quick: bool = False,
                 command: str = "moh bench --parity true") -> Path:
    """Measures each config (``repeats`` x a ``moh fit`` and a bare loop, then a profiled ``moh fit``), prints its
    row, and rewrites ``output`` and its ``.md`` page after each."""
    warmup = WARMUP
    if quick:
        repeats, steps, warmup = QUICK["repeats"], QUICK["steps"], QUICK["warmup"]
    path = Path(output)
    rows = json.loads(path.read_text()) if path.is_file() else []
    for config in configs or CONFIGS:
        late = 0 if quick else late_start(config)
        first = warmup + late
        measured = []
        with tempfile.TemporaryDirectory(prefix="moh_parity_") as scratch:
            for repeat in range(repeats):
                folder = Path(scratch) / f"repeat_{repeat}"
                folder.mkdir()
                load_before = os.getloadavg()[0]
                fit = fit_run(config, folder, first, steps, profile=quick and profile)
                bare = bare_run(fit["checkpoint"], fit["settings"], first, steps, folder)
                measured.append((fit, bare, [load_before, os.getloadavg()[0]]))
                block = fit["settings"]["log_every_n_steps"]
                print(f"moh bench: parity {config} repeat {repeat + 1}/{repeats}: moh fit "
                      f"{step_ms(fit['wall'], first, steps, block):.1f} ms/step, bare loop "
                      f"{step_ms(bare['wall'], first, steps, block):.1f} ms/step", flush=True)
            profiled = measured[0][0] if quick else None
            if profile and not quick:
                (Path(scratch) / "profile").mkdir()
                profiled = fit_run(config, Path(scratch) / "profile", first, steps, profile=True)
        row = parity_row(config, measured, profiled if profile else None, first, steps, late)
        row["command"] = command
        rows = [r for r in rows if r["config"] != config] + [row]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")  # after every config: a stopped bench keeps its rows
        path.with_suffix(".md").write_text(page(rows))
        print(f"moh bench: parity {config}: moh fit / bare loop = {row['ratio']:.2f} (min {row['ratio_min']:.2f}, "
              f"max {row['ratio_max']:.2f}; {row['fit_ms']:.1f} / {row['bare_ms']:.1f} ms) -> {path}", flush=True)
    return path


PARTS = {"data": "data: the next batch (loading, augmenting) and its transfer",
         "training_step": "`training_step`: forward and loss (in `moh fit` also its `self.log` calls)",
         "backward": "`backward`", "optimizer": "optimizer: `zero_grad`, clipping, `step`, the scheduler's step",
         "rest": "the rest: Lightning's loop, logging outside `training_step`"}


def page(rows: list[dict]) -> str:
    """``parity.json`` as a Markdown page: the ratios, then where each config's gap is."""
    commands = list(dict.fromkeys(r["command"] for r in rows))
    first = rows[0]
    lines = [
        "# Loop parity: `moh fit`'s training step against a bare PyTorch loop", "",
        f"Generated by `{'`, `'.join(commands)}`. Machine: {first['cpu']}, {first['cores']} CPU cores; torch "
        f"{first['torch']}, Lightning {first['lightning']}; {first['threads']} torch threads in both loops.", "",
        "Each repeat runs `moh fit --config <config>` (validation and the progress bar off, on the CPU) and then a "
        "bare PyTorch loop of the same network, batch, optimizer and loss, each in a process of its own. The bare loop "
        "takes the task and data module from that run's last checkpoint, the optimizer and scheduler from the task's "
        "`configure_optimizers`, one batch of the real loader kept in memory, and runs the task's `training_step` "
        "(loss and load-balance term; `self.log` a no-op), `zero_grad`, `backward`, the run's gradient clipping, "
        "`optimizer.step` and the scheduler's step. A step is the median, over the window's logging periods "
        "(`log_every_n_steps` steps each, so each holds one logging window), of their mean time between batch starts; "
        "ratio = moh fit / bare loop, the median over the repeats and their range. The CPU-time ratio is the same on "
        "the process CPU clock, which other work on the machine disturbs less; the median-step ratio leaves out what "
        "comes only every few steps.", "",
        f"| config | task | batch | window (steps) | moh fit ms/step | bare loop ms/step | ratio (range) | "
        f"≤ {TARGET:.2f} | CPU-time ratio | median-step ratio | load (1 min) | measured |",
        "|" + "---|" * 12]
    for r in rows:
        loads = [x for run in r["repeats"] for x in run["load"]]
        count = len(r["repeats"])
        lines.append(
            f"| {r['config']} | {r['task']} | {r['batch']} | {r['first']}-{r['first'] + r['steps'] - 1} | "
            f"{r['fit_ms']:.1f} | {r['bare_ms']:.1f} | {r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, "
            f"{count} repeat{'s' if count > 1 else ''}) | {'yes' if r['ratio'] <= TARGET else '**no**'} | "
            f"{r['cpu_ratio']:.2f} | {r['median_ratio']:.2f} | {min(loads):.1f}-{max(loads):.1f} | {r['measured']} |")
    busy = shared_machine([max(x for r in rows for run in r["repeats"] for x in run["load"])], [0.0])
    if busy:
        lines += ["", f"{busy}: each ratio pairs two runs made back to back, but load that falls on one of them "
                      f"moves it; the range and the CPU-time ratio show by how much."]
    for r in rows:
        lines += _gap_section(r)
    return "\n".join(lines) + "\n"


def _gap_section(row: dict) -> list[str]:
    """Where one config's gap is: the profiled fit's parts beside the bare loop's, and each callback."""
    profile = row.get("profile")
    if profile is None:
        return []
    fit, bare = profile["parts"], profile["bare_parts"]
    late = f", after the EMA starts at step {row['late_start']}" if row["late_start"] else ""
    events = row["repeats"][0]
    periodic = [f"a logging window every {row['log_every_n_steps']} steps"]
    for name, count in (("epoch end", len(events["epoch_ends"])), ("checkpoint", len(events["checkpoints"]))):
        if count:
            periodic.append(f"{count} {name}{'s' if count > 1 else ''}")
    gap = profile["period_ms"] - profile["bare_ms"]
    lines = ["", f"## Where the gap is: {row['config']}", "",
             f"One more `moh fit` with `--trainer.profiler simple` over the same window (steps {row['first']}-"
             f"{row['first'] + row['steps'] - 1}{late}; in it {', '.join(periodic)}), beside the repeat whose bare "
             f"loop took the median time; both as means of the window's steps.", "",
             "| part of the step | moh fit ms | bare loop ms | gap ms |", "|---|---|---|---|"]
    for name in ("data", "training_step", "backward", "optimizer"):
        lines.append(f"| {PARTS[name]} | {fit[name]:.2f} | {bare[name]:.2f} | {fit[name] - bare[name]:+.2f} |")
    small = []
    for name, entry in profile["callbacks"].items():
        if entry["ms"] < 0.005:
            small.append(entry["ms"])
            continue
        lines.append(f"| callback `{name}` (most in `{entry['hook']}`: {entry['calls']} calls, the longest "
                     f"{entry['longest_ms']:.1f} ms) | {entry['ms']:.2f} | 0 | {entry['ms']:+.2f} |")
    if small:
        lines.append(f"| {len(small)} other callbacks, under 0.005 ms each | {sum(small):.3f} | 0 | "
                     f"{sum(small):+.3f} |")
    lines += [f"| {PARTS['rest']} | {fit['rest']:.2f} | {bare['rest']:.2f} | {fit['rest'] - bare['rest']:+.2f} |",
              f"| **step** | **{profile['period_ms']:.1f}** | **{profile['bare_ms']:.1f}** | **{gap:+.1f}** |"]
    return lines


def _main() -> None:
    """``python -m moh_lightning.tools.bench.parity bare ...``: one bare loop, its record written to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m moh_lightning.tools.bench.parity")
    parser.add_argument("command", choices=["bare"])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--settings", required=True, help="the fit's trainer settings (StepClock's), as JSON")
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = bare_loop(args.checkpoint, json.loads(args.settings), args.first, args.steps)
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    _main()


__all__ = ["CONFIGS", "StepClock", "bare_loop", "batch_size", "bench_parity", "breakdown", "late_start", "page",
           "parity_row", "step_ms", "timings", "window"]
