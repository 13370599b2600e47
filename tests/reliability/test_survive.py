"""Runs that survive, part 2: a corrupt newest checkpoint, loader workers, SIGTERM, a full disk.

The runs are the embedded ViT shrunk to seconds (one block, 16 images a batch, 5 batches an epoch, 7 steps, every
random augmentation on, 2 loader workers, checkpoints every 3 steps), so a stop at step 5 resumes mid-epoch 0 from the
step-3 checkpoint and continues across the epoch boundary. One uninterrupted run is the reference for all of them
(validation changes no training draw: ``ExactResumeCallback`` puts the random states back after it).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import pythonpath
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning import checkpoint_io
from moh_lightning.callbacks import StepCheckpoint
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.cli import main
from moh_lightning.runs import checkpoint_problem, latest_loadable_checkpoint

pytestmark = pytest.mark.slow

STEPS = 7
VIT = ["--config", "vit_tiny_mnist_75.yaml", f"--trainer.max_steps={STEPS}", "--trainer.limit_train_batches=5",
       "--trainer.limit_val_batches=0", "--trainer.deterministic=true", "--trainer.log_every_n_steps=1",
       "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
       "--model.init_args.arch.depth=1", "--data.init_args.batch_size=16", "--data.init_args.num_workers=2",
       "--data.init_args.auto_augment=rand-m5-mstd0.5-inc1", "--data.init_args.re_prob=0.25",
       "--model.init_args.mixup_alpha=0.2", "--model.init_args.mixup_prob=0.5",
       "--checkpoint.every_n_train_steps=3", "--trainer.callbacks+=test_survive.RecordBatches"]
RUN = Path("runs") / "vit_tiny_mnist_75"
MOH = str(Path(sys.executable).with_name("moh"))


class RecordBatches(Callback):
    """Appends each training step's batch (a hash of its images and labels) to ``batches.jsonl`` in the working dir."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            digest = hashlib.sha256(batch[0].numpy().tobytes() + batch[1].numpy().tobytes()).hexdigest()
            with open("batches.jsonl", "a") as file:
                file.write(json.dumps({"step": trainer.global_step, "batch": digest}) + "\n")


class SignalWindow(Callback):
    """Writes ``in_step_4`` when step 4 starts and lingers there 2 s: a window for a signal sent from outside."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == 3:
            Path("in_step_4").touch()
            time.sleep(2)


class SigtermInValidation(Callback):
    """Sends its own process SIGTERM during the first batch of the validation after step ``step``.

    Every validation batch also draws from the global random streams, as DiT's validation (noise, timesteps) does.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0):
        torch.rand(3), random.random(), np.random.rand()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if trainer.global_step == self.step and batch_idx == 0 and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


class KillAtStep(Callback):
    """SIGKILLs its own process before training step ``step``, on every rank: a machine lost mid-epoch."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _batches(folder: Path) -> dict[int, str]:
    """The batch of each step; a resumed run's record of a step overrides the stopped run's (they must agree)."""
    seen: dict[int, str] = {}
    for line in (folder / "batches.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert seen.get(record["step"], record["batch"]) == record["batch"], f"step {record['step']} redone otherwise"
        seen[record["step"]] = record["batch"]
    return seen


def _losses(folder: Path, run: Path = RUN) -> dict[int, float]:
    values = {}
    for version in sorted((folder / run).glob("version_*")):
        events = EventAccumulator(str(version), size_guidance={"scalars": 0}).Reload()
        if "train/loss" in events.Tags()["scalars"]:
            values.update({event.step: event.value for event in events.Scalars("train/loss")})
    return values


def _checkpoints(folder: Path, run: Path = RUN) -> Path:
    return folder / run / "version_0" / "checkpoints"


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same_run(expected: Path, actual: Path, run: Path = RUN) -> None:
    """The same batch at every step, the same logged losses and bit-identical final weights."""
    assert _batches(actual) == _batches(expected) and sorted(_batches(expected)) == list(range(STEPS))
    assert _losses(actual, run) == _losses(expected, run) and len(_losses(expected, run)) == STEPS
    want, got = _load(_checkpoints(expected, run) / "last.ckpt"), _load(_checkpoints(actual, run) / "last.ckpt")
    assert got["global_step"] == want["global_step"] == STEPS
    assert want["state_dict"].keys() == got["state_dict"].keys()
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name


def _fit(folder: Path, *args: str, base: list[str] = VIT) -> None:
    folder.mkdir(exist_ok=True)
    previous = Path.cwd()
    os.chdir(folder)
    try:
        main(["fit", *base, *args])
    finally:
        os.chdir(previous)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("survive") / "uninterrupted"
    _fit(folder)
    return folder


# 1. A checkpoint that does not load -------------------------------------------------------------------------------

def _fake_run(root: Path, steps: tuple[int, ...]) -> Path:
    """A run folder with a small checkpoint per step and ``last.ckpt`` (the newest), oldest first by mtime."""
    folder = root / "runs" / "exp" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    for i, step in enumerate(steps):
        torch.save({"state_dict": {"w": torch.full((64,), float(step))}, "global_step": step},
                   folder / f"step={step:07d}.ckpt")
        os.utime(folder / f"step={step:07d}.ckpt", (1000 + i, 1000 + i))
    shutil.copy(folder / f"step={steps[-1]:07d}.ckpt", folder / "last.ckpt")
    os.utime(folder / "last.ckpt", (2000, 2000))
    return folder


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _scramble(path: Path) -> None:
    """Overwrites the start of the archive's pickle, as a disk fault would: still a complete zip file."""
    data = bytearray(path.read_bytes())
    start = data.index(b"data.pkl") + 40
    data[start:start + 32] = bytes(range(200, 232))
    path.write_bytes(bytes(data))
    assert zipfile.is_zipfile(path)


def test_a_checkpoint_that_does_not_load_is_moved_aside_with_a_warning_and_the_next_newest_used(tmp_path):
    folder = _fake_run(tmp_path, (3, 6, 9))
    _truncate(folder / "last.ckpt")
    _scramble(folder / "step=0000009.ckpt")
    with pytest.warns(UserWarning) as warned:
        version, chosen = latest_loadable_checkpoint(tmp_path / "runs" / "exp")
    assert (version.name, chosen.name) == ("version_0", "step=0000006.ckpt")
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2
    assert "last.ckpt does not load (RuntimeError: PytorchStreamReader failed reading zip archive: failed finding " \
           "central directory)" in messages[0] and "last.ckpt.corrupt-" in messages[0]
    assert "step=0000009.ckpt does not load" in messages[1] and "step=0000006.ckpt" in messages[1]
    # moved aside, never deleted: the bytes are all there under the new names, which no lookup matches
    names = sorted(p.name for p in folder.iterdir())
    assert [n for n in names if n.endswith(".ckpt")] == ["step=0000003.ckpt", "step=0000006.ckpt"]
    assert [n.split(".corrupt-")[0] for n in names if ".corrupt-" in n] == ["last.ckpt", "step=0000009.ckpt"]
    assert latest_loadable_checkpoint(tmp_path / "runs" / "exp")[1].name == "step=0000006.ckpt"


def test_only_rank_zero_moves_a_checkpoint_aside_and_every_rank_picks_the_same(tmp_path, monkeypatch, recwarn):
    folder = _fake_run(tmp_path, (3, 6))
    _truncate(folder / "last.ckpt")
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # what a DDP child process reads from LOCAL_RANK / RANK
    assert latest_loadable_checkpoint(tmp_path / "runs" / "exp")[1].name == "step=0000006.ckpt"
    assert (folder / "last.ckpt").is_file() and not recwarn.list  # left to rank 0, which may be checking it now
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.warns(UserWarning, match="moved it aside"):
        assert latest_loadable_checkpoint(tmp_path / "runs" / "exp")[1].name == "step=0000006.ckpt"
    assert not (folder / "last.ckpt").exists()


def test_when_no_checkpoint_loads_the_run_stops_in_one_line_listing_them_and_renames_nothing(tmp_path):
    folder = _fake_run(tmp_path, (3,))
    _truncate(folder / "last.ckpt")
    (folder / "step=0000003.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit) as stop:
        latest_loadable_checkpoint(tmp_path / "runs" / "exp")
    message = str(stop.value)
    assert message.startswith("moh: --ckpt_path last: none of the 2 checkpoints") and "\n" not in message
    assert "last.ckpt (RuntimeError: PytorchStreamReader" in message
    assert "step=0000003.ckpt (EOFError)" in message  # an empty file
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=0000003.ckpt"]


def test_the_next_newest_is_the_highest_step_even_in_a_folder_copied_without_its_times(tmp_path):
    folder = _fake_run(tmp_path, (3, 6))
    _truncate(folder / "last.ckpt")
    os.utime(folder / "step=0000003.ckpt", (3000, 3000))  # as `cp -r` leaves them: in copy order
    with pytest.warns(UserWarning, match="resuming from the next newest, .*step=0000006.ckpt"):
        assert latest_loadable_checkpoint(tmp_path / "runs" / "exp")[1].name == "step=0000006.ckpt"


def test_checkpoint_check_reads_only_the_pickle_of_a_complete_archive(tmp_path):
    path = tmp_path / "big.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(64 * 2**20, dtype=torch.uint8)}}, path)  # 64 MiB of tensor data
    started = time.perf_counter()
    assert checkpoint_problem(path) is None
    assert time.perf_counter() - started < 0.5  # memory-mapped: the 64 MiB are not read
    torch.save({"weights": torch.zeros(3)}, tmp_path / "plain.pt")
    assert checkpoint_problem(tmp_path / "plain.pt") == "not a Lightning checkpoint (no state_dict in it)"


def test_moh_fit_resumes_past_a_truncated_last_and_a_corrupt_step_checkpoint_exactly(uninterrupted, tmp_path):
    folder = tmp_path / "corrupt"
    with pytest.raises(RuntimeError, match="injected crash at step 6"):
        _fit(folder, "--trainer.callbacks+=faults.CrashAtStep", "--trainer.callbacks.step=6")
    checkpoints = _checkpoints(folder)
    _truncate(checkpoints / "last.ckpt")  # a copy cut short
    _scramble(checkpoints / "step=0000006.ckpt")  # a damaged archive
    with pytest.warns(UserWarning) as warned:
        _fit(folder, "--ckpt_path", "last")
    moved = [str(w.message) for w in warned if "does not load" in str(w.message)]
    assert len(moved) == 2 and "last.ckpt" in moved[0] and "step=0000006.ckpt" in moved[1]
    assert "resuming from the next newest" in moved[1] and moved[1].endswith("step=0000003.ckpt.")
    assert len(list(checkpoints.glob("*.corrupt-*"))) == 2
    _assert_same_run(uninterrupted, folder)


# 2. Exact resume with loader workers ------------------------------------------------------------------------------

def test_resume_mid_epoch_with_two_loader_workers_draws_the_same_augmented_batches(uninterrupted, tmp_path):
    folder = tmp_path / "workers"
    with pytest.raises(RuntimeError, match="injected crash at step 5"):
        _fit(folder, "--trainer.callbacks+=faults.CrashAtStep", "--trainer.callbacks.step=5")
    _fit(folder, "--ckpt_path", "last")  # from step 3, mid-epoch 0, with each worker's random states
    _assert_same_run(uninterrupted, folder)


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


# 3. DDP ------------------------------------------------------------------------------------------------------------

# Two gloo processes forked from this one (Lightning's ddp_fork: the same DDP training as `--trainer.strategy ddp`,
# without importing torch twice more), each with its 2 loader workers and its own half of every batch.
DDP = ["--trainer.strategy=ddp_fork", "--trainer.devices=2", "--trainer.accelerator=cpu"]


@pytest.fixture(scope="module")
def ddp_uninterrupted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("survive_ddp") / "uninterrupted"
    _fit(folder, *DDP)
    return folder


def test_ddp_run_killed_mid_epoch_resumes_to_the_same_weights_as_the_uninterrupted_ddp_run(ddp_uninterrupted,
                                                                                             tmp_path):
    folder = tmp_path / "killed"
    with pytest.raises(Exception, match="terminated with signal SIGKILL"):
        _fit(folder, *DDP, "--trainer.callbacks+=test_survive.KillAtStep", "--trainer.callbacks.step=5")
    assert _load(_checkpoints(folder) / "last.ckpt")["global_step"] == 3
    _fit(folder, *DDP, "--ckpt_path", "last")
    _assert_same_run(ddp_uninterrupted, folder)  # rank 0's batches and losses; the weights of both (DDP keeps equal)


# The DiT default shrunk the same way (2 blocks of width 64, 8 digits a batch; without its EMA and sample grids).
DIT = ["--config", "dit_mnist_90.yaml", f"--trainer.max_steps={STEPS}", "--trainer.limit_train_batches=5",
       "--trainer.limit_val_batches=0", "--trainer.deterministic=true", "--trainer.log_every_n_steps=1",
       "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.callbacks=[]",
       "--model.init_args.arch.depth=2", "--model.init_args.arch.embed_dim=64",
       "--model.init_args.arch.moh.num_shared_heads=4", "--model.init_args.arch.moh.top_k=2",
       "--model.init_args.warmup_steps=3", "--data.init_args.batch_size=8", "--checkpoint.every_n_train_steps=3",
       "--trainer.callbacks+=test_survive.RecordBatches", *DDP]


def test_ddp_dit_run_killed_mid_epoch_resumes_to_the_same_weights(tmp_path):
    _fit(tmp_path / "uninterrupted", base=DIT)
    folder = tmp_path / "killed"
    with pytest.raises(Exception, match="terminated with signal SIGKILL"):
        _fit(folder, "--trainer.callbacks+=test_survive.KillAtStep", "--trainer.callbacks.step=5", base=DIT)
    _fit(folder, "--ckpt_path", "last", base=DIT)
    _assert_same_run(tmp_path / "uninterrupted", folder, Path("runs") / "dit_mnist_90")


# 4. SIGTERM --------------------------------------------------------------------------------------------------------

def _moh(folder: Path, *args: str) -> subprocess.Popen:
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": pythonpath(__file__), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.Popen([MOH, "fit", *VIT, *args], cwd=folder, env=env, stdout=open(folder / "out.txt", "w"),
                            stderr=open(folder / "err.txt", "w"))


def test_sigterm_saves_at_the_step_boundary_exits_non_zero_and_resumes_exactly(uninterrupted, tmp_path):
    folder = tmp_path / "sigterm"
    run = _moh(folder, "--trainer.callbacks+=test_survive.SignalWindow")
    deadline = time.monotonic() + 300
    while not (folder / "in_step_4").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)  # as `kill`, a container stop or a cloud preemption does, inside step 4
    assert run.wait(timeout=120) == StepCheckpoint.EXIT_CODE == 143
    lines = (folder / "err.txt").read_text().splitlines()
    assert [line for line in lines if line.startswith("moh: ")] == [
        f"moh: stopped by SIGTERM after step 4; saved {RUN / 'version_0' / 'checkpoints' / 'last.ckpt'}. Continue "
        f"with the same command and --ckpt_path last."], lines[-20:]
    # Not a periodic checkpoint (every 3 steps): written at the end of the step the signal came in.
    assert _load(_checkpoints(folder) / "last.ckpt")["global_step"] == 4
    _fit(folder, "--ckpt_path", "last")
    _assert_same_run(uninterrupted, folder)


def test_sigterm_during_a_validation_saves_the_step_before_it_and_resumes_exactly(uninterrupted, tmp_path):
    folder = tmp_path / "sigterm_in_validation"
    validation = ["--trainer.limit_val_batches=2", "--trainer.val_check_interval=2",
                  "--trainer.check_val_every_n_epoch=null"]
    with pytest.raises(SystemExit) as stop:
        _fit(folder, *validation, "--trainer.callbacks+=test_survive.SigtermInValidation",
             "--trainer.callbacks.step=4")
    assert stop.value.code == 143
    assert _load(_checkpoints(folder) / "last.ckpt")["global_step"] == 4
    _fit(folder, *validation, "--ckpt_path", "last")
    _assert_same_run(uninterrupted, folder)


# 5. No space left for a checkpoint --------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["ENOSPC", "torch's zip writer"])
def test_disk_full_while_writing_keeps_the_previous_checkpoint_and_stops_in_one_line(how, tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "weights": torch.zeros(1000)}, path)

    def disk_full(obj, file):
        file.write(b"part of a checkpoint")
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        # what torch.save raises on a real full disk (a 6 MB tmpfs, results/reliability.md)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2485824 vs 2485712")

    monkeypatch.setattr(checkpoint_io.torch, "save", disk_full)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 1500))
    with pytest.raises(SystemExit) as stop:
        io.save_checkpoint({"step": 2, "weights": torch.zeros(4000)}, path)  # 16,000 bytes of tensors
    assert str(stop.value) == (
        f"moh: no space left on device for checkpoint last.ckpt in {tmp_path}: it takes about 16.0 kB, 1.5 kB is "
        f"free there. The previous checkpoints are intact: free at least 14.5 kB more there or move the run folder "
        f"to a larger disk (--trainer.logger.init_args.save_dir), then resume with --ckpt_path last.")
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_write_error_with_room_to_spare_is_not_reported_as_a_full_disk(tmp_path, monkeypatch):
    def broken(obj, file):
        raise RuntimeError("some other failure")

    monkeypatch.setattr(checkpoint_io.torch, "save", broken)
    with pytest.raises(RuntimeError, match="some other failure"):
        AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(10)}, tmp_path / "last.ckpt")
    assert list(tmp_path.iterdir()) == []


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_disk_full_stops_a_training_run_with_the_newest_checkpoint_intact(tmp_path, monkeypatch):
    saves = []

    def fills_the_disk_at_the_third_save(obj, file):
        saves.append(obj["global_step"])
        if len(saves) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        torch.serialization.save(obj, file)

    monkeypatch.setattr(checkpoint_io.torch, "save", fills_the_disk_at_the_third_save)
    trainer = Trainer(max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[AtomicCheckpointIO()], callbacks=[StepCheckpoint(str(tmp_path), every_n_train_steps=2)])
    line = rf"^moh: no space left on device for checkpoint step=0000004.ckpt in {tmp_path}: it takes about"
    with pytest.raises(SystemExit, match=line):
        trainer.fit(Regression())
    monkeypatch.undo()
    assert saves == [2, 2, 4]  # step 2 and its last.ckpt, then step 4 failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=0000002.ckpt"]
    assert _load(tmp_path / "last.ckpt")["global_step"] == 2
