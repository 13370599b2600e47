"""Exact resume of the DiT and LM tasks: a fit stopped mid-epoch and resumed from `last` equals the uninterrupted fit.

Each task runs a tiny override of its CPU default three times in deterministic mode: uninterrupted, stopped (a crash
before step 7, a crash in the validation after step 6, or max_steps 5), and resumed with ``moh fit --ckpt_path last``.
Epochs are 4 batches, validation runs every 2 and checkpoints every 3 steps, so the crash before step 7 resumes from
the step-6 checkpoint written after that validation, the crash in it from step 3, and every resume continues
mid-epoch and across an epoch boundary.
"""
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_checkpoints
from faults import CrashAtStep, CrashInValidation
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EMAWeightAveraging
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.cli import MoHLightningCLI
from moh_lightning.configs import resolve_config

pytestmark = pytest.mark.slow

STEPS = 9
COMMON = ["--trainer.deterministic=true", "--trainer.limit_train_batches=4", "--trainer.val_check_interval=2",
          "--trainer.check_val_every_n_epoch=null", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
DIT = ["--config", resolve_config("dit_mnist_90.yaml"), *COMMON,
       "--model.init_args.arch.depth=2", "--model.init_args.arch.embed_dim=64",
       "--model.init_args.arch.moh.num_shared_heads=4", "--model.init_args.arch.moh.top_k=2",
       "--model.init_args.warmup_steps=3", "--data.init_args.batch_size=8"]
LM = ["--config", resolve_config("llm_stdlib_75.yaml"), *COMMON,
      "--model.init_args.arch={vocab_size: 259, depth: 1, embed_dim: 64, num_heads: 4, head_dim: 16, "
      "intermediate_size: 128, block_size: 32, moh: {num_shared_heads: 2, top_k: 1}}",
      "--model.init_args.warmup_steps=2", "--model.init_args.max_tokens=100000",
      "--data.init_args.seq_len=32", "--data.init_args.batch_size=4", "--data.init_args.val_samples=4"]
# The always-on reliability callbacks of every run (exact resume, finite-loss guard), checkpointing every 3 steps
# (newest 2 kept, plus last.ckpt) into the run folder.
CHECKPOINT = {"every_n_train_steps": 3, "keep": 2}
# EMA from step 2, so that it has averaged several steps when each checkpoint is written.
EMA = {"class_path": "lightning.pytorch.callbacks.EMAWeightAveraging",
       "init_args": {"decay": 0.9, "update_starting_at_step": 2}}


class RecordTokens(Callback):
    """The token windows of every training step, by step."""

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.seen[trainer.global_step] = batch["tokens"].clone()


@contextmanager
def _working_folder(folder: Path) -> Iterator[None]:
    folder.mkdir(exist_ok=True)
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


class _FitWith(MoHLightningCLI):
    """`moh fit` with test callbacks (crashes, recorders) added to the trainer's own before fit starts."""

    def __init__(self, extra: tuple[Callback, ...], args: list[str]) -> None:
        self.extra = extra
        super().__init__(args=args)

    def before_fit(self) -> None:
        self.trainer.callbacks.extend(self.extra)


def _fit(folder: Path, args: list[str], callbacks: list[dict], *extra: Callback, max_steps: int = STEPS,
         ckpt_path: str | None = None) -> MoHLightningCLI:
    """One `moh fit` of ``args`` with ``callbacks`` instead of the config's (besides the always-on ones), in
    ``folder``."""
    with _working_folder(folder):
        Path("callbacks.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks},
                                                          "checkpoint": CHECKPOINT}))
        resume = [f"--ckpt_path={ckpt_path}"] if ckpt_path else []
        return _FitWith(extra, ["fit", *args, "--config", "callbacks.yaml", f"--trainer.max_steps={max_steps}",
                                *resume])


def _stop_and_resume(folder: Path, how: str, args: list[str], callbacks: list[dict],
                     *extra: Callback) -> MoHLightningCLI:
    """A fit stopped mid-epoch (see the module docstring), then resumed from `last` up to STEPS."""
    if how == "crash":
        with pytest.raises(RuntimeError, match="injected crash at step 7"):
            _fit(folder, args, callbacks, CrashAtStep(7), *extra)
    elif how == "crash in validation":
        with pytest.raises(RuntimeError, match="injected crash in the validation at step 6"):
            _fit(folder, args, callbacks, CrashInValidation(6), *extra)
    else:
        _fit(folder, args, callbacks, *extra, max_steps=5)
    resumed = _fit(folder, args, callbacks, *extra, ckpt_path="last")
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
    _fit(folder, DIT, [EMA])
    return folder


@pytest.mark.parametrize("how", ["crash", "max_steps"])
def test_dit_resumed_mid_epoch_reaches_the_same_weights_ema_and_losses(how, dit_uninterrupted, tmp_path):
    resumed = _stop_and_resume(tmp_path, how, DIT, [EMA])
    expected, actual = _last(dit_uninterrupted, "dit_mnist_90"), _last(tmp_path, "dit_mnist_90")
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
    losses = _logged(dit_uninterrupted / "runs" / "dit_mnist_90")
    assert len(losses) == STEPS + 4 and _logged(tmp_path / "runs" / "dit_mnist_90") == losses


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
    _fit(folder, lm_args, [], tokens)
    return folder, tokens.seen


@pytest.mark.parametrize("how", ["crash", "crash in validation", "max_steps"])
def test_lm_resumed_mid_epoch_sees_the_same_sequences_and_reaches_the_same_weights(how, lm_args, lm_uninterrupted,
                                                                                    tmp_path):
    folder, expected_tokens = lm_uninterrupted
    tokens = RecordTokens()
    resumed = _stop_and_resume(tmp_path, how, lm_args, [], tokens)
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
