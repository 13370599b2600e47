"""``python benchmarks/parity.py``: ``moh fit``'s steady-state training step against a bare PyTorch loop of the same
network, batch, optimizer and loss, for each task's embedded CPU default; Lightning's parity benchmark
(``tests/parity_pytorch``) holds its loop to the same.

``moh fit`` runs as a user runs it, a process of its own (``python -m moh_lightning.cli fit``), with validation and
the progress bar off, on the CPU, and one callback more: ``StepClock`` notes when each training batch starts. The
window is ``steps`` batches after ``WARMUP`` (and after any callback that starts late: the DiT recipe's EMA from step
400), cut into logging periods (``log_every_n_steps`` batches, each holding one logging window); the step is the
mean time between batch starts in the fastest period (``timings``): every period holds the same work, what comes
every logging window included, and the fastest is the one that other work on the machine disturbed least (as
``timeit`` takes the fastest of its repeats).

Two bare loops run in fresh processes too (``python benchmarks/parity.py bare``): the task and data
module that run saved in its last checkpoint, the optimizer and scheduler of the task's ``configure_optimizers`` (a
Lightning ``fit`` of no steps builds them), and per step the task's ``training_step`` (its loss and the load-balance
term; ``self.log`` a no-op), ``zero_grad``, ``backward``, the run's gradient clipping, ``optimizer.step`` and the
scheduler's step, in the run's precision: one on a batch of the real loader kept in memory, one on a new batch of the
loader every step. Their window starts after ``WARMUP`` steps, with no callback to wait for. A repeat is one ``moh
fit`` and then the two bare loops; its ratio is fit / bare loop with the batch in memory, its loop ratio fit / bare
loop with the loader (what the loop, the callbacks and the logging add), its data ratio the one bare loop / the other
(what loading adds); the page gives the medians over the repeats, and the ratio's range.

One more ``moh fit`` per config runs with Lightning's ``SimpleProfiler`` over the same window (``quick``: the timed
run itself); its fastest period splits into the data, ``training_step``, ``backward``, the optimizer, each callback
and the rest (Lightning's loop and the logging outside ``training_step``), beside the parts of each kind of bare loop
in its fastest run's fastest period. Rows go to ``parity.json`` (one per config and thread count, a later row of the
same replacing it) and the page ``parity.md`` beside it.
"""
from __future__ import annotations

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
from itertools import pairwise
from pathlib import Path

import lightning
import torch
from jsonargparse import CLI
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.profilers import SimpleProfiler

from moh_lightning.configs import load_config
from moh_lightning.serialization import load_file
from moh_lightning.tools.bench.report import cpu_name, shared_machine

# The repository's root: the ``moh fit`` process imports ``StepClock`` from here, as ``benchmarks.parity``.
ROOT = Path(__file__).resolve().parents[1]
# Each task's embedded CPU default, as the docs name them.
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
    ``SimpleProfiler`` each action's calls in each logging period of the window from batch ``first`` to batch
    ``last`` (``periods``); writes them to ``path`` when training ends, with the trainer settings the bare loop
    repeats. What ``benchmarks/parity.py`` times ``moh fit`` by.

    Args:
        path: The JSON file to write.
        first: The batch (counted from 0 in this run) whose start opens the window.
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
        self.profile: list[dict[str, list[float]]] = []  # per period: action -> (seconds, calls, longest call)
        self._counts: dict[str, int] = {}

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epochs.append(len(self.wall))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        index = len(self.wall)  # batch_idx starts again at each epoch
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if index == 0:
            self.batch = batch_size(batch)
        bounds = periods(self.first, self.last - self.first, trainer.log_every_n_steps)
        if not isinstance(trainer.profiler, SimpleProfiler) or index not in bounds:
            return
        recorded = trainer.profiler.recorded_durations
        if index > self.first:
            since = {name: durations[self._counts.get(name, 0):] for name, durations in recorded.items()}
            self.profile.append({name: [sum(d), len(d), max(d)] for name, d in since.items() if d})
        self._counts = {name: len(durations) for name, durations in recorded.items()}

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


def periods(first: int, steps: int, block: int) -> list[int]:
    """The batches that start each logging period of the window of ``steps`` batches from ``first``, and the one
    after the last: ``steps // block`` periods of ``block`` batches (one of all ``steps`` when they are fewer). Each
    period holds one logging window."""
    if steps < block:
        return [first, first + steps]
    return [first + k * block for k in range(steps // block + 1)]


def period_means(stamps: list[float], bounds: list[int]) -> list[float]:
    """Each period's mean step in seconds: the time between its first batch's start and the next period's."""
    return [(stamps[end] - stamps[start]) / (end - start) for start, end in pairwise(bounds)]


def fastest_period(means: list[float]) -> int:
    """The period whose mean step is the shortest: each holds the same work, so the fastest is the one that other
    work on the machine disturbed least."""
    return min(range(len(means)), key=means.__getitem__)


def batch_size(batch) -> int:
    """Samples in a batch: the length of its first tensor (images, or a dict's token windows)."""
    return len(batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())))


def late_start(config: str) -> int:
    """The step from which every callback of ``config`` does its per-step work: a weight average's
    ``update_starting_at_step`` (the DiT recipe's EMA starts at 400), else 0."""
    callbacks = (load_config(f"{config}.yaml").get("trainer") or {}).get("callbacks") or []
    starts = [(c.get("init_args") or {}).get("update_starting_at_step") or 0 for c in callbacks if isinstance(c, dict)]
    return max(starts, default=0)


def fit_run(config: str, folder: Path, first: int, steps: int, profile: bool, threads: int | None = None) -> dict:
    """``moh fit --config <config>`` for ``first + steps + 1`` steps in ``folder`` (``threads``: its torch threads,
    through ``OMP_NUM_THREADS``): its ``StepClock`` record, and the path of its last checkpoint."""
    folder = folder.resolve()  # the run's own working folder
    clock = folder / "clock.json"
    command = [sys.executable, "-m", "moh_lightning.cli", "fit", "--config", config,
               "--trainer.max_steps", str(first + steps + 1), "--trainer.limit_val_batches", "0",
               "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
               "--trainer.callbacks+=benchmarks.parity.StepClock", "--trainer.callbacks.init_args.path", str(clock),
               "--trainer.callbacks.init_args.first", str(first),
               "--trainer.callbacks.init_args.last", str(first + steps)]
    _run(command + (["--trainer.profiler", "simple"] if profile else []), folder, threads,
         f"moh fit --config {config}")
    record = json.loads(clock.read_text())
    record["checkpoint"] = str(next(folder.glob("runs/*/version_*/checkpoints/last.ckpt")))
    return record


def bare_run(checkpoint: str, settings: dict, steps: int, folder: Path, threads: int | None = None,
             loader: bool = False) -> dict:
    """The bare loop of ``checkpoint``'s task for ``steps`` steps, in a fresh process (``bare_loop``)."""
    out = folder.resolve() / f"bare{'_loader' if loader else ''}.json"
    command = [sys.executable, str(ROOT / "benchmarks/parity.py"), "bare", "--checkpoint", checkpoint, "--settings",
               json.dumps(settings), "--steps", str(steps), "--out", str(out), "--loader", str(loader).lower()]
    _run(command, folder, threads, "the bare loop")
    return json.loads(out.read_text())


def _run(command: list[str], folder: Path, threads: int | None, what: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's threads, read at its start
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"parity: {what} failed (exit {done.returncode}): {' '.join(last)}")


@contextmanager
def logging_off(task: LightningModule) -> Iterator[None]:
    """The task's ``self.log`` and ``self.log_dict`` as no-ops: outside Lightning's loop nothing collects them, and
    what logging costs is the loop's share of the gap."""
    task.log = task.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del task.log, task.log_dict


def bare_setup(checkpoint: str, settings: dict) -> tuple[LightningModule, LightningDataModule, Trainer]:
    """The task and data module a ``moh fit`` run saved in ``checkpoint``, and a trainer that has run a fit of no
    steps on them: the task's ``configure_optimizers`` has built its optimizer and scheduler, the data is set up."""
    if settings["accumulate_grad_batches"] != 1:
        raise SystemExit("parity: the bare loop steps the optimizer every batch; the run accumulates "
                         f"{settings['accumulate_grad_batches']} batches.")
    raw = load_file(checkpoint, map_location="cpu")
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):  # Lightning loads only classes already imported
        module = raw[key]["_class_path"].rpartition(".")[0]
        if module.startswith("moh_lightning."):
            importlib.import_module(module)
    task = LightningModule.load_from_checkpoint(checkpoint, map_location="cpu")
    data = LightningDataModule.load_from_checkpoint(checkpoint)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=0, max_epochs=settings["max_epochs"],
                      precision=settings["precision"], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=data)
    return task, data, trainer


def _endless(loader) -> Iterator:
    while True:  # epoch after epoch, as the fit's loop draws them
        yield from loader


def bare_loop(checkpoint: str, settings: dict, steps: int, loader: bool = False) -> dict:
    """``steps`` bare steps of ``checkpoint``'s task: when each starts (wall and CPU clocks), and the seconds of its
    parts. ``loader``: a new batch of the run's loader every step (its loading and augmenting are the ``data`` part),
    else the first one, kept in memory."""
    task, data, trainer = bare_setup(checkpoint, settings)
    (optimizer,) = trainer.optimizers
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip, by_value = settings["gradient_clip_val"], settings["gradient_clip_algorithm"] == "value"
    # Every batch passes the transfer hooks the fit's batches pass (the data module's device-side augmentation).
    batches = _endless(data.train_dataloader())
    batch = trainer.strategy.batch_to_device(next(batches))
    task.train()
    wall, cpu = [], []
    parts: dict[str, list[float]] = {"data": [], "training_step": [], "backward": [], "optimizer": []}
    with logging_off(task):
        for i in range(steps):
            wall.append(time.perf_counter())
            cpu.append(time.process_time())
            if loader:
                batch = trainer.strategy.batch_to_device(next(batches))
            fetched = time.perf_counter()
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
            parts["data"].append(fetched - wall[-1])
            parts["training_step"].append(forward - fetched)
            parts["backward"].append(backward - zeroed)
            parts["optimizer"].append(zeroed - forward + time.perf_counter() - backward)
    return {"wall": wall, "cpu": cpu, "parts": parts, "threads": torch.get_num_threads(), "batch": batch_size(batch)}


def breakdown(profile: dict[str, list[float]], steps: int, period_ms: float) -> dict:
    """A profiled period of a fit in ms per step: the parts of its step that the bare loop also has, and each callback
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
            entry = callbacks.setdefault(owner, {"ms": 0.0, "hook": "", "calls": 0, "longest_ms": 0.0, "hook_ms": 0.0})
            spent = ms([name])
            entry["ms"] += spent
            if spent > entry["hook_ms"]:
                entry.update(hook=hook(name), calls=profile[name][1], longest_ms=profile[name][2] * 1e3,
                             hook_ms=spent)
    backward = ms(named("[Strategy]", ".backward")) - ms(n for n in nested if hook(n) in BACKWARD_HOOKS)
    training_step = ms(named("[Strategy]", ".training_step"))
    optimizer = (ms(named("[LightningModule]", ".optimizer_step")) - training_step
                 - ms(named("[Strategy]", ".backward")) - ms(n for n in nested if hook(n) in OPTIMIZER_HOOKS)
                 + ms(named("[LightningModule]", ".lr_scheduler_step")))
    parts = {"data": ms(n for n in profile if n.endswith(DATA)), "training_step": training_step,
             "backward": backward, "optimizer": optimizer}
    parts["rest"] = period_ms - sum(parts.values()) - sum(entry["ms"] for entry in callbacks.values())
    return {"parts": parts, "callbacks": dict(sorted(callbacks.items(), key=lambda kv: -kv[1]["ms"]))}


def timings(record: dict, bounds: list[int]) -> dict[str, float]:
    """One run's step in ms: the fastest period's mean step by the wall and by the process CPU clock, and the plain
    median and mean of the window's steps."""
    steps = [b - a for a, b in pairwise(record["wall"][bounds[0]:bounds[-1] + 1])]
    wall, cpu = period_means(record["wall"], bounds), period_means(record["cpu"], bounds)
    return {"ms": min(wall) * 1e3, "cpu_ms": min(cpu) * 1e3,
            "median_ms": statistics.median(steps) * 1e3, "mean_ms": statistics.mean(steps) * 1e3}


def bare_parts(bare: dict, bounds: list[int]) -> dict[str, float]:
    """A bare loop's parts in ms per step in its fastest period; ``rest`` is the step less them."""
    means = period_means(bare["wall"], bounds)
    k = fastest_period(means)
    start, end = bounds[k], bounds[k + 1]
    parts = {name: sum(seconds[start:end]) * 1e3 / (end - start) for name, seconds in bare["parts"].items()}
    parts["rest"] = means[k] * 1e3 - sum(parts.values())
    return parts


def parity_row(config: str, repeats: list[dict], profiled: dict | None, warmup: int, steps: int, late: int) -> dict:
    """One row of ``parity.json`` from the repeats' records (``fit``, ``bare``: the batch in memory, ``loader``: the
    real loader, and the ``load``) and the profiled fit's: the fit's window starts after ``warmup + late`` steps, the
    bare loops' after ``warmup`` (no callback to wait for)."""
    block = repeats[0]["fit"]["settings"]["log_every_n_steps"]
    first = warmup + late
    bounds, bare_bounds = periods(first, steps, block), periods(warmup, steps, block)
    runs = []
    for repeat in repeats:
        fit, bare = timings(repeat["fit"], bounds), timings(repeat["bare"], bare_bounds)
        loader = timings(repeat["loader"], bare_bounds)
        runs.append({"fit": fit, "bare": bare, "loader": loader, "ratio": fit["ms"] / bare["ms"],
                     "loop_ratio": fit["ms"] / loader["ms"], "data_ratio": loader["ms"] / bare["ms"],
                     "cpu_ratio": fit["cpu_ms"] / bare["cpu_ms"], "mean_ratio": fit["mean_ms"] / bare["mean_ms"],
                     "median_ratio": fit["median_ms"] / bare["median_ms"], "load": repeat["load"],
                     "checkpoints": [b for b in repeat["fit"]["checkpoints"] if first <= b < first + steps],
                     "epoch_ends": [b - 1 for b in repeat["fit"]["epochs"] if first < b <= first + steps]})

    def median(*keys: str) -> float:
        return statistics.median(r[keys[0]][keys[1]] if len(keys) == 2 else r[keys[0]] for r in runs)

    ratios = [r["ratio"] for r in runs]
    fit, bare = repeats[0]["fit"], repeats[0]["bare"]
    row = {"config": config, "task": fit["task"], "batch": fit["batch"], "bare_batch": bare["batch"], "device": "cpu",
           "cpu": cpu_name(), "cores": os.cpu_count(), "threads": fit["threads"], "bare_threads": bare["threads"],
           "first": first, "steps": steps, "late_start": late, "log_every_n_steps": block,
           "fit_ms": median("fit", "ms"), "bare_ms": median("bare", "ms"), "loader_ms": median("loader", "ms"),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           **{key: median(key) for key in ("loop_ratio", "data_ratio", "cpu_ratio", "mean_ratio", "median_ratio")},
           "repeats": runs, "torch": torch.__version__, "lightning": lightning.__version__,
           "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if profiled is not None:  # each side's least disturbed period: the profiled fit's, the fastest bare loops'
        means = period_means(profiled["wall"], bounds)
        k = fastest_period(means)
        row["profile"] = {"period_ms": means[k] * 1e3, "period": [bounds[k], bounds[k + 1] - 1],
                          **breakdown(profiled["profile"][k], bounds[k + 1] - bounds[k], means[k] * 1e3)}
        for kind in ("bare", "loader"):
            fastest = min(range(len(runs)), key=lambda i: runs[i][kind]["ms"])
            row["profile"][f"{kind}_parts"] = bare_parts(repeats[fastest][kind], bare_bounds)
    return row


def bench_parity(output: str = "results/parity.json", configs: list[str] | None = None, repeats: int = 3,
                 steps: int = 60, profile: bool = True, quick: bool = False, threads: int | None = None,
                 command: str = "python benchmarks/parity.py") -> Path:
    """Measures each config (``repeats`` x a ``moh fit`` and a bare loop, then a profiled ``moh fit``, each process
    with ``threads`` torch threads, or torch's default), prints its row, and rewrites ``output`` and its ``.md`` page
    after each."""
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
                fit = fit_run(config, folder, first, steps, quick and profile, threads)
                bare = bare_run(fit["checkpoint"], fit["settings"], warmup + steps + 1, folder, threads)
                loader = bare_run(fit["checkpoint"], fit["settings"], warmup + steps + 1, folder, threads, loader=True)
                measured.append({"fit": fit, "bare": bare, "loader": loader,
                                 "load": [load_before, os.getloadavg()[0]]})
                block = fit["settings"]["log_every_n_steps"]
                print(f"parity: {config} repeat {repeat + 1}/{repeats}: moh fit "
                      f"{timings(fit, periods(first, steps, block))['ms']:.1f} ms/step, bare loop "
                      f"{timings(bare, periods(warmup, steps, block))['ms']:.1f} ms/step (with the loader "
                      f"{timings(loader, periods(warmup, steps, block))['ms']:.1f})", flush=True)
            profiled = measured[0]["fit"] if quick else None
            if profile and not quick:
                (Path(scratch) / "profile").mkdir()
                profiled = fit_run(config, Path(scratch) / "profile", first, steps, True, threads)
        row = parity_row(config, measured, profiled if profile else None, warmup, steps, late)
        row["command"] = command
        rows = [r for r in rows if (r["config"], r["threads"]) != (config, row["threads"])] + [row]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")  # after every config: a stopped bench keeps its rows
        path.with_suffix(".md").write_text(page(rows))
        print(f"parity: {config}: moh fit / bare loop = {row['ratio']:.2f} (min {row['ratio_min']:.2f}, "
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
        f"{first['torch']}, Lightning {first['lightning']}; each row's torch threads in all its loops.", "",
        "Each repeat runs `moh fit --config <config>` (validation and the progress bar off, on the CPU), then two bare "
        "PyTorch loops of the same network, batch, optimizer and loss, each in a process of its own. A bare loop takes "
        "the task and data module from that run's last checkpoint and the optimizer and scheduler from the task's "
        "`configure_optimizers`, and runs the task's `training_step` (loss and load-balance term; `self.log` a "
        "no-op), `zero_grad`, `backward`, the run's gradient clipping, `optimizer.step` and the scheduler's step: "
        "one on a batch of the real loader kept in memory, one on a new batch of the loader every step (its loading "
        "and augmenting timed). The window is cut into logging periods (`log_every_n_steps` steps, each holding one "
        "logging window); a step is the mean time between batch starts in the fastest period: every period holds the "
        "same work, what comes every logging window included, and the fastest is the one other work on the machine "
        "disturbed least.", "",
        "Ratio = moh fit / bare loop with the batch in memory (the target's), the median over the repeats and their "
        "range; it is the loop ratio (moh fit / bare loop with the loader: what Lightning's loop, the callbacks and "
        "the logging add) times the data ratio (with the loader / in memory: what loading the batches adds). The "
        "CPU-time ratio is the ratio on the process CPU clock; the mean ratio takes every step of the window (epoch "
        "ends and checkpoints in it included, and any load).", "",
        f"| config | task | batch | threads | window (steps) | moh fit ms/step | bare, loader ms/step | "
        f"bare, in memory ms/step | ratio (range) | ≤ {TARGET:.2f} | loop ratio | data ratio | CPU-time ratio | "
        f"mean ratio | load (1 min) | measured |",
        "|" + "---|" * 16]
    for r in rows:
        loads = [x for run in r["repeats"] for x in run["load"]]
        count = len(r["repeats"])
        lines.append(
            f"| {r['config']} | {r['task']} | {r['batch']} | {r['threads']} | "
            f"{r['first']}-{r['first'] + r['steps'] - 1} | {r['fit_ms']:.1f} | {r['loader_ms']:.1f} | "
            f"{r['bare_ms']:.1f} | {r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, {count} "
            f"repeat{'s' if count > 1 else ''}) | {'yes' if r['ratio'] <= TARGET else '**no**'} | "
            f"{r['loop_ratio']:.2f} | {r['data_ratio']:.2f} | {r['cpu_ratio']:.2f} | {r['mean_ratio']:.2f} | "
            f"{min(loads):.1f}-{max(loads):.1f} | {r['measured']} |")
    busy = shared_machine([max(x for r in rows for run in r["repeats"] for x in run["load"])], [0.0])
    if busy:
        lines += ["", f"{busy}: each ratio pairs runs made back to back, but load that falls on one of them moves "
                      f"it; the range shows by how much."]
    for r in rows:
        lines += _gap_section(r)
    return "\n".join(lines) + "\n"


def _gap_section(row: dict) -> list[str]:
    """Where one config's gap is: the profiled fit's parts beside the bare loops', and each callback."""
    profile = row.get("profile")
    if profile is None:
        return []
    fit, loader, bare = profile["parts"], profile["loader_parts"], profile["bare_parts"]
    events = [f"{len(run[kind])} {name}" for run in row["repeats"][:1]
              for kind, name in (("epoch_ends", "epoch ends"), ("checkpoints", "checkpoints"))]
    start, end = profile["period"]
    lines = ["", f"## Where the gap is: {row['config']}, {row['threads']} thread{'s' if row['threads'] > 1 else ''}",
             "",
             f"One more `moh fit` under `--trainer.profiler simple`, the same window: its fastest logging period "
             f"(steps {start}-{end}) beside the fastest period of the fastest bare loop of each kind, in ms per step "
             f"(the window of the first repeat also held {' and '.join(events)}, which a period may leave out; the "
             f"mean ratio above counts them).", "",
             "| part of the step, ms | moh fit | bare, loader | bare, in memory | moh fit - in memory |",
             "|---|---|---|---|---|"]
    for name in ("data", "training_step", "backward", "optimizer"):
        lines.append(f"| {PARTS[name]} | {fit[name]:.2f} | {loader[name]:.2f} | {bare[name]:.2f} | "
                     f"{fit[name] - bare[name]:+.2f} |")
    small = []
    for name, entry in profile["callbacks"].items():
        if entry["ms"] < 0.005:
            small.append(entry["ms"])
            continue
        lines.append(f"| callback `{name}` (most in `{entry['hook']}`: {entry['calls']} calls, the longest "
                     f"{entry['longest_ms']:.1f} ms) | {entry['ms']:.2f} | 0 | 0 | {entry['ms']:+.2f} |")
    if small:
        lines.append(f"| {len(small)} other callbacks, under 0.005 ms each | {sum(small):.3f} | 0 | 0 | "
                     f"{sum(small):+.3f} |")
    steps = {name: sum(parts.values()) for name, parts in (("fit", fit), ("loader", loader), ("bare", bare))}
    steps["fit"] += sum(entry["ms"] for entry in profile["callbacks"].values())
    lines += [f"| {PARTS['rest']} | {fit['rest']:.2f} | {loader['rest']:.2f} | {bare['rest']:.2f} | "
              f"{fit['rest'] - bare['rest']:+.2f} |",
              f"| **step** | **{steps['fit']:.1f}** | **{steps['loader']:.1f}** | **{steps['bare']:.1f}** | "
              f"**{steps['fit'] - steps['bare']:+.1f}** |"]
    return lines


def bench(configs: list[str] | None = None, repeats: int = 3, steps: int = 60, profile: bool = True,
          quick: bool = False, threads: int | None = None, output: str = "results/parity.json") -> Path:
    """``moh fit``'s steady-state training step against a bare PyTorch loop, and where the gap is.

    The same network, batch, optimizer and loss, for each task's embedded CPU default: ``repeats`` pairs of runs, the
    ratio's median and range, and a profile of where the gap is. Rows into ``output`` (one per config and thread
    count) and the page ``<stem>.md`` beside it, after each config.

    Args:
        configs: The shipped configs to compare; None: ``vit_tiny_mnist_75``, ``dit_mnist_90`` and ``llm_stdlib_75``.
        repeats: Pairs of runs (a ``moh fit``, then the bare loop) per config.
        steps: Timed steps per run, after 10 (and after a callback that starts late: the DiT recipe's EMA).
        profile: One more ``moh fit`` per config under Lightning's ``SimpleProfiler``, for where the gap is.
        quick: One repeat of 10 steps after 3, profiled (minutes, for CI).
        threads: Both loops' torch threads (``OMP_NUM_THREADS``); torch's default when None.
        output: The rows' JSON file.
    """
    given = {"configs": (configs, None), "repeats": (repeats, 3), "steps": (steps, 60), "profile": (profile, True),
             "threads": (threads, None)}
    command = " ".join(["python benchmarks/parity.py"] + (["--quick true"] if quick else [])
                       + [f"--{k} {str(v).replace(' ', '').lower() if isinstance(v, bool) else v}"
                          for k, (v, default) in given.items() if v != default]
                       + ([f"--output {output}"] if output != "results/parity.json" else []))
    return bench_parity(output, configs, repeats, steps, profile, quick, threads, command)


def bare(checkpoint: str, settings: str, steps: int, out: str, loader: bool = False) -> None:
    """One bare loop, its record written to ``out``: what ``bench`` runs in a fresh process.

    Args:
        checkpoint: The ``moh fit`` run's last checkpoint.
        settings: The fit's trainer settings (``StepClock``'s), as JSON.
        steps: Steps to run.
        out: The record's JSON file.
        loader: A new batch of the run's loader every step.
    """
    Path(out).write_text(json.dumps(bare_loop(checkpoint, json.loads(settings), steps, loader)))


def main(args: list[str] | None = None) -> Path | None:
    """``bench``'s options, or ``bare`` and its own (the fresh process of a bare loop)."""
    given = list(sys.argv[1:] if args is None else args)
    if given[:1] == ["bare"]:
        return CLI(bare, args=given[1:], as_positional=False)
    return CLI(bench, args=given, as_positional=False)


if __name__ == "__main__":
    main()
