"""Exact resume: a run stopped mid-epoch and resumed from `last` equals the uninterrupted run, batch for batch, loss for
loss and bit for bit in its final weights.

1. The ViT runs are the embedded ViT shrunk to seconds (one block, 16 images a batch, 5 batches an epoch, 7 steps,
   every random augmentation on, 2 loader workers, checkpoints every 3 steps), so a stop at step 5 resumes mid-epoch 0
   from the step-3 checkpoint and continues across the epoch boundary. They are stopped by a crash (and resumed past
   a truncated `last.ckpt` and a damaged step checkpoint) and by Ctrl-C; one uninterrupted run is the reference for
   both (validation changes no training draw: ``ExactResumeCallback`` puts the random states back after it). A run
   of 2 DDP processes, all of them ended mid-epoch, resumes exactly in test_run_shutdown.py (a lost node).
2. SIGTERM inside a step or a validation, on a tiny regression that draws noise in every step.
3. The DiT and LM runs are a tiny override of each task's CPU default, run three times in deterministic mode:
   uninterrupted, stopped (DiT: max_steps 5; LM: a crash in the validation after step 6), and resumed with
   ``moh fit --ckpt_path last``. Epochs are 4 batches, validation runs every 2 and checkpoints every 3 steps, so the
   crash in the validation after step 6 resumes from step 3, and every resume continues mid-epoch and across an epoch
   boundary.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import run_checkpoints
from ddp_cases import HEAD_LOAD_CARDS_SHRUNK
from exact_runs import (
    RUN,
    VIT,
    VIT_STEPS,
    SigtermInValidation,
    assert_same_run,
    checkpoints,
    fit,
    load_checkpoint,
    working_folder,
)
from faults import CrashInValidation, scramble, truncate, wait_until_the_stop_is_heard
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.loggers import Logger
from moh_process import MohProcess, start_moh
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from moh_lightning.callbacks import ExactResumeCallback, StepCheckpoint
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.configs import resolve_config
from moh_lightning.trainer_cli import MoHLightningCLI

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vit") / "uninterrupted"
    fit(folder)
    return folder


# Resumed past checkpoints that do not load (see test_checkpoint_files.py for the files themselves)

def test_moh_fit_resumes_past_a_truncated_last_and_a_corrupt_step_checkpoint_exactly(uninterrupted, tmp_path):
    """From step 3, mid-epoch 0: the same augmented batches from each of the 2 loader workers' random states."""
    folder = tmp_path / "corrupt"
    with pytest.raises(RuntimeError, match="injected crash at step 6"):
        fit(folder, "--trainer.callbacks+=faults.CrashAtStep", "--trainer.callbacks.step=6")
    saved = checkpoints(folder)
    truncate(saved / "last.ckpt")  # a copy cut short
    scramble(saved / "step=0000006.ckpt")  # a damaged archive
    with pytest.warns(UserWarning) as warned:
        fit(folder, "--ckpt_path", "last")
    moved = [str(w.message) for w in warned if "does not load" in str(w.message)]
    assert len(moved) == 2 and "last.ckpt" in moved[0] and "step=0000006.ckpt" in moved[1]
    assert "resuming from the next newest" in moved[1] and moved[1].endswith("step=0000003.ckpt.")
    assert len(list(saved.glob("*.corrupt-*"))) == 2
    assert_same_run(uninterrupted, folder)


def test_dit_latent_flips_drawn_in_workers_resume_where_the_loader_stopped():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from moh_lightning.data.latents import LatentDataset

    latents = np.stack([np.zeros((64, 1, 2, 2)), np.ones((64, 1, 2, 2))], axis=1)  # (N, view, C, h, w)
    dataset = LatentDataset(latents.astype(np.float16), np.arange(64), flip=True)  # item: 0 as is, 1 flipped

    def loader() -> StatefulDataLoader:
        torch.manual_seed(0)
        return StatefulDataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)

    def flips(iterator, n: int) -> list[list[int]]:
        return [next(iterator)[0][:, 0, 0, 0].int().tolist() for _ in range(n)]

    running = loader()
    iterator = iter(running)
    flips(iterator, 3)
    state = running.state_dict()
    expected = flips(iterator, 5)
    assert any(0 < sum(batch) < 4 for batch in expected)  # the flips are random draws
    resumed = loader()
    resumed.load_state_dict(state)
    assert flips(iter(resumed), 5) == expected


# SIGTERM

def _moh(folder: Path, *args: str) -> MohProcess:
    folder.mkdir(exist_ok=True)
    return start_moh(["fit", *VIT, *args], folder, os.environ, stdout=folder / "out.txt", stderr=folder / "err.txt")


def test_ctrl_c_saves_at_the_step_boundary_exits_130_and_resumes_exactly(uninterrupted, tmp_path):
    """Ctrl-C's SIGINT as a terminal sends it, to every process of the run: the loader workers leave it to their
    process, which stops after the step. Before, Ctrl-C ended the run with Lightning's "Detected KeyboardInterrupt",
    exit code 1 and no checkpoint. (Only a process group shows this: `moh fit` forked from this process in a session of
    its own, see tests/moh_process.py; SIGTERM's hook is tested in this process below.)"""
    folder = tmp_path / "SIGINT"
    keep = "--checkpoint.keep=1"  # the newest step checkpoint only, plus last.ckpt
    run = _moh(folder, "--trainer.callbacks+=exact_runs.SignalWindow", keep)
    deadline = time.monotonic() + 300
    while not (folder / "in_step_4").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGINT)  # inside step 4
    assert run.wait(timeout=120) == 128 + signal.SIGINT
    lines = (folder / "err.txt").read_text().splitlines()
    assert [line for line in lines if line.startswith("moh: ")] == [
        f"moh: stopped by SIGINT after step 4; saved {RUN / 'version_0' / 'checkpoints' / 'last.ckpt'}. "
        f"Continue with the same command and --ckpt_path last."], lines[-20:]
    # Not a periodic checkpoint (every 3 steps): written at the end of the step the signal came in.
    saved = checkpoints(folder)
    assert load_checkpoint(saved / "last.ckpt")["global_step"] == 4
    assert sorted(p.name for p in saved.glob("*.ckpt")) == ["last.ckpt", "step=0000003.ckpt"]
    fit(folder, "--ckpt_path", "last", keep)  # from step 4, mid-epoch 0, with each loader worker's random states
    # keep=1 newest step checkpoint (step 6 replaced step 3, across the resume), and last.ckpt written at the end of
    # fit (step 7 is not a multiple of 3)
    assert sorted(p.name for p in saved.glob("*.ckpt")) == ["last.ckpt", "step=0000006.ckpt"]
    assert_same_run(uninterrupted, folder)


class _Noisy(LightningModule):
    """A regression on shuffled batches that draws noise in every training and validation step, as DiT's steps do:
    a resumed run that restored the wrong random states or loader position, or logs under the wrong step, differs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return (self.layer(x + 0.1 * torch.randn_like(x)) - y).pow(2).mean()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch))

    def _loader(self, shuffle: bool) -> StatefulDataLoader:
        data = torch.Generator().manual_seed(1)
        return StatefulDataLoader(TensorDataset(torch.randn(20, 4, generator=data), torch.randn(20, 1, generator=data)),
                                  batch_size=4, shuffle=shuffle)

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader:
        return self._loader(shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Logged(Logger):
    """Every metric logged, under the step Lightning logged it at."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, str, float]] = []

    name, version = "logged", 0

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows += [(step, key, float(value)) for key, value in metrics.items() if key.endswith("loss")]

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass


class _SigtermInStep(Callback):
    """Sends its own process SIGTERM as training step ``step`` + 1 starts, and waits until it has been heard."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_until_the_stop_is_heard(trainer, seconds=10)


def _noisy_fit(folder: Path, logged: _Logged, *callbacks: Callback, ckpt_path: str | None = None) -> Trainer:
    trainer = Trainer(max_steps=VIT_STEPS, logger=logged, log_every_n_steps=1, val_check_interval=2,
                      check_val_every_n_epoch=None, limit_val_batches=2, enable_progress_bar=False,
                      enable_model_summary=False, deterministic=True, plugins=[AtomicCheckpointIO()],
                      callbacks=[StepCheckpoint(str(folder), every_n_train_steps=3), ExactResumeCallback(), *callbacks])
    trainer.fit(_Noisy(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("where", ["step", "batch", "end"])
def test_sigterm_in_a_step_or_a_validation_saves_that_step_exits_143_and_resumes_exactly(where, tmp_path, capfd):
    """SIGTERM as `kill`, a container stop or a cloud preemption sends it, inside step 5, or in the validation after
    step 4: heard in its first batch, or after its last (before, a resumed run then logged every later step one step
    late: the checkpoint held Lightning's count of logged steps after this step's). StepCheckpoint's hook saves that
    step, says so in one line and exits 143; ``--ckpt_path last`` then continues as the uninterrupted run."""
    expected = _Logged()
    reference = _noisy_fit(tmp_path / "uninterrupted", expected)
    folder, stopped, resumed = tmp_path / "stopped", _Logged(), _Logged()
    stop = _SigtermInStep(5) if where == "step" else SigtermInValidation(4, at=where)
    with pytest.raises(SystemExit) as exit_info:
        _noisy_fit(folder, stopped, stop)
    saved = 5 if where == "step" else 4
    assert exit_info.value.code == StepCheckpoint.EXIT_CODE == 143
    assert [line for line in capfd.readouterr().err.splitlines() if line.startswith("moh: ")] == [
        f"moh: stopped by SIGTERM after step {saved}; saved {folder / 'last.ckpt'}. Continue with the same command "
        f"and --ckpt_path last."]
    # Not a periodic checkpoint (every 3 steps): written at the end of the step the signal came in.
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == saved
    trainer = _noisy_fit(folder, resumed, ckpt_path=str(folder / "last.ckpt"))
    assert trainer.global_step == reference.global_step == VIT_STEPS
    _assert_same_tensors(reference.lightning_module.state_dict(), trainer.lightning_module.state_dict())
    # Every training loss logged once, at its own step, with the uninterrupted run's value; the validations after the
    # resume as the uninterrupted run's.
    train = [row for row in stopped.rows + resumed.rows if row[1] == "train/loss"]
    assert sorted(train) == sorted(row for row in expected.rows if row[1] == "train/loss")
    assert len(train) == VIT_STEPS
    assert [row for row in resumed.rows if row[1] == "val/loss"] == \
        [row for row in expected.rows if row[1] == "val/loss" and row[0] >= saved]


# 3. The DiT and LM runs ---------------------------------------------------------------------------------------------

STEPS = 9
COMMON = ["--trainer.deterministic=true", "--trainer.limit_train_batches=4", "--trainer.val_check_interval=2",
          "--trainer.check_val_every_n_epoch=null", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
DIT = ["--config", resolve_config("dit_mnist_90.yaml"), *COMMON,
       "--model.init_args.arch.depth=2", "--model.init_args.arch.embed_dim=64",
       "--model.init_args.arch.moh.num_shared_heads=4", "--model.init_args.arch.moh.top_k=2",
       "--model.init_args.warmup_steps=3", "--data.init_args.batch_size=8", *HEAD_LOAD_CARDS_SHRUNK]
LM = ["--config", resolve_config("llm_stdlib_75.yaml"), *COMMON,
      "--model.init_args.arch={vocab_size: 259, depth: 1, embed_dim: 64, num_heads: 4, head_dim: 16, "
      "intermediate_size: 128, block_size: 32, moh: {num_shared_heads: 2, top_k: 1}}",
      "--model.init_args.warmup_steps=2", "--model.init_args.max_tokens=100000",
      "--data.init_args.seq_len=32", "--data.init_args.batch_size=4", "--data.init_args.val_samples=4"]
# The always-on reliability callbacks of every run (exact resume, finite-loss guard), checkpointing every 3 steps
# (newest 2 kept, plus last.ckpt) into the run folder.
CHECKPOINT = {"every_n_train_steps": 3, "keep": 2}
# EMA from step 2, so that it has averaged several steps when each checkpoint is written.
EMA = {"class_path": "moh_lightning.callbacks.EMAWeightAveraging",
       "init_args": {"decay": 0.9, "update_starting_at_step": 2}}


class RecordTokens(Callback):
    """The token windows of every training step, by step."""

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.seen[trainer.global_step] = batch["tokens"].clone()


class _FitWith(MoHLightningCLI):
    """`moh fit` with test callbacks (crashes, recorders) added to the trainer's own before fit starts."""

    def __init__(self, extra: tuple[Callback, ...], args: list[str]) -> None:
        self.extra = extra
        super().__init__(args=args)

    def before_fit(self) -> None:
        self.trainer.callbacks.extend(self.extra)


def _fit_with(folder: Path, args: list[str], callbacks: list[dict], *extra: Callback, max_steps: int = STEPS,
              ckpt_path: str | None = None) -> MoHLightningCLI:
    """One `moh fit` of ``args`` with ``callbacks`` instead of the config's (besides the always-on ones), in
    ``folder``."""
    with working_folder(folder):
        Path("callbacks.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks},
                                                          "checkpoint": CHECKPOINT}))
        resume = [f"--ckpt_path={ckpt_path}"] if ckpt_path else []
        return _FitWith(extra, ["fit", *args, "--config", "callbacks.yaml", f"--trainer.max_steps={max_steps}",
                                *resume])


def _stop_and_resume(folder: Path, how: str, args: list[str], callbacks: list[dict],
                     *extra: Callback) -> MoHLightningCLI:
    """A fit stopped mid-epoch (see the module docstring, 2.), then resumed from `last` up to STEPS."""
    if how == "crash in validation":
        with pytest.raises(RuntimeError, match="injected crash in the validation at step 6"):
            _fit_with(folder, args, callbacks, CrashInValidation(6), *extra)
    else:
        _fit_with(folder, args, callbacks, *extra, max_steps=5)
    resumed = _fit_with(folder, args, callbacks, *extra, ckpt_path="last")
    assert Path(resumed.trainer.ckpt_path).name == "last.ckpt"  # continued from the stopped run, not restarted
    assert resumed.trainer.global_step == STEPS
    assert isinstance(resumed.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    return resumed


def _logged(logs: Path) -> dict[tuple[str, int], float]:
    """Every train/loss and val/loss logged under ``logs``; a later version, or a later events file of a run resumed
    in its own version folder, overrides the steps it repeats."""
    values = {}
    for version in sorted(logs.iterdir()):
        events = EventAccumulator(str(version), size_guidance={"scalars": 0}).Reload()
        for tag in ("train/loss", "val/loss"):
            values.update({(tag, event.step): event.value for event in events.Scalars(tag)})
    return values


def _assert_same_tensors(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def _last(folder: Path, name: str) -> dict:
    """The last checkpoint of run ``name`` in ``folder``: in its newest run folder, runs/<name>/version_N/."""
    return torch.load(run_checkpoints(name, folder) / "last.ckpt", weights_only=False)


@pytest.fixture(scope="module")
def dit_uninterrupted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dit") / "uninterrupted"
    _fit_with(folder, DIT, [EMA])
    return folder


def test_dit_resumed_mid_epoch_reaches_the_same_weights_ema_and_losses(dit_uninterrupted, tmp_path):
    """Stopped by max_steps: the last checkpoint, written at the end of the last step, holds the training weights
    besides the average (EMAWeightAveraging copies the average over them when training ends)."""
    resumed = _stop_and_resume(tmp_path, "max_steps", DIT, [EMA])
    expected, actual = _last(dit_uninterrupted, "dit_mnist_75"), _last(tmp_path, "dit_mnist_75")
    assert expected["global_step"] == actual["global_step"] == STEPS
    # EMAWeightAveraging writes the average as state_dict, the training weights as current_model_state and the
    # averaging count in averaging_state: all three continue exactly.
    for key in ("state_dict", "current_model_state", "averaging_state"):
        _assert_same_tensors(expected[key], actual[key])
    assert expected["averaging_state"]["n_averaged"] == STEPS - 2
    assert not torch.equal(actual["state_dict"]["model.final_layer.linear.weight"],
                           actual["current_model_state"]["model.final_layer.linear.weight"])
    ema = next(c for c in resumed.trainer.callbacks if isinstance(c, EMAWeightAveraging))
    _assert_same_tensors(expected["state_dict"], ema._average_model.module.state_dict())
    losses = _logged(dit_uninterrupted / "runs" / "dit_mnist_75")
    assert len(losses) == STEPS + 4 and _logged(tmp_path / "runs" / "dit_mnist_75") == losses


def _write_corpus(folder: Path) -> Path:
    """20 short text documents; a hash of the names sends 4 of them to validation."""
    folder.mkdir()
    for i in range(20):
        lines = [f"def f{i}_{j}(x):\n    return x * {i + j} + {j * j}  # line {j} of document {i}\n" for j in range(6)]
        (folder / f"doc{i:02d}.txt").write_text("".join(lines))
    return folder


@pytest.fixture(scope="module")
def lm_args(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("lm")
    corpus = _write_corpus(root / "corpus")
    source = {"path": str(corpus), "val_fraction": 0.2}
    return [*LM, f"--data.init_args.sources=[{yaml.safe_dump(source, default_flow_style=True).strip()}]",
            f"--data.init_args.cache_dir={root / 'cache'}", "--data.init_args.samples_per_epoch=16"]


@pytest.fixture(scope="module")
def lm_uninterrupted(tmp_path_factory, lm_args) -> tuple[Path, dict[int, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("lm_run") / "uninterrupted"
    tokens = RecordTokens()
    _fit_with(folder, lm_args, [], tokens)
    return folder, tokens.seen


def test_lm_resumed_mid_epoch_sees_the_same_sequences_and_reaches_the_same_weights(lm_args, lm_uninterrupted,
                                                                                    tmp_path):
    """Stopped by a crash in the validation after step 6, whose checkpoint is written after that validation: the
    run resumes from step 3 and logs that validation (the ViT runs resume from a crash before a step, the DiT run from
    the end of a fit)."""
    folder, expected_tokens = lm_uninterrupted
    tokens = RecordTokens()
    resumed = _stop_and_resume(tmp_path, "crash in validation", lm_args, [], tokens)
    # The stopped run's steps up to its checkpoint, then the resumed run's: the uninterrupted token stream,
    # no sequence repeated or skipped, mid-epoch and across the epoch boundary at step 8.
    assert sorted(tokens.seen) == list(range(STEPS)) == sorted(expected_tokens)
    for step, window in expected_tokens.items():
        assert torch.equal(tokens.seen[step], window), f"step {step}"
    epoch = torch.cat([expected_tokens[step] for step in range(4)])
    assert len(set(map(tuple, epoch.tolist()))) == 16  # an epoch serves each of its 16 windows once
    expected, actual = _last(folder, "llm_stdlib_75"), _last(tmp_path, "llm_stdlib_75")
    _assert_same_tensors(expected["state_dict"], actual["state_dict"])
    assert actual["tokens_seen"] == expected["tokens_seen"] == STEPS * 4 * 32
    assert resumed.model.tokens_seen == STEPS * 4 * 32
    losses = _logged(folder / "runs" / "llm_stdlib_75")
    assert len(losses) == STEPS + 4 and _logged(tmp_path / "runs" / "llm_stdlib_75") == losses
