"""Checkpoint files that survive faults: a write that fails or is killed midway, a full disk, a checkpoint that does
not load.

A failed, killed or out-of-space write leaves the previous checkpoint (``AtomicCheckpointIO`` writes a temporary file
and renames it); a checkpoint that does not load (a truncated copy, a damaged archive) is moved aside, never deleted,
and ``--ckpt_path last`` continues from the next newest. The tests work on small checkpoints written here, with
``torch.save`` patched to fail or stall, and on a tiny regression Trainer, so each takes seconds; the full runs that
resume past such files are in ``test_exact_resume.py``.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from exact_runs import load_checkpoint
from faults import scramble, truncate
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning import checkpoint_io
from moh_lightning.callbacks import StepCheckpoint
from moh_lightning.checkpoint_io import AtomicCheckpointIO
from moh_lightning.runs import checkpoint_problem, latest_loadable_checkpoint

pytestmark = pytest.mark.slow


# 1. A write that fails or is killed midway ------------------------------------------------------------------------

def test_failed_checkpoint_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    def crash_mid_write(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io.torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    io.save_checkpoint({"step": 3}, path)
    assert torch.load(path)["step"] == 3


def test_the_next_write_removes_what_a_killed_write_left(tmp_path):
    """SIGKILL during a write leaves its hidden temporary file (its clean-up never ran); the next write of that
    checkpoint removes it, and nothing of another checkpoint's."""
    io = AtomicCheckpointIO()
    (tmp_path / ".last.ckpt.k1ll3d.tmp").write_bytes(b"")
    (tmp_path / ".step=4.ckpt.0ther.tmp").write_bytes(b"")
    io.save_checkpoint({"step": 5}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step=4.ckpt.0ther.tmp", "last.ckpt"]


def _stalled_writer(path: Path, writing) -> None:
    """Writes ``path`` once, then starts writing it again and stalls midway, until it is killed."""
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "weights": torch.ones(1000)}, path)

    def stalled_save(obj, file):
        file.write(b"x" * 100000)
        file.flush()
        writing.set()
        time.sleep(600)

    checkpoint_io.torch.save = stalled_save
    io.save_checkpoint({"step": 2}, path)


def test_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    # Forked from this process, which has imported torch already (a fresh interpreter took 10 s).
    context = multiprocessing.get_context("fork")
    writing = context.Event()
    writer = context.Process(target=_stalled_writer, args=(path, writing))
    writer.start()
    try:
        assert writing.wait(timeout=60)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
    assert writer.exitcode == -signal.SIGKILL
    assert torch.load(path)["step"] == 1
    # The interrupted write stays behind as a hidden temporary file that no checkpoint lookup matches.
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".ckpt") == ["last.ckpt"]


# 2. A checkpoint that does not load -------------------------------------------------------------------------------

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


def test_a_checkpoint_that_does_not_load_is_moved_aside_with_a_warning_and_the_next_newest_used(tmp_path):
    folder = _fake_run(tmp_path, (3, 6, 9))
    truncate(folder / "last.ckpt")
    scramble(folder / "step=0000009.ckpt")
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
    truncate(folder / "last.ckpt")
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # what a DDP child process reads from LOCAL_RANK / RANK
    assert latest_loadable_checkpoint(tmp_path / "runs" / "exp")[1].name == "step=0000006.ckpt"
    assert (folder / "last.ckpt").is_file() and not recwarn.list  # left to rank 0, which may be checking it now
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.warns(UserWarning, match="moved it aside"):
        assert latest_loadable_checkpoint(tmp_path / "runs" / "exp")[1].name == "step=0000006.ckpt"
    assert not (folder / "last.ckpt").exists()


def test_when_no_checkpoint_loads_the_run_stops_in_one_line_listing_them_and_renames_nothing(tmp_path):
    folder = _fake_run(tmp_path, (3,))
    truncate(folder / "last.ckpt")
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
    truncate(folder / "last.ckpt")
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


# 3. No space left for a checkpoint --------------------------------------------------------------------------------

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
    assert load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2
